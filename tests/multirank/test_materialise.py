"""Models never whole: built on the meta device, each rank materialises only what its slots
keep (tp slices, pipeline stages, ZeRO-3 shards), and the consolidated result equals a
one-process eager build on the same seed exactly; training from it then matches one process.
"""
from __future__ import annotations

import pytest
import torch

import meshtrain as mt
from meshtrain.testing import run_ranks
from tests.multirank import equivalence as eq
from tests.multirank import hf_cases  # noqa: F401  (registers the transformers presets)

pytest.importorskip("transformers")

STEPS = 2
PLANS_2 = [dict(dp=2), dict(dp=2, zero=1), dict(dp=2, zero=2), dict(dp=2, zero=3),
           dict(tp=2), dict(pp=2, microbatches=2)]
MODELS = ("gpt", "llama-tiny", "hf-gpt2-tiny")


def eager_state(model: str) -> dict:
    torch.manual_seed(0)
    return {k: v.clone() for k, v in eq.MODELS[model][0]().state_dict().items()}


def built_and_trained(cases: list[tuple[dict, str]]) -> list[tuple[dict, dict]]:
    """(the consolidated state as materialised, the run after STEPS steps) per case."""
    return [(eq.train(mt.Plan(**plan), model, steps=0, meta=True)["state"],
             eq.train(mt.Plan(**plan), model, steps=STEPS, meta=True))
            for plan, model in cases]


def _check(cases, results):
    for (plan, model), (state, run) in zip(cases, results[0]):
        what = f"{model} {plan}"
        eager = eager_state(model)
        assert sorted(state) == sorted(eager), what
        for name, value in eager.items():
            assert torch.equal(state[name], value), f"{what}: {name} differs from the eager build"
        ref = (hf_cases.reference(model, STEPS) if model != "gpt"
               else eq.reference("gpt", steps=STEPS))
        eq.assert_equivalent(run, ref, what=what)


def test_every_slot_materialises_the_eager_build():
    cases = [(plan, MODELS[i % len(MODELS)]) for i, plan in enumerate(PLANS_2 * 2)]
    _check(cases, run_ranks(2, built_and_trained, cases, timeout=240))


def test_three_axes_and_zero3_with_tp_materialise_the_eager_build():
    cases = [(dict(dp=2, tp=2, pp=2, microbatches=2), "gpt"),
             (dict(dp=2, tp=2, pp=2, microbatches=2), "llama-tiny"),
             (dict(dp=4, tp=2, zero=3), "hf-gpt2-tiny")]
    _check(cases, run_ranks(8, built_and_trained, cases, timeout=400))
