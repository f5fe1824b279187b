"""Our DDP reproduces one-process training (plain PyTorch) on the GPT and on a tied,
awkwardly sized nn.Sequential, with gradient accumulation and global-norm clipping."""
import pytest
import torch.distributed as dist

import meshtrain as mt
from meshtrain.testing import run_ranks
from tests.multirank import equivalence as eq

# (model, optimizer, max_grad_norm): SGD with momentum for the 1e-5 check; AdamW as well
# (it holds here at world 2 and 4); clipping active in every clipped case (norms > the cap)
CASES = [("gpt", "sgd", None), ("gpt", "sgd", 0.3), ("tied", "sgd", 1.0), ("gpt", "adamw", None),
         ("tied", "adamw", 1.0)]


def train_cases(microbatches: int) -> list[dict]:
    plan = mt.Plan(dp=dist.get_world_size(), microbatches=microbatches)
    return [eq.train(plan, model, optimizer, max_grad_norm=clip)
            for model, optimizer, clip in CASES]


@pytest.fixture(scope="module")
def references():
    return [eq.reference(model, optimizer, max_grad_norm=clip) for model, optimizer, clip in CASES]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("microbatches", [1, 4])
def test_ddp_matches_one_process(references, world, microbatches):
    for results in run_ranks(world, train_cases, microbatches):
        for result, ref, case in zip(results, references, CASES):
            eq.assert_equivalent(result, ref, what=str(case))
    assert all(n > 0.3 for n in references[1]["norms"])   # the clip acted on every step
