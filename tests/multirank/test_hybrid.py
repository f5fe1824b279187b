"""Issue 13: every composition of dp, pp and tp in {1, 2} on one mesh reproduces one-process
training of the GPT (SGD with momentum, 10 steps, 1e-5 on losses, parameters and optimizer
states), clipping by the one-process global norm (asserted in every cell).

The matrix: each (dp, pp, tp) with dp*pp*tp <= 8 x schedule {gpipe, 1f1b, interleaved V=2}
where pp > 1 x zero {0, 1, 2} where dp > 1 x sequence parallel {off, on} where tp > 1.
Each world size starts once and runs all its cells (a start costs more than a cell).
ZeRO-3 with pp > 1 is refused by the Plan itself, before any process group.
"""
import itertools

import pytest
import torch.distributed as dist

import meshtrain as mt
from meshtrain.core.plan import PlanError
from meshtrain.testing import run_ranks
from tests.multirank import equivalence as eq

MODEL = "gpt"   # 2 blocks, d_model 32, 2 heads, seq 16: embed + 2 blocks + head = 4 layers,
CLIP = 0.5      # enough for pp=2 x 2 virtual stages. The clip binds on most steps.


def cells(world: int) -> list[dict]:
    """Every plan of the matrix on `world` ranks."""
    out = []
    for dp, pp, tp in itertools.product((1, 2), repeat=3):
        if dp * pp * tp != world:
            continue
        pipes = ([dict(schedule="gpipe"), dict(schedule="1f1b"),
                  dict(schedule="interleaved", virtual_stages=2)] if pp > 1 else [{}])
        for pipe, zero, sp in itertools.product(pipes, (0, 1, 2) if dp > 1 else (0,),
                                                (False, True) if tp > 1 else (False,)):
            out.append(dict(dp=dp, pp=pp, tp=tp, zero=zero, sequence_parallel=sp,
                            microbatches=4 if pp > 1 else 1, **pipe))
    return out


@pytest.fixture(scope="module")
def reference():
    return eq.reference(MODEL, max_grad_norm=CLIP)


def test_the_matrix_covers_every_cell():
    assert [len(cells(w)) for w in (1, 2, 4, 8)] == [1, 8, 21, 18]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_every_cell_matches_one_process(reference, world):
    cases = [(plan, MODEL, CLIP) for plan in cells(world)]
    per_rank = (eq.train_many(cases),) if world == 1 else run_ranks(world, eq.train_many, cases,
                                                                   timeout=170)
    for rank, results in enumerate(per_rank):
        for (plan, _, _), result in zip(cases, results):
            what = f"rank {rank} {mt.Plan(**plan).describe()}"
            eq.assert_equivalent(result, reference, what=what)   # norms asserted there too
            assert len(result["norms"]) == 10, what
            # the loss every rank returns is the same, bit for bit
            assert result["losses"] == per_rank[0][cases.index((plan, MODEL, CLIP))]["losses"]


def test_zero3_with_pipeline_stages_is_refused_before_any_process_group():
    assert not dist.is_initialized()
    with pytest.raises(PlanError, match="zero=3 with pp=2"):
        mt.Plan(dp=2, pp=2, tp=2, zero=3)
    assert not dist.is_initialized()
