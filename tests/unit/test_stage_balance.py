"""Pipeline stages balanced by training compute (Plan.stage_balance="compute", the default):
each layer weighed by its matmuls' forward + backward FLOPs per token, the split checked
against the optimum found here by trying every cut, from the formulas written out by hand.
The planner cuts the model spec as the pipeline cuts the modules, and prices those stages."""
from itertools import combinations
from types import SimpleNamespace

import pytest
import torch

import meshtrain as mt
from meshtrain.core.plan import PlanError
from meshtrain.models.layer_compute import layer_flops
from meshtrain.models.registry import build_model
from meshtrain.planner import Setup, make_cluster, preset
from meshtrain.planner.advisor import advise
from meshtrain.planner.compute_time import micro_batch_compute
from meshtrain.planner.memory import stage_memories
from meshtrain.planner.model_spec import from_transformers_config
from meshtrain.planner.setup import Candidate
from meshtrain.planner.stage_split import stage_blocks
from meshtrain.planner.time_model import step_time
from meshtrain.strategies.pipeline.partition import model_layers, stage_bounds

LOSS = 8   # FLOPs per logit the loss is counted at (core/stage_split.LOSS_FLOPS_PER_LOGIT)
# a Llama whose head outweighs its blocks: 6 layers, h 64, a vocabulary of 8192
V, H, INTER, HEADS, KV, L, T = 8192, 64, 128, 4, 2, 6, 128


def optimum(weights, stages):
    """Every way to cut `weights` into `stages` non-empty runs: the lightest heaviest run,
    and the bounds of each cut that reaches it."""
    n, best, where = len(weights), float("inf"), []
    for inner in combinations(range(1, n), stages - 1):
        bounds = [0, *inner, n]
        heaviest = max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))
        if heaviest < best:
            best, where = heaviest, [bounds]
        elif heaviest == best:
            where.append(bounds)
    return best, where


def blocks_of(bounds, layers):
    """Blocks (layers 1..layers) in each stage of `bounds` over [embedding, blocks, head]."""
    return [min(b, layers + 1) - max(a, 1) for a, b in zip(bounds, bounds[1:])]


def gpt2_124m_by_hand():
    V, d, L = 50304, 768, 12
    block = 6 * (4 * d * d + 8 * d * d)              # q k v o, the 4d MLP
    return [0, *[block] * L, 6 * V * d + LOSS * V]   # the lookup; the head and the loss


def llama_by_hand():
    kv_dim = KV * H // HEADS
    block = 6 * (2 * H * H + 2 * H * kv_dim + 3 * H * INTER)   # q o, k v, gate up down
    return [0, *[block] * L, 6 * V * H + LOSS * V]              # tied or not: it multiplies


def llama_config(tied, **fields):
    return dict(vocab_size=V, hidden_size=H, intermediate_size=INTER, num_hidden_layers=L,
                num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=T,
                tie_word_embeddings=tied, hidden_act="silu", rms_norm_eps=1e-6, **fields)


@pytest.fixture(scope="module")
def gpt2():
    with torch.device("meta"):
        return build_model("gpt2-124m", {}).module


def test_gpt2_layers_weigh_their_flops(gpt2):
    assert layer_flops(gpt2, model_layers(gpt2)) == pytest.approx(gpt2_124m_by_hand())


@pytest.mark.parametrize("pp", [2, 4])
def test_gpt2_124m_split_is_the_compute_optimum(gpt2, pp):
    best, where = optimum(gpt2_124m_by_hand(), pp)
    bounds = stage_bounds(gpt2, mt.Plan(pp=pp))
    assert bounds in where   # the head is worth ~5.5 blocks: at pp=4 a stage of its own
    # by parameters the 38.6M-parameter embedding pushes blocks off stage 0
    by_params = stage_bounds(gpt2, mt.Plan(pp=pp, stage_balance="parameters"))
    assert by_params[1] < bounds[1]
    # the planner cuts the spec as the pipeline cuts the modules, either way
    spec = preset("gpt2-124m")
    assert stage_blocks(spec, mt.Plan(pp=pp)) == blocks_of(bounds, 12)
    assert stage_blocks(spec, mt.Plan(pp=pp, stage_balance="parameters")) == \
        blocks_of(by_params, 12)


@pytest.mark.parametrize("pp", [2, 3])
def test_llama_with_a_large_vocabulary_is_cut_at_the_optimum(pp):
    """The planner's weights from a transformers config (read by attribute: no
    transformers imported) are the ones written by hand, and its cut their optimum."""
    weights = llama_by_hand()
    best, where = optimum(weights, pp)
    for tied in (False, True):
        spec = from_transformers_config(SimpleNamespace(**llama_config(tied)))
        split = stage_blocks(spec, mt.Plan(pp=pp))
        assert split in [blocks_of(b, L) for b in where]
        assert split[-1] < L // pp   # the head's stage runs fewer blocks than an even split


def test_llama_modules_weigh_what_the_spec_does():
    """The pipeline's weights, read from a transformers Llama's modules (tied and untied,
    built on the meta device), equal the by-hand ones the planner's split was checked on."""
    tf = pytest.importorskip("transformers")
    for tied in (False, True):
        with torch.device("meta"):
            model = tf.LlamaForCausalLM(tf.LlamaConfig(**llama_config(tied)))
        assert layer_flops(model, model_layers(model)) == pytest.approx(llama_by_hand())


def test_planner_prices_the_stage_it_cuts():
    """The Llama at pp=2: the step's compute is its slowest stage's, each stage's memory
    holds its own blocks, and the parameter-balanced cut (more blocks beside the head)
    is priced slower than the compute-balanced one."""
    spec = from_transformers_config(SimpleNamespace(**llama_config(False)), seq=T)
    cluster, setup = make_cluster("A100-80GB"), Setup(global_batch=8)
    cands = {b: Candidate(mt.Plan(pp=2, microbatches=4, stage_balance=b), 2, "none")
             for b in ("compute", "parameters")}
    for cand in cands.values():
        per_stage = [micro_batch_compute(spec, cand, cluster, 2, "bf16", s) for s in (0, 1)]
        assert micro_batch_compute(spec, cand, cluster, 2, "bf16") == max(per_stage)
        split = stage_blocks(spec, cand.plan)
        first, last = stage_memories(spec, cand, setup)
        assert first.params == pytest.approx(
            (split[0] * spec.layer_params + spec.embedding_params) * setup.param_bytes)
        assert last.params == pytest.approx(
            (split[1] * spec.layer_params + spec.head_params) * setup.param_bytes)
    assert stage_blocks(spec, cands["parameters"].plan)[1] > \
        stage_blocks(spec, cands["compute"].plan)[1]
    assert step_time(spec, cands["compute"], setup, cluster).compute < \
        step_time(spec, cands["parameters"], setup, cluster).compute


def test_stage_balance_refuses_other_values():
    with pytest.raises(PlanError, match=r"Plan.stage_balance='flops': choose one of "
                                        r"'compute', 'parameters'"):
        mt.Plan(pp=2, stage_balance="flops")


def test_advisor_balances_by_parameters_where_compute_does_not_fit():
    """Llama 3.1 8B over pp=8 at 1,024 tokens: the compute balance gives stage 0 the
    embedding and more blocks (and their in-flight activations) than the parameter balance.
    On 30 GB devices only the latter fits, and the advisor ranks it; on 80 GB devices the
    compute balance fits and the parameter balance is not priced for that layout."""
    spec = preset("llama3.1-8b", seq=1024)
    setup = Setup(global_batch=64, micro_batch=1, recompute="none")

    def layout(advice, balance):   # dp1 pp8 1F1B without ZeRO, ranked and rejected
        return [ev for ev in (*advice.ranked, *advice.rejected)
                if (ev.cand.plan.pp, ev.cand.plan.schedule, ev.cand.plan.zero,
                    ev.cand.plan.stage_balance) == (8, "1f1b", 0, balance)]

    small = make_cluster("A100-80GB", gpus_per_node=8, gpu_mem=30e9)
    advice = advise(spec, setup, small)
    [compute], [params] = layout(advice, "compute"), layout(advice, "parameters")
    assert params.mem.total <= small.usable_mem < compute.mem.total
    assert params in advice.ranked and compute in advice.rejected
    assert stage_blocks(spec, params.cand.plan)[0] < stage_blocks(spec, compute.cand.plan)[0]
    assert "pp8:1f1b:by-params" in params.cand.label()
    roomy = advise(spec, setup, make_cluster("A100-80GB", gpus_per_node=8))
    assert [ev in roomy.ranked for ev in layout(roomy, "compute")] == [True]
    assert layout(roomy, "parameters") == []
