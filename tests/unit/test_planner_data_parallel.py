"""The planner's data-parallel family: the busiest rank's bytes follow theory, DDP wins."""
import pytest

from meshtrain.planner import hardware, model_spec
from meshtrain.planner.data_parallel_family import family, words
from meshtrain.planner.setup import Setup


@pytest.fixture
def inputs():
    spec = model_spec.preset("gpt2-124m")
    return spec, Setup(global_batch=64), hardware.make_cluster("A100-80GB", 1, 8)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_busiest_rank_bytes_match_theory(inputs, n):
    spec, setup, cluster = inputs
    ddp, root, sharded, dp = family(spec, setup, cluster, n)
    s = spec.num_params * setup.grad_bytes   # bf16: gradients and parameters alike
    assert ddp.bytes_per_step == pytest.approx(4 * (n - 1) / n * s)
    assert root.bytes_per_step == pytest.approx(2 * (n - 1) * s)     # (N-1) S in and out
    assert root.bytes_per_step / ddp.bytes_per_step == pytest.approx(n / 2)
    assert sharded.bytes_per_step == pytest.approx(ddp.bytes_per_step)
    assert dp.bytes_per_step > root.bytes_per_step                  # + logits and their grads
    assert root.seconds >= ddp.seconds


def test_dp_beyond_a_node_is_called_impossible_and_ddp_wins_in_words(inputs):
    spec, setup, _ = inputs
    cluster = hardware.make_cluster("A100-80GB", 2, 8)
    dp = family(spec, setup, cluster)[-1]
    assert "not possible: 16 replicas exceed a node's 8 devices" in dp.note
    text = words(spec, setup, cluster)
    assert "DDP wins: a single server's root carries 8x DDP's bytes (N/2)" in text
