"""The planner's pricing of context parallel (planner/context_parallel.py): every expected
value is written out from the formula by hand, never computed by the function under test."""
import pytest

from meshtrain.core.plan import Plan
from meshtrain.planner import context_parallel as cpm
from meshtrain.planner import from_description, make_cluster
from meshtrain.planner.advisor import advise, evaluate
from meshtrain.planner.guide import verdict
from meshtrain.planner.memory import memory
from meshtrain.planner.setup import Candidate, Setup
from meshtrain.planner.time_model import step_time

# a Llama-70B-shaped layer with grouped-query attention: h 8192, 64 heads, 8 of them K/V
# (kv width 1024), fused attention (no s x s scores), 4096 tokens a sequence
GQA = from_description(2, 8192, 64, 32000, 4096, kv_heads=8, ffn=28672, mlp="swiglu",
                       bias=False, norm="rmsnorm", tied=False, learned_pos=False,
                       dropout=False, flash_attention=True)
BF16 = Setup(global_batch=8)   # 2-byte activations


def _cand(recompute="none", b=1, **plan):
    return Candidate(Plan(**plan), b, recompute)


def test_ring_bytes_per_layer_are_the_k_v_blocks_round_the_ring_and_back():
    # B = b (s/N) kv e / t = 1 x 1024 x 1024 x 2 = 2 MiB; forward N-1 = 3 sends of a K/V
    # pair, backward 3 K/V sends and 4 dK/dV sends: 10 pairs of 2B
    b_block = 1024 * 1024 * 2
    assert cpm.block_bytes(GQA, _cand(cp=4), BF16) == b_block
    assert cpm.layer_bytes(GQA, _cand(cp=4), BF16) == 10 * 2 * b_block
    # full recomputation runs the forward's 3 sends again
    assert cpm.layer_bytes(GQA, _cand("full", cp=4), BF16) == 13 * 2 * b_block
    # tensor parallel splits the K/V heads: half the block on each of 2 tp ranks
    assert cpm.layer_bytes(GQA, _cand(cp=4, tp=2), BF16) == 10 * b_block
    # GQA sends only the KV heads: multi-head attention (64 K/V heads) sends 8x as much
    mha = from_description(2, 8192, 64, 32000, 4096, flash_attention=True)
    assert cpm.layer_bytes(mha, _cand(cp=4), BF16) == 8 * 10 * 2 * b_block


def test_all_to_all_bytes_per_layer_are_q_k_v_and_output_scattered_and_gathered():
    # the rank's 1024 tokens of q (8192), k and v (1024 each) and the output (8192), 2 bytes:
    # 1024 x 18432 x 2 = 37,748,736; each rank sends 3/4 of it forward and as much backward
    plan = dict(cp=4, cp_style="all-to-all")
    assert cpm.layer_bytes(GQA, _cand(**plan), BF16) == 2 * 37_748_736 * 3 / 4
    assert cpm.transient_bytes(GQA, _cand(**plan), BF16) == 1024 * (8192 + 2048) * 2


def test_ring_exchange_hides_behind_attention_but_its_last_hop():
    # each layer's sends of a K/V pair (2B = 4 MiB) over a 200 GB/s link, latency 5 us:
    # 3 forward, 3 backward steps of 2 sends each, and the last dK/dV hop
    send = 5e-6 + 2 * 1024 * 1024 * 2 / 200e9
    cand = _cand(cp=4)
    slow = make_cluster("H100-80GB", 1, 8, intra_bw="200GB/s", peak_flops="1PFLOPS")
    # a block's attention: 4 x 1024 x 1024 x 8192 FLOPs at 0.5 PFLOP/s = 68.7 us > send
    assert 4 * 1024 * 1024 * 8192 / 0.5e15 > 2 * send
    assert cpm.exposed_time(GQA, cand, BF16, slow) == pytest.approx(2 * send, rel=1e-12)
    # with no compute to hide behind, every send shows: 3 + 3 x 2 + 1 = 10 per layer
    instant = make_cluster("H100-80GB", 1, 8, intra_bw="200GB/s", peak_flops="1e30FLOPS")
    assert cpm.exposed_time(GQA, cand, BF16, instant) == pytest.approx(2 * 10 * send, rel=1e-12)


def test_a_cp_rank_holds_its_share_of_activations_and_all_its_parameters():
    # full recomputation: each of 2 layers keeps its input, e s b h / N, and the output
    # layer its two inputs (2 e s b h / N) and the fp32 logits (4 s b V / N); the lean loss
    # (full recomputation) keeps the logits' gradient in bf16 instead: 2 s b V / N
    s, h, v = 4096, 8192, 32000
    for cp in (1, 2, 4):
        tokens = s // cp
        acts = 2 * 2 * tokens * h + 2 * 2 * tokens * h + 2 * tokens * v
        mem = memory(GQA, _cand("full", cp=cp), BF16)
        assert mem.activations == acts
        assert mem.params == GQA.num_params * 2     # replicated over cp
    # ZeRO-3 shards the parameters over dp x cp = 2 x 4 ranks
    assert memory(GQA, _cand("full", dp=2, cp=4, zero=3), BF16).params == pytest.approx(
        GQA.num_params * 2 / 8)


def test_all_to_all_keeps_attentions_output_twice_unless_recomputed():
    """All-to-all attention saves its output over the whole sequence (h/N wide) and the
    output projection saves it again after the exchange back (s/N tokens, h wide): per
    layer b (s/N) h e / t more than the ring keeps; nothing more under full recomputation."""
    s, h, layers = 4096, 8192, 2
    for cp, tp in ((2, 1), (4, 2)):
        ring = memory(GQA, _cand(cp=cp, tp=tp), BF16).activations
        a2a = memory(GQA, _cand(cp=cp, tp=tp, cp_style="all-to-all"), BF16).activations
        assert a2a - ring == layers * (s // cp) * h * 2 / tp
        full = {style: memory(GQA, _cand("full", cp=cp, tp=tp, cp_style=style),
                              BF16).activations for style in ("ring", "all-to-all")}
        assert full["ring"] == full["all-to-all"]


def test_a_learned_position_table_stays_whole_on_a_cp_rank():
    gpt = from_description(2, 64, 4, 256, 128)   # learned positions: 128 x 64
    per_rank = memory(gpt, _cand(cp=2), Setup(global_batch=1, precision="fp32")).params
    assert per_rank == 4 * gpt.num_params
    assert gpt.embedding_params == 256 * 64 + 128 * 64


def test_attention_flops_span_the_whole_sequence():
    # a cp rank computes its s/N tokens, each attending all s keys: per token per layer
    # 2 x (matmul weights) + 4 s h FLOPs, and 2 h V for the logits; x3 forward and backward
    cluster = make_cluster("H100-80GB", 1, 8)
    s, h, v, cp = 4096, 8192, 32000, 4
    per_token = 2 * (3 * h * 28672 + 2 * h * h + 2 * h * 1024) + 4 * s * h
    flops = (s // cp) * 3 * (2 * per_token + 2 * h * v)
    t = step_time(GQA, _cand(cp=cp, dp=2), Setup(global_batch=2), cluster)
    assert t.compute == pytest.approx(flops / cluster.achievable_flops, rel=1e-12)


def test_a_cp_plan_with_whole_sequences_per_rank_is_the_data_parallel_one():
    # why the advisor skips cp plans whose micro-batch cp divides: dp x cp replicas of
    # b / cp sequences hold and compute the same, without the exchange
    cluster = make_cluster("H100-80GB", 1, 8)
    setup = Setup(global_batch=8)
    cp = evaluate(GQA, _cand(b=4, dp=2, cp=4, zero=1), setup, cluster)
    dp = evaluate(GQA, _cand(b=1, dp=8, zero=1), setup, cluster)
    assert cp.mem.activations == dp.mem.activations
    assert cp.mem.model_states == dp.mem.model_states
    assert cp.time.compute == pytest.approx(dp.time.compute, rel=1e-12)
    assert cp.time.total >= dp.time.total


def test_a_sequence_too_long_for_a_node_without_cp_is_planned_with_cp():
    # a 7B-shaped model with fused attention at 524,288 tokens on one node of 8 H100s:
    # one sequence's activations exceed a device even on tp 8 without recomputing every
    # layer; the fastest plans split the sequence, and the guide asks the question and
    # says so
    llama = from_description(32, 4096, 32, 32000, 524288, ffn=11008, mlp="swiglu",
                             bias=False, norm="rmsnorm", tied=False, learned_pos=False,
                             dropout=False, flash_attention=True)
    advice = advise(llama, Setup(global_batch=1), make_cluster("H100-80GB", 1, 8))
    top = advice.ranked[0]
    assert top.cand.plan.cp == 8 and top.time.cp_comm > 0
    no_cp = [ev for ev in advice.ranked if ev.cand.plan.cp == 1]
    assert all(ev.cand.recompute == "full" and ev.time.total > top.time.total for ev in no_cp)
    assert all(ev.cand.micro_batch % ev.cand.plan.cp for ev in advice.ranked
               if ev.cand.plan.cp > 1)
    v = verdict(advice)
    seq_q = v.questions[-1]
    assert seq_q.question == "Does one sequence's activation fit?" and not seq_q.answer
    assert v.family.startswith("context parallel") and v.agrees
    assert {"ring", "all-to-all"} <= {ev.cand.plan.cp_style for ev in advice.ranked}


def test_styles_follow_the_sequence_and_the_heads():
    assert cpm.styles(GQA, 4, 2) == ("ring", "all-to-all")     # 8 K/V heads over 4 x 2
    assert cpm.styles(GQA, 8, 2) == ("ring",)                  # 8 K/V heads, 16 ranks
    odd = from_description(2, 8192, 64, 32000, 4100, flash_attention=True)
    assert cpm.styles(odd, 4, 1) == ()                         # 8 chunks do not divide 4100


def test_bytes_per_step_count_the_ring_and_the_gradients_over_dp_x_cp():
    from meshtrain.planner.traffic import axis_bytes

    # 2 micro-batches x 2 layers x 10 K/V pairs of 2 MiB blocks; the gradients all-reduced
    # over the 4 cp ranks that hold the same parameters: 2 x 3/4 of them, 2 bytes each
    out = axis_bytes(GQA, _cand(cp=4, microbatches=2), BF16)
    assert out["cp"] == 2 * 2 * 10 * 2 * (1024 * 1024 * 2)
    assert out["dp"] == pytest.approx(2 * 3 / 4 * GQA.num_params * 2)
    assert "cp" not in axis_bytes(GQA, _cand(dp=4), BF16)


def test_ring_overlap_follows_what_the_device_lets_hide():
    # a cluster that overlaps nothing (overlap 0) shows every send, as instant compute does
    from dataclasses import replace

    send = 5e-6 + 2 * 1024 * 1024 * 2 / 200e9
    slow = make_cluster("H100-80GB", 1, 8, intra_bw="200GB/s", peak_flops="1PFLOPS")
    apart = replace(slow, overlap=0.0)
    assert cpm.exposed_time(GQA, _cand(cp=4), BF16, apart) == pytest.approx(2 * 10 * send,
                                                                           rel=1e-12)


def test_a_sliding_window_counts_fewer_keys_and_hides_less_of_the_ring():
    from dataclasses import replace

    # a window of 64 keys on every layer at 4096 tokens: of the causal (query, key) pairs,
    # 4096 x 4097 / 2 = 8,390,656, it keeps 64 x 65 / 2 + (4096 - 64) x 64 = 260,128; the
    # planner, which counts all 4096 keys for a full-attention query, counts 4096 x that share
    windowed = replace(GQA, window=64)
    keys = 4096 * 260_128 / 8_390_656
    assert windowed.keys_per_query(4096) == pytest.approx(keys, rel=1e-12)
    # on half the layers (Gemma-2's alternation) half the keys are saved
    half = replace(GQA, window=64, windowed_layers=1)
    assert half.keys_per_query(4096) == pytest.approx((4096 + keys) / 2, rel=1e-12)
    # a window covering the sequence is none
    assert replace(GQA, window=4096).keys_per_query(4096) == 4096
    # the ring's step computes a block of 1024 queries on keys / 4 of its keys: 4 x 1024 x
    # keys / 4 x 8192 FLOPs at 0.5 PFLOP/s, 2.1 us, under a send of a K/V pair (26 us): each
    # layer shows 3 forward sends less that, 3 backward steps of 2 sends less twice that, and
    # the last dK/dV hop; the bytes stay (the ring still sends every block round)
    send = 5e-6 + 2 * 1024 * 1024 * 2 / 200e9
    slow = make_cluster("H100-80GB", 1, 8, intra_bw="200GB/s", peak_flops="1PFLOPS")
    block = 4 * 1024 * (keys / 4) * 8192 / 0.5e15
    assert cpm.block_compute(windowed, _cand(cp=4), slow) == pytest.approx(block, rel=1e-12)
    assert cpm.exposed_time(windowed, _cand(cp=4), BF16, slow) == pytest.approx(
        2 * (3 * (send - block) + 3 * (2 * send - 2 * block) + send), rel=1e-12)
    assert cpm.layer_bytes(windowed, _cand(cp=4), BF16) == cpm.layer_bytes(GQA, _cand(cp=4),
                                                                           BF16)


def test_a_windowed_models_attention_flops_count_its_window():
    # per token per layer 2 x (matmul weights) + 4 k h, k the keys counted (as above)
    from dataclasses import replace

    from meshtrain.planner.flops import forward_flops_per_token

    keys = 4096 * 260_128 / 8_390_656
    layer, scores, _ = forward_flops_per_token(replace(GQA, window=64), 4096)
    assert scores == pytest.approx(4 * keys * 8192, rel=1e-12)
    assert layer == pytest.approx(2 * (3 * 8192 * 28672 + 2 * 8192 * 8192 + 2 * 8192 * 1024)
                                  + 4 * keys * 8192, rel=1e-12)


def test_a_transformers_configs_window_is_read_with_the_layers_that_slide():
    from types import SimpleNamespace

    from meshtrain.planner.model_spec import from_transformers_config

    shape = dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=256,
                 max_position_embeddings=8192, intermediate_size=512, hidden_act="silu",
                 rms_norm_eps=1e-6)
    read = lambda **kw: from_transformers_config(SimpleNamespace(**shape, **kw))
    mistral = read(sliding_window=4096)                            # every layer
    assert (mistral.window, mistral.windowed_layers) == (4096, 0)
    assert mistral.keys_per_query(8192) < 8192
    gemma = read(sliding_window=4096, layer_types=["sliding_attention", "full_attention"] * 2)
    assert (gemma.window, gemma.windowed_layers) == (4096, 2)
    full = read(sliding_window=None, layer_types=["full_attention"] * 4)   # Qwen2's default
    assert full.window == 0 and full.keys_per_query(8192) == 8192
