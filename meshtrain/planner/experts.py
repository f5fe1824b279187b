"""Expert parallel priced: a mixture of experts' states split over ep ranks, the tokens'
all-to-alls to their experts and back, and the busiest rank's share of routed work.

Plan(ep=N) splits every MoE layer's E routed experts over N ranks taken from the data-
parallel ones (ep divides dp, world unchanged; Megatron's and torchtitan's layout). The
dense weights (attention, norms, embeddings, the router, shared experts) stay data-parallel
over dp (x cp); each expert is data-parallel over its expert-data-parallel group of
edp = dp (x cp) / N ranks, and ZeRO shards it there:
  expert states per rank = (2 + 2 + K) Psi_E / N, divided by edp as ZeRO shards them
  (Rajbhandari et al. 2020 Table 1, with Psi_E the stage's expert weights).
A token goes to its top-k experts (Fedus et al. 2021; Mixtral: k = 2 of 8), so each layer
dispatches b s k tokens of h elements to the experts' ranks and combines them back: per
layer and micro-batch, 2 all-to-alls of b s k h e bytes forward (dispatch, combine) and 2
backward (their gradients), one more pair under full recomputation; each rank sends
(N-1)/N of each buffer (tokens routed evenly).
Routing is rarely even: `Setup.expert_imbalance` (the busiest rank's routed tokens against
the mean; 1.0: even, the default) scales what the busiest rank receives and its routed
experts' work (top-k of E experts per token: the MLP's FLOPs with ModelSpec.ffn_hidden =
k x expert width + shared width).
A capacity factor C (Plan.capacity_factor: no expert takes more than C x its even share of
a sequence's choices) caps both: at most min(1, C) of the b s k copies are sent, and the
busiest rank receives at most C x the even share. The advisor prices dropless plans.
What a mixture's layer saves for backward (`saved_bytes_per_token`) follows its routed rows:
each copy of a token its experts compute keeps its own input, hidden and output; so does the
router, per token. Left out: the busiest rank's extra saved activations under imbalance, the
router's own logits, and the compute a capacity saves (every choice's expert work is priced).
"""
from __future__ import annotations

from dataclasses import replace

from meshtrain.planner.hardware import Cluster
from meshtrain.planner.model_spec import ModelSpec
from meshtrain.planner.setup import Candidate, Setup
from meshtrain.planner.stage_split import most_blocks, stage_blocks
from meshtrain.planner.states import ModelStates, model_states


def stage_expert_params(spec: ModelSpec, cand: Candidate, stage: int | None = None) -> float:
    """Routed experts' weights on one rank of pipeline rank `stage` (None: the one with the
    most blocks) before ep splits them: its blocks' experts, whole on every tp rank (tensor
    parallel keeps a mixture's experts whole: ModelSpec.layer_replicated_params)."""
    p = cand.plan
    blocks = most_blocks(spec, p) if stage is None else stage_blocks(spec, p)[stage]
    return blocks * spec.layer_expert_params


def expert_share(spec: ModelSpec, cand: Candidate, psi: float, stage: int | None = None
                 ) -> tuple[float, float, Candidate | None]:
    """(dense parameters, expert parameters this rank holds, the plan its experts are
    data-parallel under: dp / ep replicas) for pipeline rank `stage` (None: the busiest)
    of `psi` parameters; without expert parallel everything is dense: (psi, 0, None)."""
    p = cand.plan
    if not spec.experts or p.ep == 1:
        return psi, 0.0, None
    experts = stage_expert_params(spec, cand, stage)
    edp = replace(cand, plan=replace(p, dp=p.dp // p.ep, ep=1))
    return psi - experts, experts / p.ep, edp


def rank_states(spec: ModelSpec, cand: Candidate, setup: Setup, psi: float,
                host_is_device: bool = False, stage: int | None = None) -> ModelStates:
    """Model states on a rank of pipeline rank `stage` (None: the busiest): the dense part
    over dp, the experts' share over edp."""
    p = cand.plan
    dense, experts, edp = expert_share(spec, cand, psi, stage)
    states = model_states(dense, setup, p.zero, p.dp, p.offload, host_is_device)
    if edp is None:
        return states
    more = model_states(experts, setup, p.zero, edp.plan.dp, p.offload, host_is_device)
    return ModelStates(states.params + more.params, states.grads + more.grads,
                       states.optim + more.optim, states.host + more.host)


def dispatch_bytes(spec: ModelSpec, cand: Candidate, setup: Setup) -> float:
    """One all-to-all's buffer on a rank: its b s tokens, k copies each, h wide; under a
    capacity factor C < 1, at most C of the copies."""
    c = cand.plan.capacity_factor
    kept = 1.0 if c is None else min(1.0, c)
    return kept * cand.micro_batch * spec.seq * spec.top_k * spec.hidden * setup.act_bytes


def routed_rows(spec: ModelSpec, cand: Candidate) -> float:
    """Rows a token's experts compute: its k choices; under expert parallel with a capacity
    factor C < 1, at most C of them (dropped choices are not sent; in one process they are
    still computed, times 0: models/experts.py)."""
    c = cand.plan.capacity_factor
    kept = 1.0 if c is None or cand.plan.ep == 1 else min(1.0, c)
    return kept * spec.top_k


def saved_bytes_per_token(spec: ModelSpec, rows: float, elem_bytes: int) -> float:
    """What a mixture's layer saves for backward per token beyond its MLP's input, `rows`
    routed rows each (`routed_rows`), e = elem_bytes (models/gpt_moe.py and expert
    parallel's dispatch save the same; measured on gpt-moe-tiny, tests/unit/test_planner_experts.py):
      router, per token: softmax's fp32 probabilities (E), the top-k's fp32 weights and
        int64 indices (k each), their renormalising fp32 sum (1): 4 E + 12 k + 4 bytes
      per routed row: the gathered copy of its token (h), its expert's SwiGLU hidden (gate
        and up 2 I, silu's output I, their product I; a GELU expert's 2 I), its expert's
        output (h) and that output weighted (h, what index_add_ keeps): (3 h + 4 I) e; its
        fp32 weight and its token's and choice's int64 indices: 20 bytes
    Its shared experts are counted as a dense MLP of their width."""
    router = 4 * spec.experts + 12 * spec.top_k + 4
    hidden = (4 if spec.mlp == "swiglu" else 2) * spec.expert_width
    row = (3 * spec.hidden + hidden) * elem_bytes + 4 + 2 * 8
    return router + rows * row


def heap_bytes_per_token(spec: ModelSpec, elem_bytes: int) -> float:
    """What the runtime's heap keeps of a mixture's routed part per token, in place of what
    it saves (`saved_bytes_per_token`): a dense MLP's hidden of one expert's width (SwiGLU's
    4 I, a GELU's 2 I), e = elem_bytes. The allocator's free lists keep the largest
    temporaries a forward frees, and a mixture's are its experts' hidden tensors, each
    about b s k / E rows: not the router's or every routed row's copies. Measured, a
    one-process gpt-moe-tiny's heap (resident peak less allocated peak) stays 14-21 MB at
    batch 4 and 8, where its saved bytes priced 19-34 MB; this prices 11-20 MB
    (docs/history.md)."""
    return elem_bytes * (4 if spec.mlp == "swiglu" else 2) * spec.expert_width


def selective_bytes_per_token(spec: ModelSpec, rows: float, elem_bytes: int) -> float:
    """What a mixture's routed part keeps per token under per-op selective recomputation
    (strategies/recompute.py keeps matmuls' outputs only; measured on gpt-moe-tiny,
    tests/unit/test_selective_recompute.py): the router's logits (E), and per routed row its
    expert's first matmuls' output (SwiGLU's gate and up, 2 I; a GELU expert's I) and its
    down projection's (h), e = elem_bytes each. The softmax, top-k, gathers, the expert's
    activation and the weighted sum into the token are recomputed."""
    first = (2 if spec.mlp == "swiglu" else 1) * spec.expert_width
    return elem_bytes * (spec.experts + rows * (first + spec.hidden))


def imbalance(cand: Candidate, setup: Setup) -> float:
    """The busiest rank's received rows over the buffer's mean: the stated imbalance, which
    a capacity factor C caps at C x the dropless even share."""
    c = cand.plan.capacity_factor
    if c is None:
        return setup.expert_imbalance
    return min(setup.expert_imbalance, c) / min(1.0, c)


def alltoalls(cand: Candidate) -> float:
    """All-to-alls per layer and micro-batch: dispatch and combine, forward and backward,
    and the forward's pair again under full recomputation."""
    full = cand.recompute == "full"
    return 4 + (2 / cand.plan.recompute_every if full else 0)


def layer_bytes(spec: ModelSpec, cand: Candidate, setup: Setup) -> float:
    """Bytes one rank sends across ep per layer and micro-batch, tokens routed evenly."""
    n = cand.plan.ep
    if not spec.experts or n == 1:
        return 0.0
    return alltoalls(cand) * dispatch_bytes(spec, cand, setup) * (n - 1) / n


def step_bytes(spec: ModelSpec, cand: Candidate, setup: Setup) -> dict[str, float]:
    """{"ep": bytes a rank sends across ep per step, routed evenly}; empty without ep."""
    p = cand.plan
    if not spec.experts or p.ep == 1:
        return {}
    return {"ep": p.microbatches * most_blocks(spec, p) * layer_bytes(spec, cand, setup)}


def exposed_time(spec: ModelSpec, cand: Candidate, setup: Setup, cluster: Cluster,
                 span: int, blocks: int | None = None) -> float:
    """Seconds per micro-batch expert parallel adds to a stage of `blocks` blocks (None: the
    most a stage holds): its all-to-alls, the busiest rank receiving `imbalance` x the
    mean, and that rank's routed work beyond the mean's. `span`: the ranks the ep group
    spans in the mesh."""
    p = cand.plan
    if not spec.experts or p.ep == 1:
        return 0.0
    layers = most_blocks(spec, p) if blocks is None else blocks
    skew = imbalance(cand, setup)
    buffer = dispatch_bytes(spec, cand, setup) * skew
    comm = alltoalls(cand) * cluster.collective_time("all_to_all", buffer, p.ep, span)
    routed = 2 * spec.top_k * spec.mlp_matrices * spec.hidden * spec.expert_width / p.tp
    passes = 3 + (1 / p.recompute_every if cand.recompute == "full" else 0)
    extra = (skew - 1) * passes * cand.micro_batch * spec.seq * routed / cluster.achievable_flops
    return layers * (comm + extra)


def transient_bytes(spec: ModelSpec, cand: Candidate, setup: Setup) -> float:
    """The all-to-all's send and receive buffers of one layer's routed tokens, the busiest
    rank's: 2 b s k h e x imbalance."""
    if not spec.experts or cand.plan.ep == 1:
        return 0.0
    return 2 * dispatch_bytes(spec, cand, setup) * imbalance(cand, setup)


def ep_sizes(spec: ModelSpec, dp: int) -> list[int]:
    """The ep widths a layout allows: dividing both dp and the experts (1 for a dense
    model)."""
    if not spec.experts:
        return [1]
    return [n for n in range(1, dp + 1) if dp % n == 0 and spec.experts % n == 0]
