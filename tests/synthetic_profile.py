"""A synthetic calibration profile for tests of what reads one (verify, ranking): predictions
need rates to exist, not to be right (no timed asserts)."""
CURVE = {"sizes": [256, 2**20], "busbw": [1e6, 1e9]}
ENTRY = {"matmul_flops": 1e11, "model_flops": 5e10, "mem_bw": 1e10, "optimizer_rate": 1e8,
         "collectives": {k: CURVE for k in ("all_reduce", "all_gather", "reduce_scatter",
                                              "broadcast", "p2p")},
         "runtime_memory": {"fixed": 5e6, "per_activation_byte": 0.4}}


def synthetic_profile(worlds=("1", "2", "4"), cpu_count: int = 2, host_mem: float = 8e9) -> dict:
    """A profile of `worlds` (one rank measures no collectives)."""
    return {"created": "test", "cpu_count": cpu_count, "host_mem": host_mem,
            "worlds": {w: {**ENTRY, "collectives": {}} if w == "1" else ENTRY for w in worlds}}
