"""The planner's pricing of mixtures of experts and expert parallel (planner/experts.py,
model_spec's MoE fields): expected values written out by hand, or counted on the real
transformers modules (built on the meta device here; the planner itself stays pure)."""
import pytest
import torch

from meshtrain.core.plan import Plan
from meshtrain.core.gpt_shapes import GPT_SHAPES
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.planner import activations as am
from meshtrain.planner import experts as epm
from meshtrain.planner import from_description, make_cluster
from meshtrain.planner.advisor import advise
from meshtrain.planner.guide import verdict
from meshtrain.planner.memory import memory
from meshtrain.planner.model_spec import (ModelSpecError, from_gpt_config,
                                          from_transformers_config)
from meshtrain.planner.setup import Candidate, Setup, SetupError

# Mixtral-8x7B's shape: 32 layers, h 4096, 8 K/V heads of 32, 8 experts of 14336, top 2
MIXTRAL = from_description(32, 4096, 32, 32000, 4096, ffn=14336, kv_heads=8, mlp="swiglu",
                           bias=False, norm="rmsnorm", tied=False, learned_pos=False,
                           dropout=False, flash_attention=True, experts=8, top_k=2)
EXPERTS = 32 * 8 * 3 * 4096 * 14336          # every layer's routed experts' weights
BF16 = Setup(global_batch=8)                 # 2-byte weights, gradients, activations; K = 12


def _cand(recompute="none", b=1, **plan):
    return Candidate(Plan(**plan), b, recompute)


@pytest.mark.parametrize("name", ["mixtral-tiny", "qwen3-moe-tiny"])
def test_parameter_count_equals_the_real_modules(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from meshtrain.models.hf_presets import config_of

    config = config_of(name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    spec = from_transformers_config(config)
    assert (spec.experts, spec.top_k) == (4, 2)
    # the spec does not model Qwen3's per-head q/k norms: the module's count less them
    qk_norms = sum(p.numel() for n, p in model.named_parameters()
                   if n.endswith(("q_norm.weight", "k_norm.weight")))
    assert spec.num_params == sum(p.numel() for p in model.parameters()) - qk_norms
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert spec.layers * spec.layer_expert_params == experts


def test_a_token_computes_with_its_top_k_experts_only():
    # per token: attention q, o (h x h) and k, v (h x kv), the router (h x 8), and 2 of the
    # 8 experts' 3 matrices; the layer holds all 8
    attn = 2 * 4096 * 4096 + 2 * 4096 * 1024
    assert MIXTRAL.layer_matmul_params == attn + 4096 * 8 + 2 * 3 * 4096 * 14336
    assert MIXTRAL.layer_params == attn + 4096 * 8 + 8 * 3 * 4096 * 14336 + 2 * 4096
    # Mixtral 8x7B: 46.7B parameters (Jiang et al. 2024)
    assert MIXTRAL.num_params == pytest.approx(46.7e9, rel=1e-3)


def test_expert_states_split_over_ep_and_shard_over_the_expert_data_parallel_group():
    psi = MIXTRAL.num_params
    dense = psi - EXPERTS
    # dp 4, ep 2: each rank holds half the experts; weights and gradients 2 bytes each
    mem = memory(MIXTRAL, _cand(dp=4, ep=2), BF16)
    assert mem.params == 2 * (dense + EXPERTS / 2)
    assert mem.optim == 12 * (dense + EXPERTS / 2)
    # ZeRO-1 shards optimizer states: the dense ones over dp = 4, each expert's over its
    # expert-data-parallel group of dp / ep = 2
    mem = memory(MIXTRAL, _cand(dp=4, ep=2, zero=1), BF16)
    assert mem.optim == pytest.approx(12 * (dense / 4 + EXPERTS / 2 / 2))
    assert mem.params == 2 * (dense + EXPERTS / 2)
    # without ep the experts are dense weights to every strategy
    assert memory(MIXTRAL, _cand(dp=4), BF16).params == 2 * psi


def test_all_to_all_bytes_are_tokens_times_top_k_times_hidden_twice_each_way():
    # 4096 tokens x 2 experts x 4096 wide x 2 bytes = 64 MiB per all-to-all; dispatch and
    # combine forward and backward: 4 a layer, each rank sending (ep-1)/ep of each
    buffer = 4096 * 2 * 4096 * 2
    assert epm.dispatch_bytes(MIXTRAL, _cand(dp=4, ep=4), BF16) == buffer
    assert epm.layer_bytes(MIXTRAL, _cand(dp=4, ep=4), BF16) == 4 * buffer * 3 / 4
    # full recomputation dispatches and combines again in the re-run forward
    assert epm.layer_bytes(MIXTRAL, _cand("full", dp=4, ep=4), BF16) == 6 * buffer * 3 / 4
    assert epm.layer_bytes(MIXTRAL, _cand(dp=4), BF16) == 0.0


def test_imbalance_scales_the_busiest_ranks_traffic_and_routed_work():
    # 4 ranks inside a node at 200 GB/s, 5 us per step of the all-to-all (3 steps)
    cluster = make_cluster("H100-80GB", 1, 8, intra_bw="200GB/s")
    buffer = 4096 * 2 * 4096 * 2
    a2a = lambda nbytes: 3 * 5e-6 + nbytes * 3 / 4 / 200e9   # noqa: E731
    even = epm.exposed_time(MIXTRAL, _cand(dp=4, ep=4), BF16, cluster, span=4)
    assert even == pytest.approx(32 * 4 * a2a(buffer), rel=1e-12)
    skewed = Setup(global_batch=8, expert_imbalance=1.5)
    # the busiest rank receives 1.5x the tokens, and computes 0.5x more routed work: 2 of
    # 3 matrices of 4096 x 14336 per token, 2 FLOPs a weight, forward and backward (x3)
    routed = 0.5 * 3 * 4096 * 2 * 2 * 3 * 4096 * 14336 / cluster.achievable_flops
    assert epm.exposed_time(MIXTRAL, _cand(dp=4, ep=4), skewed, cluster, span=4) == \
        pytest.approx(32 * (4 * a2a(1.5 * buffer) + routed), rel=1e-12)
    assert epm.transient_bytes(MIXTRAL, _cand(dp=4, ep=4), skewed) == 2 * 1.5 * buffer


def test_a_capacity_factor_caps_what_is_sent_and_the_busiest_ranks_share():
    buffer = 4096 * 2 * 4096 * 2   # b s k h e, dropless
    skewed = Setup(global_batch=8, expert_imbalance=1.5)
    # C = 0.5: every expert takes at most half its even share, so half the copies are sent
    # and no rank receives more than that half
    half = _cand(dp=4, ep=4, capacity_factor=0.5)
    assert epm.layer_bytes(MIXTRAL, half, BF16) == 4 * 0.5 * buffer * 3 / 4
    assert epm.transient_bytes(MIXTRAL, half, skewed) == 2 * 0.5 * buffer
    # C = 1.25 >= 1: what is sent may all fit, but the busiest rank's 1.5x is capped at 1.25x
    loose = _cand(dp=4, ep=4, capacity_factor=1.25)
    assert epm.layer_bytes(MIXTRAL, loose, BF16) == 4 * buffer * 3 / 4
    assert epm.transient_bytes(MIXTRAL, loose, skewed) == 2 * 1.25 * buffer
    assert epm.transient_bytes(MIXTRAL, _cand(dp=4, ep=4, capacity_factor=2.0), skewed) == \
        2 * 1.5 * buffer
    # saved activations follow the rows computed: half the copies under ep, all of them in
    # one process (a dropped row is computed there, times 0)
    assert epm.routed_rows(MIXTRAL, half) == 1.0
    assert epm.routed_rows(MIXTRAL, _cand(capacity_factor=0.5)) == 2
    saved = [am.full_layer_bytes(MIXTRAL, c, BF16) for c in (_cand(dp=4, ep=4), half)]
    row = (3 * 4096 + 4 * 14336) * 2 + 20
    assert saved[0] - saved[1] == pytest.approx(4096 * 1 * row, rel=1e-12)


def test_the_advisor_ranks_ep_plans_for_a_mixture_and_none_for_a_dense_model():
    # four nodes of 8 H100s, one sequence a micro-batch, per-op recomputation (a small
    # enumeration): the fastest plan splits the experts over ep with ZeRO-3 over dp, no tp
    # (the experts stay whole on every tp rank, so tp only adds their copies); at global
    # batch 16 a pp x cp plan without ep runs ahead: too few sequences for 32 replicas
    cluster = make_cluster("H100-80GB", 4, 8)
    advice = advise(MIXTRAL, Setup(global_batch=32, micro_batch=1, recompute="selective"),
                    cluster)
    top = advice.ranked[0]
    assert top.cand.plan.ep > 1 and top.time.ep_comm > 0
    assert all(MIXTRAL.experts % ev.cand.plan.ep == 0 and ev.cand.plan.dp % ev.cand.plan.ep == 0
               for ev in advice.ranked)
    v = verdict(advice)
    moe = next(q for q in v.questions if q.question == "Is it a mixture of experts?")
    assert "priced dropless" in moe.numbers
    assert v.family.startswith("expert parallel") and v.agrees
    dense = from_description(2, 256, 4, 1000, 128)
    assert epm.ep_sizes(dense, 8) == [1] and epm.ep_sizes(MIXTRAL, 6) == [1, 2]


def test_bad_moe_input_is_refused_by_name():
    with pytest.raises(ModelSpecError, match="top_k=3 with 2 experts"):
        from_description(2, 64, 4, 256, 128, experts=2, top_k=3)
    with pytest.raises(SetupError, match="--expert-imbalance 0.5"):
        Setup(expert_imbalance=0.5)


def test_bytes_per_step_count_the_all_to_alls():
    from meshtrain.planner.traffic import axis_bytes

    buffer = 4096 * 2 * 4096 * 2   # b s k h e, as above
    out = axis_bytes(MIXTRAL, _cand(dp=4, ep=4), BF16)
    assert out["ep"] == 32 * 4 * buffer * 3 / 4


def test_plan_takes_the_imbalance_and_refuses_a_bad_one(capsys):
    from meshtrain.cli.main import main

    args = ["plan", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "256",
            "--seq", "128", "--gpu", "H100-80GB", "--json"]
    assert main([*args, "--expert-imbalance", "0.5"]) == 2
    assert "--expert-imbalance 0.5" in capsys.readouterr().err
    assert main([*args, "--expert-imbalance", "1.25"]) == 0
    assert '"expert_imbalance": 1.25' in capsys.readouterr().out


def test_expert_gradients_travel_over_their_expert_data_parallel_group_only():
    from meshtrain.planner.traffic import axis_bytes

    # dp 4, ep 2, DDP: the dense gradients all-reduced over 4 ranks, 2 x 3/4 of them; each
    # rank's half of the experts over its group of 2, 2 x 1/2; 2 bytes each
    dense = MIXTRAL.num_params - EXPERTS
    out = axis_bytes(MIXTRAL, _cand(dp=4, ep=2), BF16)
    assert out["dp"] == pytest.approx(2 * 3 / 4 * dense * 2 + 2 * 1 / 2 * EXPERTS / 2 * 2)
    # ep = dp: every expert lives on one rank, its gradients go nowhere
    assert axis_bytes(MIXTRAL, _cand(dp=4, ep=4), BF16)["dp"] == pytest.approx(
        2 * 3 / 4 * dense * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixtures_saved_tensors_are_priced_per_token_and_routed_row(dtype):
    """gpt-moe-tiny's MoE layers run for real, autograd's saved tensors counted by storage
    (parameters and the MLP's input, priced with the layer, left out): the router's and
    every routed row's, as experts.saved_bytes_per_token prices them; the whole layer as
    layer_activation_bytes does, but for the norms' statistics and attention's log-sum-exp
    (4 + heads numbers per token), which no GPT's price counts."""
    shape = GPT_SHAPES["gpt-moe-tiny"]
    torch.manual_seed(0)
    model = GPT(GPTConfig(**shape)).to(dtype).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved, where, inputs = {}, [None], set()   # storage -> (where first saved, bytes)

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if where[0] is not None and ptr not in params and ptr not in saved:
            region = "layers" if ptr in inputs else where[0]   # the MLP's input: the layer's
            saved[ptr] = (region, t.untyped_storage().nbytes())
        return t

    def enter(name):
        def hook(module, args):
            where[0] = name
            if name == "mlp":
                inputs.add(args[0].untyped_storage().data_ptr())
        return hook

    for block in model.blocks:
        block.register_forward_pre_hook(enter("layers"))
        block.mlp.register_forward_pre_hook(enter("mlp"))
        block.mlp.register_forward_hook(lambda *a: where.__setitem__(0, "layers"))
    model.blocks[-1].register_forward_hook(lambda *a: where.__setitem__(0, None))
    batch, elem = 2, dtype.itemsize
    tokens = torch.randint(0, shape["vocab_size"], (batch, shape["seq_len"]))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    spec = from_gpt_config(model.config)
    moe = sum(n for region, n in saved.values() if region == "mlp")
    assert moe == spec.layers * batch * spec.seq * epm.saved_bytes_per_token(spec, 2, elem)
    layer = am.layer_activation_bytes(spec, spec.seq, batch, elem_bytes=elem)
    # two LayerNorms' mean and rstd (on CPU in their input's dtype), attention's fp32 lse
    stats = batch * spec.seq * (2 * 2 * elem + 4 * spec.heads)
    assert sum(n for _, n in saved.values()) == spec.layers * (layer + stats)


def test_the_heap_counts_a_mixtures_layer_as_a_dense_mlp_of_one_expert_and_a_dense_one_as_before():
    """The runtime heap's unit: a dense layer's full bytes (unchanged: what the heap was
    calibrated on), a mixture's with its router and routed rows replaced by one expert's
    dense SwiGLU hidden (4 I per token): gpt-moe-tiny's as a dense GPT with an MLP 512 wide."""
    from dataclasses import replace

    fp32 = Setup(global_batch=8, precision="fp32")
    moe = from_gpt_config(GPTConfig(**GPT_SHAPES["gpt-moe-tiny"]))
    dense = replace(moe, experts=0, top_k=0, expert_ffn=0, ffn=512)
    for cand in (_cand(b=8), _cand(b=4, dp=2, ep=2), _cand(b=8, dp=2, ep=2, capacity_factor=0.5)):
        heap = am.heap_layer_bytes(moe, cand, fp32)
        assert heap == am.full_layer_bytes(dense, cand, fp32)
        # by hand: the router's 4 E + 12 k + 4 bytes and k rows of (3 h + 4 I) e + 20 bytes
        # a token out, one expert's 4 I e in
        rows = epm.routed_rows(moe, cand)
        out = 4 * 4 + 12 * 2 + 4 + rows * ((3 * 128 + 4 * 512) * 4 + 20)
        assert heap == am.full_layer_bytes(moe, cand, fp32) - 128 * cand.micro_batch * (
            out - 4 * 512 * 4)
        assert am.forward_traffic(moe, cand, fp32, 0)[0] == heap
    # a dense model's heap unit is its full layer, as before, under every recomputation
    tiny = from_gpt_config(GPTConfig(**GPT_SHAPES["tiny"]))
    for cand in (_cand(b=8), _cand("selective", b=4, tp=2), _cand("full", b=8, pp=2)):
        assert am.heap_layer_bytes(tiny, cand, fp32) == am.full_layer_bytes(tiny, cand, fp32)
        first, rest = am.forward_traffic(tiny, cand, fp32, 0)
        assert first == am.full_layer_bytes(tiny, cand, fp32)


def test_tensor_parallel_keeps_a_mixtures_router_and_experts_whole():
    """meshtrain's tp keeps a mixture's router and experts whole on every rank (models/
    hf_plans.py, tensor_parallel/gpt.py): the planner's rank holds them whole beside its
    share of the rest, counted from mixtral-tiny's real modules; and the advisor ranks no
    sequence-parallel plan for a mixture (models/moe.py refuses it)."""
    transformers = pytest.importorskip("transformers")
    from meshtrain.models.hf_presets import config_of
    from meshtrain.planner.states import stage_params

    config = config_of("mixtral-tiny")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    spec = from_transformers_config(config)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    whole = sum(v for n, v in sizes.items() if ".mlp." in n or "norm" in n)
    for tp in (2, 4):
        assert stage_params(spec, Plan(tp=tp)) == (sum(sizes.values()) - whole) / tp + whole
        assert epm.stage_expert_params(spec, _cand(tp=tp)) == \
            sum(v for n, v in sizes.items() if ".experts." in n)
    advice = advise(MIXTRAL, Setup(global_batch=32, micro_batch=1, recompute="selective"),
                    make_cluster("H100-80GB", 1, 8))
    tp_plans = [ev for ev in (*advice.ranked, *advice.rejected) if ev.cand.plan.tp > 1]
    assert tp_plans and not any(ev.cand.sp for ev in tp_plans)
