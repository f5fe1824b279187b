"""`meshtrain plan --verify`: run plans the Trainer supports for real, compare with the model.

Each plan trains meshtrain's GPT on local ranks for a few steps; every rank reports the
Trainer's exact model-state bytes (parameters, gradients, optimizer states from tensor
storages), the bytes autograd saved for backward, the peak growth of its anonymous
resident memory from before the model is built, and its step time. Beside them: the planner's predictions from
the calibrated profile (`--calibrate`) of the same world size. Today the Trainer runs DDP in
fp32; each strategy joins `PLANS` as it lands.
"""
from __future__ import annotations

import statistics
import sys
import time

# (world, per-rank batch, micro-batches): DDP at several world sizes and batch sizes.
PLANS = ((1, 8, 1), (1, 16, 2), (2, 8, 1), (2, 16, 2), (4, 4, 1), (4, 8, 1))
MODEL = dict(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=256)   # "small"
LIMITS = {"model_states": 0.05, "peak": 0.15, "step": 0.30}   # the acceptance


def verify_rank(model: dict, plan: dict, batch: int, steps: int = 5, warmup: int = 2) -> dict:
    """One rank of one verification run: train, then report measured memory and time."""
    import torch
    import torch.distributed as dist

    from meshtrain.core.plan import Plan
    from meshtrain.models.gpt import GPT, GPTConfig
    from meshtrain.train.trainer import Trainer

    torch.set_num_threads(1)
    meter = AnonPeak()
    torch.manual_seed(0)
    config = GPTConfig(**model)
    trainer = Trainer(GPT(config), Plan(**plan),
                      optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                      measure_activations=True)
    gen = torch.Generator().manual_seed(1 + trainer.dp_rank)
    tokens = torch.randint(0, config.vocab_size, (batch, config.seq_len + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    times = []
    meter.start()
    for _ in range(warmup + steps):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        trainer.step(x, y)
        times.append(time.perf_counter() - t0)
    peak = meter.stop()
    report = trainer.memory_report()
    return {"step": statistics.median(times[warmup:]), "peak_growth": peak, **report.to_dict()}


class AnonPeak:
    """Peak growth of this process's anonymous resident memory (heap: tensors and the
    allocator's arenas), polled every millisecond from /proc/self/status. Unlike the peak
    RSS it leaves out library code pages that the first steps touch."""

    def __init__(self) -> None:
        import threading
        self.base = self._anon()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    @staticmethod
    def _anon() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _poll(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self._anon())

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self._anon()) - self.base


def predict(profile: dict, world: int, batch: int, m: int):
    from meshtrain.core.plan import Plan
    from meshtrain.models.gpt import GPTConfig
    from meshtrain.planner.advisor import evaluate
    from meshtrain.planner.model_spec import from_gpt_config
    from meshtrain.planner.profile import cluster_from_profile
    from meshtrain.planner.setup import Candidate, Setup

    spec = from_gpt_config(GPTConfig(**MODEL), "small")
    setup = Setup(global_batch=world * batch, micro_batch=batch // m, precision="fp32",
                  optimizer="adam", recompute="none", sequence_parallel=False)
    cand = Candidate(Plan(dp=world, microbatches=m), batch // m, "none", False)
    return evaluate(spec, cand, setup, cluster_from_profile(profile, world))


def _err(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas else float("inf")


def verify(profile: dict, plans=PLANS, steps: int = 5, out=sys.stdout) -> list[dict]:
    from meshtrain.launch import launch

    rows = []
    for world, batch, m in plans:
        results = launch(verify_rank, nproc=world,
                         args=(MODEL, {"dp": world, "microbatches": m}, batch, steps))
        ev = predict(profile, world, batch, m)
        measured = {"model_states": max(r["model_states"] for r in results),
                    "activations": max(r["activations"] for r in results),
                    "peak": max(r["peak_growth"] for r in results),
                    "step": statistics.median(r["step"] for r in results)}
        predicted = {"model_states": ev.mem.model_states, "activations": ev.mem.activations,
                     "peak": ev.mem.total, "step": ev.time.total}
        rows.append({"plan": f"DDP dp={world} batch {batch}/rank m={m}", "world": world,
                     "predicted": predicted, "measured": measured,
                     "error": {k: _err(predicted[k], measured[k]) for k in predicted}})
        print(_row(rows[-1]), file=out, flush=True)
    return rows


HEADER = (f"{'plan':<30} {'model states MB':>22} {'activations MB':>22} "
          f"{'peak MB':>22} {'step ms':>22}\n{'':<30}" + f" {'pred / meas (err)':>22}" * 4)


def _row(row: dict) -> str:
    cells = []
    for key, scale in (("model_states", 1e6), ("activations", 1e6), ("peak", 1e6), ("step", 1e-3)):
        p, m, e = row["predicted"][key], row["measured"][key], row["error"][key]
        cells.append(f"{p / scale:7.2f} /{m / scale:7.2f} ({e:+.0%})".rjust(22))
    return f"{row['plan']:<30} " + " ".join(cells)


def summary(rows: list[dict]) -> tuple[bool, str]:
    lines, ok = [], True
    for key, limit in LIMITS.items():
        worst = max(abs(r["error"][key]) for r in rows)
        passed = worst <= limit
        ok &= passed
        lines.append(f"  {key}: worst error {worst:.1%} (limit {limit:.0%}) "
                     f"{'PASS' if passed else 'FAIL'}")
    return ok, "\n".join(lines)


def verify_command(args) -> int:
    from meshtrain.planner.profile import load_profile
    profile = load_profile(args.profile)
    print(f"verifying {len(PLANS)} DDP plans of meshtrain's GPT {MODEL} (fp32, AdamW) "
          f"against the profile of {profile['created']}", file=sys.stderr)
    print(HEADER)
    rows = verify(profile)
    ok, text = summary(rows)
    print("\n" + text)
    print("peak = growth of each rank's anonymous resident memory from before the model is built; the Trainer "
          "runs DDP only today (pp, tp, ZeRO, bf16 not yet): those plans are not verified.")
    if args.json:
        import json
        print(json.dumps(rows, indent=2))
    return 0 if ok else 1
