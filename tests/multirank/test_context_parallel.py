"""Issue 45: context parallel reproduces one process (SGD with momentum, 1e-5 on losses,
parameters and optimizer states), for each style at cp = 2 and cp = 4, alone and with dp,
ZeRO, recompute, clipping, tp with sequence parallel and pp (covered pairwise, not as a product:
the suite's budget; bf16 within the suite's bf16 bound), for meshtrain's GPT and a transformers Llama with grouped-query
attention (4 heads, 2 K/V heads); the ring's and the all-to-all's bytes per step equal their
formulas, and a rank keeps one process's activations / cp. A mixture of experts (Mixtral,
its router's load-balancing loss on) at cp = 2 and dp x cp = 2 x 2: its routing counts
summed over dp x cp in training (over cp in evaluation), its losses, loss parts and
evaluation those of one process. Sliding windows and soft-capped scores: a Mistral whose
window (6) is narrower than the sequence and Gemma-2 (sliding and global layers, capped
scores) under each style at cp = 2, with dp and tp; the kernels against one process's
attention with a window under a chunk and a window with a cap.

Each world starts once and runs all its cases; each one-process reference is computed once.
The GPT is `gpt_tp` (4 heads, so all-to-all divides them by 4; 16 tokens, cut into 8 chunks
at cp = 4).
"""
import itertools

import pytest
import torch

import meshtrain as mt
from meshtrain.testing import run_ranks
from tests.multirank import equivalence as eq
from tests.multirank.test_zero import check_within_bf16_round_off

GPT, LLAMA, PIPE = "gpt_tp", "llama-tiny", "gpt_pipe"   # gpt_pipe: 8 layers for stages
MOE = "mixtral-tiny"   # 4 experts, top-2, output_router_logits with coefficient 0.02
WINDOWED = "mistral-window-tiny"   # windows of 6 keys in 16 tokens (chunks of 4 at cp = 2)
GEMMA = "gemma2-tiny"   # sliding layers (8 keys) and global ones, scores capped at 5
HF = (LLAMA, MOE, WINDOWED, GEMMA)
STEPS, CLIP = 3, 0.25
RING, A2A = dict(cp_style="ring"), dict(cp_style="all-to-all")

# (plan fields, model, max_grad_norm) per world size
WORLD_2 = [(dict(cp=2, **RING), GPT, None), (dict(cp=2, **A2A), GPT, None),
           (dict(cp=2, **RING), LLAMA, None), (dict(cp=2, **A2A), LLAMA, None),
           (dict(cp=2, **RING), MOE, None),
           (dict(cp=2, **RING), WINDOWED, None),   # all-to-all's with dp (world 4)
           (dict(cp=2, **RING), GEMMA, None), (dict(cp=2, **A2A), GEMMA, None)]
WORLD_4 = [(dict(cp=4, **RING), GPT, None),
           (dict(cp=4, recompute="full", **A2A), GPT, None),
           (dict(dp=2, cp=2, **RING), GPT, CLIP),
           (dict(dp=2, cp=2, zero=3, **A2A), GPT, None),
           (dict(dp=2, cp=2, zero=3, recompute="full", **RING), GPT, None),
           (dict(dp=2, cp=2, zero=1, microbatches=2, **A2A), GPT, CLIP),
           (dict(cp=2, tp=2, sequence_parallel=True, **A2A), GPT, None),
           (dict(cp=2, tp=2, sequence_parallel=True, **RING), LLAMA, None),
           (dict(cp=2, pp=2, microbatches=4, schedule="zb-h1", **RING), PIPE, None),
           (dict(cp=2, pp=2, microbatches=2, **A2A), LLAMA, None),
           (dict(cp=4, **RING), LLAMA, None),   # its 2 K/V heads: no all-to-all over 4
           (dict(dp=2, cp=2, zero=3, recompute="full", **A2A), LLAMA, None),
           (dict(dp=2, cp=2, **A2A), MOE, None),
           (dict(cp=2, pp=2, schedule="1f1b", **RING), MOE, None),   # routing through stages
           (dict(dp=2, cp=2, **A2A), WINDOWED, None),
           (dict(cp=2, tp=2, **RING), GEMMA, None)]   # 1 K/V head a tp rank: no all-to-all


@pytest.fixture(scope="module")
def references():
    """One per (model, clip) the cases use, each computed once."""
    out = {(GPT, None): eq.reference(GPT, steps=STEPS),
           (GPT, CLIP): eq.reference(GPT, steps=STEPS, max_grad_norm=CLIP),
           (PIPE, None): eq.reference(PIPE, steps=STEPS),
           "bf16": eq.reference_bf16(GPT, steps=STEPS)}
    if any(model in HF for _, model, _ in WORLD_2 + WORLD_4):
        hf = pytest.importorskip("tests.multirank.hf_cases")
        for model in (LLAMA, WINDOWED, GEMMA):
            out[(model, None)] = hf.reference(model, steps=STEPS)
        out[(MOE, None)] = hf.reference(MOE, steps=STEPS)
        out["moe"] = mixture_one_process()
    return out


def run_cases(cases: list, counted: list, bf16: list) -> tuple[list, list, list]:
    """On each rank: every case's training, what one step of each plan in `counted` sends
    and keeps, and the GPT trained under each plan of `bf16`."""
    if any(model in HF for _, model, _ in cases):
        import tests.multirank.hf_cases  # noqa: F401  (registers the transformers models)
    trained = eq.train_many(cases, STEPS)
    return (trained, [one_step(plan) for plan in counted],
            [eq.train(mt.Plan(**plan), GPT, steps=STEPS) for plan in bf16],
            attention_against_one_process() if bf16 else None,
            [mixture_evaluated(plan) for plan, model, _ in cases if model == MOE])


def mixture_evaluated(plan: dict) -> dict:
    """The Mixtral's evaluation of two whole global batches, then the parts of its first
    step's loss (cross-entropy, router load-balancing), under `plan`."""
    from meshtrain.models.hf_presets import build

    torch.manual_seed(0)
    trainer = mt.Trainer(build(MOE), mt.Plan(**plan), optimizer=eq.sgd)
    evaluated = trainer.evaluate(eq.batches(MOE, 2))
    trainer.step(*next(iter(eq.batches(MOE, 1, trainer.dp_rank, trainer.dp_size))))
    return {"evaluated": evaluated, **trainer.last_loss_parts}


def mixture_one_process() -> dict:
    """What transformers computes in one process: the mean loss (cross-entropy + coefficient
    x the load-balancing loss of each batch) over the same two batches, and the first
    global batch's parts."""
    from meshtrain.models.hf_presets import build
    from tests.multirank import hf_cases as hf
    from tests.multirank.test_hf_moe import first_step_parts

    torch.manual_seed(0)
    net = build(MOE)
    with torch.no_grad():
        losses = [hf.transformers_loss(net)(net(x, use_cache=False), y).item()
                  for x, y in eq.batches(MOE, 2)]
    return {"evaluated": sum(losses) / len(losses), **first_step_parts(MOE)}


# (sliding window, softcap) of the kernels' checks: causal; a window of 5 keys, under a
# chunk's 8 (pairs skipped, rows and columns cut); a window of 11 with Gemma-2's cap
SCORINGS = [(None, None), (5, None), (11, 5.0)]


def attention_against_one_process(rows: int = 3) -> float:
    """Ring attention with score blocks of `rows` query rows (fewer than a chunk's 8, and not
    dividing it), and the all-to-all, GQA (4 heads, 2 K/V heads), for each of SCORINGS: the
    largest difference from one process's attention over the whole sequence (SDPA, or the
    scores written out where there is a window or a cap), in the output and dq, dk, dv."""
    from functools import partial

    from meshtrain.core.comm import Comm
    from meshtrain.core.mesh import Mesh
    from meshtrain.strategies.context_parallel.all_to_all import all_to_all_attention
    from meshtrain.strategies.context_parallel.layout import ChunkLayout
    from meshtrain.strategies.context_parallel.ring import ring_attention

    comm = Comm(Mesh.build(mt.Plan(cp=2)))
    layout = ChunkLayout(comm.mesh.axis_rank("cp"), 2)
    worst = 0.0
    for (window, cap), style in itertools.product(SCORINGS, ("ring", "all-to-all")):
        torch.manual_seed(0)
        whole = [torch.randn(2, h, 32, 8, requires_grad=True) for h in (4, 2, 2)]   # q, k, v
        want = one_process_attention(*whole, window, cap)
        grad = torch.randn_like(want)
        want.backward(grad)
        mine = [layout.split(t.detach(), dim=2).requires_grad_() for t in whole]
        attend = (partial(ring_attention, rows=rows) if style == "ring"
                  else all_to_all_attention)
        got = attend(*mine, comm, layout, 8 ** -0.5, window=window, softcap=cap)
        got.backward(layout.split(grad, dim=2))
        pairs = [(got, want)] + [(m.grad, t.grad) for m, t in zip(mine, whole)]
        worst = max([worst] + [(a - layout.split(b, dim=2)).abs().max().item()
                               for a, b in pairs])
    return worst


def one_process_attention(q, k, v, window: int | None, cap: float | None):
    """softmax(cap tanh(q k^T s / cap), masked to the window) v over the whole sequence, as
    transformers' eager attention computes it (Gemma-2's, Mistral's)."""
    import torch.nn.functional as F

    if window is None and cap is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
    scores = q @ k.transpose(-2, -1) * q.size(-1) ** -0.5
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    T = q.size(2)
    distance = (torch.arange(T, device=q.device)[:, None]
                - torch.arange(T, device=q.device)[None, :])
    seen = (distance >= 0) & (distance < (window or T))
    return scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v


def one_step(plan: dict) -> dict:
    """Bytes this rank sent along cp per tag in its second step (the first is the same), the
    activations it kept (ActivationMeter: the storages autograd saved), and then the mean
    loss of an evaluation (each cp rank's share, averaged over dp x cp)."""
    torch.manual_seed(0)
    trainer = mt.Trainer(eq.gpt_tp(), mt.Plan(measure_activations=True, **plan),
                         optimizer=eq.sgd)
    first, second = eq.batches(GPT, 2, trainer.dp_rank, trainer.dp_size)
    trainer.step(*first)
    trainer.comm.stats.reset()
    trainer.step(*second)
    sent = {tag: trainer.comm.stats.total(axis="cp", tag=tag).sent
            for tag in ("ring-kv", "ring-dkv", "cp-a2a")}
    evaluated = trainer.evaluate(eq.batches(GPT, 2))   # two whole global batches
    return dict(sent, activations=trainer.activations.last_bytes, evaluated=evaluated)


# bf16: K/V travel in bf16, attention's blocks and sums in fp32 (ring.py)
BF16 = [dict(cp=2, precision="bf16", **RING), dict(cp=2, precision="bf16", **A2A)]
COUNTED = [dict(cp=4, **RING), dict(dp=2, cp=2, recompute="full", **RING),
           dict(cp=4, **A2A)]


def expected_bytes(plan: dict) -> dict:
    """The formulas (strategies/context_parallel/ring.py, all_to_all.py), per step on every
    rank: a K or V block is (B, heads, 2c, head_dim) fp32 with B this dp rank's rows.
    Ring: forward 2 (cp-1) blocks per layer, again when recomputed; backward 2 (cp-1) for
    K/V and 2 cp for dK/dV. All-to-all: (cp-1)/cp of q, k, v and the output per layer,
    forward and backward."""
    cfg, cp, dp = eq.TP_CONFIG, plan["cp"], plan.get("dp", 1)
    block = (eq.GLOBAL_BATCH // dp) * cfg.n_head * (cfg.seq_len // cp) * cfg.head_dim * 4
    forwards = 2 if plan.get("recompute") == "full" else 1
    if plan["cp_style"] == "ring":
        return {"ring-kv": cfg.n_layer * (forwards + 1) * 2 * (cp - 1) * block,
                "ring-dkv": cfg.n_layer * 2 * cp * block, "cp-a2a": 0}
    return {"ring-kv": 0, "ring-dkv": 0,
            "cp-a2a": cfg.n_layer * 2 * 4 * block * (cp - 1) // cp}


def expected_activations(plan: dict, one_process: int) -> int | None:
    """Activations per rank: one process's / cp (every saved tensor is per token, and
    attention keeps O(tokens), never a T x T block), but for one fp32 scalar that does not
    split (4 bytes). All-to-all also keeps, per layer, its output before the exchange back
    (B, H, 2c, D) and the two int64 orders of the gathered sequence (T each). None where dp or
    recomputation change what is kept."""
    if plan.get("dp", 1) > 1 or plan.get("recompute", "none") != "none":
        return None
    cfg, cp = eq.TP_CONFIG, plan["cp"]
    ring = (one_process - 4) // cp + 4
    if plan["cp_style"] == "ring":
        return ring
    local = eq.GLOBAL_BATCH * cfg.n_head * (cfg.seq_len // cp) * cfg.head_dim * 4
    return ring + cfg.n_layer * (local + 2 * cfg.seq_len * 8)


@pytest.mark.parametrize("world, cases", [(2, WORLD_2), (4, WORLD_4)], ids=["world2", "world4"])
def test_context_parallel_matches_one_process(references, world, cases):
    counted, bf16 = (COUNTED, []) if world == 4 else ([], BF16)
    alone = one_step(dict(cp=1)) if counted else {}
    per_rank = run_ranks(world, run_cases, cases, counted, bf16, timeout=170)
    for rank, (trained, measured, mixed, tiled, mixture) in enumerate(per_rank):
        for got in mixture:   # routing counts over dp x cp (training) and cp (evaluation)
            assert got == pytest.approx(references["moe"], abs=1e-5, rel=0), f"rank {rank}"
        assert tiled is None or tiled < 1e-5, f"rank {rank}: off one process by {tiled}"
        for plan, result in zip(bf16, mixed):   # the suite's bf16 bound (test_zero.py)
            check_within_bf16_round_off(result, references["bf16"])
        for (plan, model, clip), result in zip(cases, trained):
            what = f"rank {rank} {model} {mt.Plan(**plan).describe()}"
            eq.assert_equivalent(result, references[(model, clip)], what=what)
            assert len(result["norms"]) == (STEPS if clip else 0), what
        for plan, got in zip(counted, measured):
            sent = {k: v for k, v in got.items() if k not in ("activations", "evaluated")}
            assert sent == expected_bytes(plan), f"rank {rank} {plan}"
            kept = expected_activations(plan, alone["activations"])
            assert kept is None or got["activations"] == kept, f"rank {rank} {plan}"
            assert got["evaluated"] == pytest.approx(alone["evaluated"], abs=1e-5, rel=0)


def test_the_split_gives_each_rank_chunks_i_and_2cp_minus_1_minus_i():
    from meshtrain.strategies.context_parallel.layout import ChunkLayout

    sequence = torch.arange(16).view(1, 16)
    held = [ChunkLayout(r, 4).split(sequence)[0].tolist() for r in range(4)]
    assert held == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    for r in range(4):   # the positions are the tokens' places in the whole sequence
        assert ChunkLayout(r, 4).positions(4).tolist() == held[r]
    # causal work per rank: a query at place p attends to p + 1 keys; balanced exactly
    assert len({sum(p + 1 for p in h) for h in held}) == 1


def test_bad_input_is_refused_by_name_before_any_process_group():
    import torch.distributed as dist

    from meshtrain.core.plan import PlanError
    from meshtrain.strategies.context_parallel.layout import ChunkLayout

    assert not dist.is_initialized()
    with pytest.raises(PlanError, match="scatters the attention heads over cp=4, but the "
                                        "model has 2 heads"):
        mt.Trainer(eq.gpt(), mt.Plan(cp=4, **A2A), optimizer=eq.sgd)
    with pytest.raises(PlanError, match="Sequential exposes none meshtrain can replace"):
        mt.Trainer(eq.tied_sequential(), mt.Plan(cp=2), optimizer=eq.sgd,
                   loss_fn=eq.token_loss)
    with pytest.raises(PlanError, match="cp with compile is not built yet"):
        mt.Trainer(eq.gpt(), mt.Plan(cp=2, compile=True), optimizer=eq.sgd)
    assert not dist.is_initialized()
    with pytest.raises(PlanError, match="MistralForCausalLM's attention_dropout=0.1: "
                                        "attention dropout is not built under cp .* set "
                                        "attention_dropout=0.0, or cp=1"):
        mt.Trainer(dropping_mistral(), mt.Plan(cp=2, **A2A), optimizer=eq.sgd)
    with pytest.raises(PlanError, match="use_bidirectional_attention=True: its attention is "
                                        "causal only"):
        mt.Trainer(bidirectional_gemma3(), mt.Plan(cp=2), optimizer=eq.sgd)
    assert not dist.is_initialized()
    with pytest.raises(PlanError, match="2\\*cp = 4 equal chunks, but the sequence has 10"):
        ChunkLayout(0, 2).split(torch.zeros(1, 10))


def dropping_mistral():
    """The windowed Mistral with attention dropout, which context parallel does not build."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from meshtrain.models.hf_presets import config_of

    config = config_of(WINDOWED)
    config.attention_dropout = 0.1
    return AutoModelForCausalLM.from_config(config)


def bidirectional_gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from meshtrain.models.hf_presets import SIZES

    return Gemma3ForCausalLM(Gemma3TextConfig(**SIZES, head_dim=16, sliding_window=6,
                                              use_bidirectional_attention=True))


def test_a_call_asking_for_attention_sinks_raises_rather_than_dropping_them():
    """The registered function's guard (what no config says before the ranks start): a
    family passing s_aux (gpt-oss's sinks) gets an error, not attention without them."""
    pytest.importorskip("transformers")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from meshtrain.models.hf_presets import build
    from meshtrain.strategies.context_parallel.layout import ChunkLayout
    from meshtrain.strategies.context_parallel.models import replace_attention

    model = build(WINDOWED)
    replace_attention(model, None, ChunkLayout(0, 2), "ring")   # no exchange before the guard
    attention = ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation]
    q = torch.zeros(1, 4, 8, 16)
    with pytest.raises(ValueError, match="asks for attention sinks \\(s_aux\\), not built "
                                         "under cp: use cp=1"):
        attention(model.model.layers[0].self_attn, q, q[:, :2], q[:, :2], None,
                  s_aux=torch.zeros(4))
