"""Context parallel priced: a rank's share of a sequence split over cp ranks, attention's
bytes across the axis (ring or all-to-all), what of the ring hides behind attention, and
the blocks a rank holds while they travel.

Plan(cp=N) splits every sequence into 2N chunks, rank i holding chunks i and 2N-1-i so that
causal attention's work is balanced. Every token-local layer runs on the rank's s/N tokens
unchanged; only attention crosses the axis. Parameters are replicated over cp, their
gradients reduced over dp x cp and ZeRO shards over dp x cp (Megatron folds cp into data
parallel). So a cp rank is priced as a data-parallel rank of dp x cp whose sequences hold
s/N tokens, each attending the whole sequence (`rank_view`), plus attention's exchange.

Per layer and micro-batch of b sequences, in element bytes e, with kv = the key/value width
(GQA sends only the KV heads) and B = b (s/N) kv e / t one K (or V) block of a rank:

ring (Liu et al. 2023; torch's experimental context_parallel):
  forward   N-1 steps, each sending the K and V blocks it holds on round the ring: (N-1) 2B
  backward  the K and V blocks go round again (not kept from forward: that would hold the
            whole sequence's K and V), and dK, dV travel behind them, each rank adding its
            part, until they are home: N sends of them: (N-1) 2B + N 2B
  A step's send hides behind that step's attention on one block: 4 b (s/N)^2 h / t FLOPs
  forward (the planner's 4 s h per token of attention, Megatron 2021 §5.1, over 1/N of the
  keys), twice that backward: per step, exposed = comm - min(comm, compute); the last dK/dV
  hop has nothing left to hide behind. A sliding window leaves fewer keys a query
  (ModelSpec.keys_per_query) and so less to hide behind; the ring still sends every block
  the whole way round (strategies/context_parallel/ring.py), so the bytes stay.
all-to-all (DeepSpeed Ulysses, Jacobs et al. 2023): q (h wide), k and v (kv) scattered over
  heads and gathered over the sequence, the output (h) back: 4 all-to-alls, each rank
  sending (N-1)/N of b (s/N) (2h + 2kv) e / t bytes forward, the same 4 backward; attention
  waits for them, so none hides.
Full recomputation runs each layer's forward, and its exchange, twice.

Memory beside the saved activations (which the view divides by N; an unfused attention's
scores, a s b (s/N) per layer, as its queries attend all s keys): the ring's backward holds
the current and the next K/V block and the dK/dV pair arriving and leaving, 8B; the
all-to-all's send buffers beside its gathered q, k and v, b (s/N)(h + 2kv) e / t; and among
the saved activations, all-to-all keeps attention's output twice: as attention saves it
(the whole sequence, h/N wide) and as the output projection's input after the exchange back,
b (s/N) h e / t more per layer (`ModelSpec.output_twice`; recomputed under full or selective).
"""
from __future__ import annotations

import math
from dataclasses import replace

from meshtrain.planner.hardware import Cluster
from meshtrain.planner.model_spec import ModelSpec
from meshtrain.planner.setup import Candidate, Setup
from meshtrain.planner.stage_split import most_blocks


def rank_view(spec: ModelSpec, cand: Candidate) -> tuple[ModelSpec, Candidate]:
    """What one cp rank computes and holds, as the planner's other terms price it: a model
    whose sequences are its s/N tokens (attending all s, its position table whole) under a
    plan whose data-parallel axis is dp x cp. cp = 1: unchanged."""
    p = cand.plan
    if p.cp == 1:
        return spec, cand
    view = replace(spec, seq=math.ceil(spec.seq / p.cp), attention_span=spec.span,
                   positions=spec.position_rows, output_twice=p.cp_style == "all-to-all")
    return view, replace(cand, plan=replace(p, dp=p.dp * p.cp, cp=1, cp_style="ring"))


def block_bytes(spec: ModelSpec, cand: Candidate, setup: Setup) -> float:
    """B: one rank's K (or V) block of one layer and micro-batch, b (s/N) kv e / t."""
    p = cand.plan
    return cand.micro_batch * spec.seq / p.cp * spec.kv_dim * setup.act_bytes / p.tp


def forward_passes(cand: Candidate) -> float:
    """Forwards a layer runs a micro-batch: 2 under full recomputation (every k-th layer)."""
    full = cand.recompute == "full"
    return 1 + (1 / cand.plan.recompute_every if full else 0)


def ring_sends(cand: Candidate) -> tuple[int, int]:
    """(forward, backward) sends of a K/V pair (2B each) per layer and micro-batch."""
    n = cand.plan.cp
    return n - 1, (n - 1) + n


def layer_bytes(spec: ModelSpec, cand: Candidate, setup: Setup) -> float:
    """Bytes one rank sends across cp per layer and micro-batch (the module's formulas)."""
    p = cand.plan
    if p.cp == 1:
        return 0.0
    if p.cp_style == "ring":
        fwd, bwd = ring_sends(cand)
        return (forward_passes(cand) * fwd + bwd) * 2 * block_bytes(spec, cand, setup)
    return (forward_passes(cand) + 1) * 4 * alltoall_bytes(spec, cand, setup) * (p.cp - 1) / p.cp


def step_bytes(spec: ModelSpec, cand: Candidate, setup: Setup) -> dict[str, float]:
    """{"cp": bytes a rank sends across cp per step} (its stage's layers, every
    micro-batch), as traffic.axis_bytes reports each axis; empty without cp."""
    p = cand.plan
    if p.cp == 1:
        return {}
    return {"cp": p.microbatches * most_blocks(spec, p) * layer_bytes(spec, cand, setup)}


def alltoall_bytes(spec: ModelSpec, cand: Candidate, setup: Setup) -> float:
    """One all-to-all's buffer on a rank, the average of q, k, v and the output:
    b (s/N) (2h + 2kv) e / (4t)."""
    p = cand.plan
    tokens = cand.micro_batch * spec.seq / p.cp
    return tokens * (2 * spec.hidden + 2 * spec.kv_dim) * setup.act_bytes / (4 * p.tp)


def block_compute(spec: ModelSpec, cand: Candidate, cluster: Cluster) -> float:
    """Seconds of one ring step's forward attention: the rank's queries on one K/V block,
    4 b (s/N) (k/N) h / t FLOPs, k = s keys a query (fewer under a sliding window,
    `ModelSpec.keys_per_query`: the chunk pairs it skips leave less to hide the sends
    behind, spread evenly over the steps)."""
    p = cand.plan
    tokens = cand.micro_batch * spec.seq / p.cp
    keys = spec.keys_per_query(spec.seq) / p.cp
    return 4 * tokens * keys * spec.hidden / p.tp / cluster.achievable_flops


def exposed_time(spec: ModelSpec, cand: Candidate, setup: Setup, cluster: Cluster,
                 blocks: int | None = None) -> float:
    """Seconds per micro-batch that attention's exchange across cp adds to a rank's stage
    of `blocks` blocks (None: the most a stage holds): what the ring's blocks do not hide;
    all of the all-to-all's."""
    p = cand.plan
    if p.cp == 1:
        return 0.0
    layers = most_blocks(spec, p) if blocks is None else blocks
    span = p.cp * p.tp   # cp next to tp in the mesh: its ring inside a node where it fits
    if p.cp_style == "all-to-all":
        one = cluster.collective_time("all_to_all", alltoall_bytes(spec, cand, setup), p.cp,
                                      span)
        return layers * (forward_passes(cand) + 1) * 4 * one
    send = cluster.collective_time("p2p", 2 * block_bytes(spec, cand, setup), 2, span)
    compute = block_compute(spec, cand, cluster)
    # what hides of a step's comm: as much as its compute lasts, scaled by what the
    # device lets overlap (1 on GPUs; low on CPU ranks, whose cores gloo's threads share)
    shown = lambda comm, work: comm - min(comm, work) * cluster.overlap
    fwd, bwd = ring_sends(cand)
    forward = fwd * shown(send, compute)
    # backward: each step's K/V and dK/dV sends (2 pairs) behind twice the forward's work
    backward = (p.cp - 1) * shown(2 * send, 2 * compute) + send
    return layers * (forward_passes(cand) * forward + backward)


def transient_bytes(spec: ModelSpec, cand: Candidate, setup: Setup) -> float:
    """Bytes attention's exchange holds beside the saved activations, one layer at a time."""
    p = cand.plan
    if p.cp == 1:
        return 0.0
    if p.cp_style == "ring":
        return 8 * block_bytes(spec, cand, setup)
    return cand.micro_batch * spec.seq / p.cp * (spec.hidden + 2 * spec.kv_dim) \
        * setup.act_bytes / p.tp


def styles(spec: ModelSpec, cp: int, tp: int) -> tuple[str, ...]:
    """The cp styles a layout allows: the ring where 2 cp divides the sequence, the
    all-to-all also where cp x tp divides the heads and the key/value heads."""
    if cp == 1:
        return ("ring",)
    if spec.seq % (2 * cp):
        return ()
    kv = spec.kv_heads or spec.heads
    a2a = spec.heads % (cp * tp) == 0 and kv % (cp * tp) == 0
    return ("ring", "all-to-all") if a2a else ("ring",)
