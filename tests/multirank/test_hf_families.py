"""Six transformers decoder families beyond Llama's and GPT-2's, as `from_config` builds them
(meshtrain/models/hf_presets.py FAMILIES), under tensor and pipeline parallel and their
hybrids, equal to one process (tests/multirank/hf_cases.py): per-head q/k norms (qwen3:
'replicated'), whole-width q/k norms on gathered projections (olmo2: 'column_gather' /
'row_split'), fused q/k/v and gate/up (phi3), soft-capped logits with a tied, scaled
embedding, a padding row and sliding windows (gemma2), a parallel residual with a fused
per-head q/k/v (gpt-neox), and a family with no tp plan of its own (stablelm, derived).

Every family runs tp=2, pp=2, dp x tp and pp x tp, and tp=2 with sequence parallel; the
schedules (1F1B, interleaved), ZeRO-3, recompute and the build on the meta device (each rank materialising what it keeps,
as `meshtrain train` builds) are spread over the families pairwise, not crossed with all of
them. One launch per world size runs every cell."""
from __future__ import annotations

import warnings

import pytest

import meshtrain as mt
from meshtrain.models.hf_presets import FAMILIES
from meshtrain.testing import run_ranks
from tests.multirank import equivalence as eq
from tests.multirank import hf_cases as hf

pytest.importorskip("transformers")

STEPS = 3
ONE_F_ONE_B = dict(pp=2, microbatches=2, schedule="1f1b")
INTERLEAVED = dict(pp=2, microbatches=2, schedule="interleaved", virtual_stages=2)
# (plan, the families it runs on, built on the meta device): each family under tp, pp,
# dp x tp and pp x tp
PLANS = {
    2: [(dict(tp=2), FAMILIES, False),
        (ONE_F_ONE_B, FAMILIES[0::2], True), (INTERLEAVED, FAMILIES[1::2], False),
        (dict(dp=2, zero=3), FAMILIES[0::2], False),
        (dict(tp=2, sequence_parallel=True), (*FAMILIES[0::2], "hf-gpt2-tiny"), False),
        (dict(tp=2, sequence_parallel=True, recompute="full"), FAMILIES[1::2], True)],
    4: [(dict(dp=2, tp=2), FAMILIES, False),
        (dict(pp=2, tp=2, microbatches=2, schedule="1f1b"), FAMILIES[1::2], True),
        (dict(pp=2, tp=2, microbatches=2, schedule="interleaved", virtual_stages=2,
              recompute="full"), FAMILIES[0::2], False)],
}


def _cases(world: int) -> list[tuple[dict, str, bool]]:
    return [(plan, family, meta) for plan, families, meta in PLANS[world]
            for family in families]


def train_quietly(cases: list[tuple[dict, str, bool]]) -> list[dict]:
    """Each case trained STEPS steps, without the derived plan's notice on every rank."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [eq.train(mt.Plan(**plan), model, steps=STEPS, meta=meta)
                for plan, model, meta in cases]


@pytest.fixture(scope="module")
def references():
    models = {m for world in PLANS for _, families, _ in PLANS[world] for m in families}
    return {model: hf.reference(model, steps=STEPS) for model in models}


@pytest.mark.parametrize("world", [2, 4])
def test_every_family_matches_one_process(references, world):
    cases = _cases(world)
    for rank, results in enumerate(run_ranks(world, train_quietly, cases, timeout=240)):
        for (plan, family, meta), result in zip(cases, results):
            what = f"{family} rank {rank} {mt.Plan(**plan).describe()}{' (meta)' * meta}"
            eq.assert_equivalent(result, references[family], what=what)


def test_each_family_is_in_every_acceptance_plan():
    """tp=2, pp=2, dp x tp and pp x tp for each family; both schedules, ZeRO-3, recompute."""
    for family in FAMILIES:
        plans = [p for world in PLANS for p, fams, _ in PLANS[world] if family in fams]
        assert any(p.get("tp") == 2 and "pp" not in p and "dp" not in p for p in plans)
        assert any(p.get("pp") == 2 and "tp" not in p for p in plans)
        assert any(p.get("dp") == 2 and p.get("tp") == 2 for p in plans)
        assert any(p.get("pp") == 2 and p.get("tp") == 2 for p in plans)
    every = [p for world in PLANS for p, _, _ in PLANS[world]]
    for wanted in ({"schedule": "1f1b"}, {"schedule": "interleaved"}, {"zero": 3},
                   {"recompute": "full"}, {"sequence_parallel": True}):
        assert any(wanted.items() <= p.items() for p in every), wanted
