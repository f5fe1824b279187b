"""Tensor parallel reproduces one-process training (plain PyTorch): the GPT with and without
sequence parallel, micro-batches 1 and 2, at tp = 2 and 4; transformers' GPT-2 through the
README's tp_plan; global-norm clipping; one dp = 2 x tp = 2 cell through DDP.

[Note: AdamW and round-off]
Adam's first step moves each weight by lr * g / (|g| + eps): where the true gradient is
(near) zero, fp32 round-off in g (any other summation order, e.g. a row-parallel layer's
partial sums) becomes an lr-sized difference. GPT-2's key bias has a zero true gradient
(softmax cancels it), and an embedding element whose gradient is a cancellation (~5e-8 from
terms ~1e-2) behaves the same, and so does a near-zero element of the GPT's MLP at the
harness's batch of 48 (1.013e-5 in fp32). So AdamW runs in float64, where the round-off is
1e-16; SGD with momentum runs in fp32 everywhere. Every comparison is at the harness's 1e-5.
"""
import pytest
import torch
import torch.distributed as dist

import meshtrain as mt
from meshtrain.testing import run_ranks
from tests.multirank import equivalence as eq

# (sequence_parallel, microbatches, optimizer, max_grad_norm, dtype) on the 4-head GPT whose
# vocabulary of 62 tp = 4 pads to 64
F64 = torch.float64
CLIP = 0.2   # below every step's gradient norm in both models: the clip acts on every step
GPT_CASES = [(False, 1, "sgd", CLIP, None), (False, 2, "adamw", None, F64),
             (True, 1, "adamw", None, F64), (True, 2, "sgd", CLIP, None)]
HF_CASES = [("sgd", CLIP, None), ("adamw", None, torch.float64)]
HAS_TRANSFORMERS = True
try:
    import transformers  # noqa: F401
except ImportError:
    HAS_TRANSFORMERS = False


def train_gpt_cases() -> list[dict]:
    tp = dist.get_world_size()
    return [eq.train(mt.Plan(tp=tp, sequence_parallel=sp, microbatches=mb), "gpt_tp", opt,
                     max_grad_norm=clip, dtype=dtype) for sp, mb, opt, clip, dtype in GPT_CASES]


def train_hf_cases() -> list[dict]:
    plan = mt.Plan(tp=dist.get_world_size())
    return [eq.train(plan, "hf_gpt2", opt, max_grad_norm=clip, dtype=dtype,
                     tp_plan=eq.HF_GPT2_TP_PLAN) for opt, clip, dtype in HF_CASES]


def train_dp_tp() -> dict:
    return eq.train(mt.Plan(dp=2, tp=2), "gpt_tp", "sgd", max_grad_norm=CLIP)


@pytest.fixture(scope="module")
def gpt_references():
    return [eq.reference("gpt_tp", opt, max_grad_norm=clip, dtype=dtype)
            for _, _, opt, clip, dtype in GPT_CASES]


@pytest.mark.parametrize("world", [2, 4])
def test_gpt_matches_one_process(gpt_references, world):
    for rank, results in enumerate(run_ranks(world, train_gpt_cases)):
        for result, ref, case in zip(results, gpt_references, GPT_CASES):
            eq.assert_equivalent(result, ref, what=f"tp={world} rank {rank} {case}")
    assert all(n > CLIP for n in gpt_references[0]["norms"])   # the clip acted on every step


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers (pip install -e '.[hf]')")
@pytest.mark.parametrize("world", [2, 4])
def test_transformers_gpt2_matches_one_process_through_its_tp_plan(world):
    refs = [eq.reference("hf_gpt2", opt, max_grad_norm=clip, dtype=dtype)
            for opt, clip, dtype in HF_CASES]
    for rank, results in enumerate(run_ranks(world, train_hf_cases)):
        for result, ref, case in zip(results, refs, HF_CASES):
            eq.assert_equivalent(result, ref, what=f"GPT-2 tp={world} rank {rank} {case}")
    assert all(n > CLIP for n in refs[0]["norms"])


def test_dp2_tp2_through_ddp_matches_one_process(gpt_references):
    for rank, result in enumerate(run_ranks(4, train_dp_tp)):
        eq.assert_equivalent(result, gpt_references[0], what=f"dp=2 x tp=2 rank {rank}")


def test_readme_shows_the_gpt2_tp_plan():
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    for pattern, style in eq.HF_GPT2_TP_PLAN.items():
        assert f'"{pattern}": "{style}"' in readme, pattern
