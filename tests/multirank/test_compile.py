"""Issue 29 item 1: compiled blocks (`Plan(compile=...)`) reproduce one eager process under every
strategy family: one process, DP with a master device (replicas in threads), DDP, ZeRO-1/2/3,
the parameter server (synchronous, and asynchronous at staleness 0), recompute (full and
selective), a pipeline schedule, tensor parallel with and without sequence parallel, 2D plans;
and on transformers' GPT-2 and in bf16. Local SGD and DiLoCo, which are not one process's
training, reproduce their own eager runs.

Tolerance: the project's own 1e-5 on losses, parameters and optimizer states (SGD with
momentum); bf16 meets eager bf16's own round-off check. Inductor fuses and reorders float work;
measured on this very case (the tiny GPT, one process, 10 steps) compiled blocks end at most
4.8e-7 from eager (transformers' GPT-2: 1.3e-7 after 4 steps), so 1e-5 leaves a 20x margin and
needs no loosening; aot_eager ends bit-equal.

Backends: inductor is slow to compile on a CPU, so it runs where one graph serves many plans:
the one-process test and the world-2 group (DDP, ZeRO-1/2/3, ps-sync, ps-async, full recompute
and a pipeline, whose blocks all see the same 24-sample micro-batch: one graph, compiled once
and then read from inductor's on-disk cache). transformers' GPT-2, bf16, selective recompute
(checkpoint traced inside the block), tensor parallel, sequence parallel, the 2D plans, DP with
a master and the local SGD / DiLoCo pairs run with aot_eager, which traces and partitions the
same graphs (the part that meets hooks, storage resizing and autograd functions) without
generating code. Inductor compiles in the process (compile_threads=1): a pool of compile
workers per rank costs more than it saves on graphs this small.

Each case proves on its own that it ran compiled: the backend is wrapped so that every run
of a compiled block graph is counted, and a case counts its own runs (graphs compiled are
no proof: a later case reads the earlier ones' from dynamo's cache, and an uncompiled case
would equal the reference all the same).
"""
import pytest

import meshtrain as mt
from meshtrain.testing import run_ranks
from tests.multirank import equivalence as eq
from tests.multirank import hf_cases as hf   # registers the transformers presets

MODEL, STEPS = "gpt", 4    # 2 blocks, d_model 32, 2 heads, seq 16; global batch 48


_RUNS = [0]          # compiled block graphs run in this process
_COUNTING: dict = {}  # backend name -> its counting wrapper, one object per name


def _counting(backend):
    """`backend`, each graph it compiles counting its runs in _RUNS. One wrapper per name:
    dynamo keys its cache on the backend, so graphs stay shared between cases as before."""
    if backend not in _COUNTING:
        from torch._dynamo import lookup_backend
        real = lookup_backend(backend)

        def compile_counted(gm, example_inputs):
            compiled = real(gm, example_inputs)

            def run(*args):
                _RUNS[0] += 1
                return compiled(*args)
            return run
        _COUNTING[backend] = compile_counted
    return _COUNTING[backend]


def train_counted(cases: list[dict]) -> list[dict]:
    """eq.train for each plan's fields (and "model") on this rank, with what dynamo did:
    "runs", the compiled block graphs this case ran (its own proof that it ran compiled),
    and graphs compiled and graph breaks counted from the first case to this one."""
    from unittest import mock

    from torch._dynamo.utils import counters
    from torch._inductor import config

    from meshtrain.strategies import compile as compiling

    real_compile_block = compiling._compile_block

    def compile_block(block, backend, mode=None):
        real_compile_block(block, _counting(backend), mode)

    out = []
    graphs = lambda: counters["stats"]["unique_graphs"]
    breaks = lambda: sum(counters["graph_break"].values())
    first = graphs(), breaks()
    with config.patch(compile_threads=1), mock.patch.object(compiling, "_compile_block",
                                                            compile_block):
        for fields in cases:
            fields = dict(fields)
            model = fields.pop("model", MODEL)
            runs = _RUNS[0]
            result = eq.train(mt.Plan(**fields), model, steps=STEPS)
            result["runs"] = _RUNS[0] - runs
            result["graphs"], result["breaks"] = graphs() - first[0], breaks() - first[1]
            out.append(result)
    return out


@pytest.fixture(scope="module")
def reference():
    return eq.reference(MODEL, steps=STEPS)


def _check(cases, per_rank, reference, tp_breaks: bool) -> None:
    for rank, results in enumerate(per_rank):
        for fields, result in zip(cases, results):
            eq.assert_equivalent(result, reference, what=f"rank {rank} {fields}")
            _ran_compiled(fields, result, rank)
        assert results[-1]["graphs"] >= 1, f"rank {rank}: nothing was compiled"
        assert (results[-1]["breaks"] > 0) == tp_breaks, (rank, results[-1]["breaks"])


def _ran_compiled(fields, result, rank) -> None:
    """Every rank runs at least one block's compiled forward per micro-batch of every step
    (a pipeline stage holds one of the two blocks), on a case's own count."""
    least = STEPS * fields.get("microbatches", 1)
    assert result["runs"] >= least, f"rank {rank} {fields}: {result['runs']} compiled runs"


def test_one_process_compiled_matches_eager(reference):
    cases = [dict(compile=True, microbatches=2), dict(compile=True, microbatches=2,
                                                      recompute="full")]
    _check(cases, [train_counted(cases)], reference, tp_breaks=False)


def test_master_dp_replicas_compiled(reference):
    """DP with a master device: each replica's blocks run a compiled forward of their own
    (a deep copy would share the master's), in the replicas' threads, as one process."""
    from meshtrain.strategies.compile import blocks_of

    fields = dict(dp=2, dp_mode="dp", compile="aot_eager", microbatches=2)
    trainer = mt.Trainer(eq.gpt(), mt.Plan(**fields), optimizer=eq.sgd)
    master, replica = trainer.data_parallel.replicas
    for mine, theirs in zip(blocks_of(replica), blocks_of(master)):
        assert "forward" in vars(mine) and mine.forward is not theirs.forward
    trainer.close()
    _check([fields], [train_counted([fields])], reference, tp_breaks=False)


def test_transformers_decoder_layers_compiled():
    """transformers' GPT-2, its decoder layers compiled (whole graphs, no break)."""
    cases = [dict(compile="aot_eager", model="hf_gpt2")]
    _check(cases, [train_counted(cases)], eq.reference("hf_gpt2", steps=STEPS),
           tp_breaks=False)


def test_bf16_compiled_within_bf16_round_off():
    """bf16 parameters and fp32 masters (the GPU's precision): compiled as eager, within
    bf16's round-off of one plain-PyTorch bf16 process (what eager bf16 is held to)."""
    from tests.multirank.test_zero import check_within_bf16_round_off

    (result,) = train_counted([dict(compile="aot_eager", precision="bf16", microbatches=2)])
    check_within_bf16_round_off(result, eq.reference_bf16(MODEL, steps=STEPS))
    assert result["graphs"] >= 1 and result["breaks"] == 0


WORLD2 = [dict(dp=2, compile=True), dict(dp=2, zero=1, compile=True),
          dict(dp=2, zero=2, compile=True), dict(dp=2, zero=3, compile=True),
          dict(dp=2, zero=3, recompute="full", compile=True),
          dict(dp=2, recompute="selective", compile="aot_eager"),
          dict(pp=2, microbatches=2, schedule="1f1b", compile=True),
          dict(dp=2, dp_mode="ps-sync", compile=True),
          dict(dp=2, dp_mode="ps-async", compile=True)]   # staleness 0: exact


# Local SGD and DiLoCo (H = 2: two syncs in four steps, the outer step with momentum) are
# not one process's training: each is held to its own eager run. (Their special cases equal
# DDP eagerly: test_diloco.py.)
PERIODIC = [dict(dp=2, dp_mode="local-sgd", sync_every=2),
            dict(dp=2, dp_mode="diloco", sync_every=2, outer_lr=0.7, outer_momentum=0.9)]
PAIRS = [case for fields in PERIODIC for case in (fields, dict(fields, compile="aot_eager"))]


def test_data_parallel_zero_pipeline_recompute_compiled(reference):
    per_rank = run_ranks(2, train_counted, WORLD2 + PAIRS, timeout=300)
    n = len(WORLD2)
    _check(WORLD2, [results[:n] for results in per_rank], reference, tp_breaks=False)
    for rank, results in enumerate(per_rank):
        pairs = results[n:]
        for fields, eager, compiled in zip(PERIODIC, pairs[::2], pairs[1::2]):
            eq.assert_equivalent(compiled, eager, what=f"rank {rank} {fields} compiled")
            assert eager["state"] and eager["losses"] != reference["losses"], fields
        # the first aot_eager case traced a graph of its own (the later one reuses it)
        assert results[n + 1]["graphs"] > results[n]["graphs"], f"rank {rank}: not compiled"


WORLD4 = [dict(tp=2, dp=2, compile="aot_eager"),
          dict(tp=2, dp=2, sequence_parallel=True, compile="aot_eager"),
          dict(tp=2, pp=2, microbatches=2, compile="aot_eager"),
          dict(dp=2, pp=2, zero=1, microbatches=2, compile="aot_eager")]


def test_tensor_parallel_and_2d_compiled(reference):
    _check(WORLD4, run_ranks(4, train_counted, WORLD4, timeout=300), reference,
           tp_breaks=True)


def test_mixture_of_experts_compiled_under_expert_parallel():
    """Mixtral (its router loss on) with its experts split over ep=2: the decoder layers
    compiled, the experts' uneven all-to-all left outside the graphs (graph breaks), equal
    to one eager process computing what transformers computes."""
    cases = [dict(dp=2, ep=2, compile="aot_eager", model="mixtral-tiny")]
    _check(cases, run_ranks(2, train_counted, cases, timeout=200),
           hf.reference("mixtral-tiny", steps=STEPS), tp_breaks=True)
