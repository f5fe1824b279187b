"""Any transformers causal LM, as `from_config` builds it, under every strategy: no wrapper,
no tp_plan, no loss function, equal to one process (tests/multirank/hf_cases.py)."""
from __future__ import annotations

import pytest
import torch

import meshtrain as mt
from meshtrain.testing import run_ranks
from tests.multirank import equivalence as eq
from tests.multirank import hf_cases as hf

pytest.importorskip("transformers")

FP32_PLANS = {
    1: [dict(), dict(recompute="full"), dict(dp=2, dp_mode="dp")],   # DP: replicas in threads
    2: [dict(dp=2), dict(dp=2, zero=1), dict(dp=2, zero=2), dict(dp=2, zero=3),
        dict(dp=2, zero=2, offload="cpu"), dict(dp=2, recompute="full", microbatches=2),
        dict(tp=2), dict(pp=2, microbatches=4, schedule="1f1b"),
        dict(pp=2, microbatches=4, schedule="interleaved", virtual_stages=2)],
    4: [dict(dp=2, tp=2), dict(pp=2, tp=2, microbatches=2, schedule="1f1b")],
}
BF16_PLANS = {1: [dict(precision="bf16")], 2: [dict(dp=2, zero=1, precision="bf16")]}


def _cases(world: int) -> list[tuple[dict, str]]:
    plans = FP32_PLANS[world] + BF16_PLANS.get(world, [])
    return [(plan, model) for model in hf.NAMES for plan in plans]


@pytest.fixture(scope="module")
def references():
    return {m: (hf.reference(m), hf.reference_bf16(m)) for m in hf.NAMES}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_plan_matches_one_process(references, world):
    cases = _cases(world)
    per_rank = ((hf.train_many(cases),) if world == 1
                else run_ranks(world, hf.train_many, cases, timeout=170))
    for rank, results in enumerate(per_rank):
        for (plan, model), result in zip(cases, results):
            what = f"{model} rank {rank} {mt.Plan(**plan).describe()}"
            fp32, bf16 = references[model]
            if plan.get("precision") == "bf16":
                check_bf16(result, bf16, exact=world == 1, what=what)
            else:
                eq.assert_equivalent(result, fp32, what=what)
            assert not any("inv_freq" in k for k in result["state"]), what


BF16_ULP_AT_ONE = 2.0 ** -8


def check_bf16(result: dict, ref: dict, exact: bool, what: str) -> None:
    """One process: bit for bit the plain-torch bf16 run. dp ranks: their bf16 gradients
    summed in fp32 differ from one bf16 gradient of the whole batch by a few bf16 ulps, the
    bound test_zero.py's bf16 tests use (every parameter within one bf16 ulp at 1.0, each
    loss within 2^-8 relative)."""
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=BF16_ULP_AT_ONE, atol=0)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]),
                               **tol, msg=lambda m: f"{what}: {m}")
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=0, atol=BF16_ULP_AT_ONE)
    for name, value in ref["state"].items():
        assert result["state"][name].dtype == torch.float32, what   # the masters
        torch.testing.assert_close(result["state"][name], value, **tol,
                                   msg=lambda m: f"{what} {name}: {m}")
