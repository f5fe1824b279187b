"""Activation bytes per rank for one plan: what each layer saves for backward, how many
micro-batches a pipeline stage holds, the output layer's, and backward's working tensors.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
§4 and Table 2: activation bytes per transformer layer; §4.2.3 pipeline in-flight counts.
"""
from __future__ import annotations

from functools import partial

from meshtrain.core.loss_chunks import chunk_rows, uses_lean_loss
from meshtrain.planner import experts
from meshtrain.planner.model_spec import ModelSpec
from meshtrain.planner.setup import Candidate, Setup
from meshtrain.planner.stage_split import stage_blocks


def layer_activation_bytes(spec: ModelSpec, seq: int, micro_batch: int, tp: int = 1,
                           sp: bool = False, recompute: str = "none",
                           elem_bytes: int = 2, routed: float | None = None) -> float:
    """Activation bytes one transformer layer keeps for backward (Korthikanti 2022, Table 2).

    In 16-bit with dropout and multi-head attention the paper's counts are:
      none:                       s b h (34 + 5 a s / h)
      tensor parallel t:          s b h (10 + 24/t + 5 a s / (h t))
      tensor + sequence parallel: s b h (34/t + 5 a s / (h t))
      attention recomputation:    s b h (10 + 24/t)      (with sequence parallel: 34 s b h / t)
      full recomputation:         2 s b h                (only the layer's input)
    (Korthikanti's "selective" is meshtrain's "attention"; meshtrain's "selective" is per op:
    `selective_layer_bytes`.)
    Built from its §4.1 parts so they also hold for other shapes: the 10 that TP leaves
    replicated are the two LayerNorm inputs (4sbh), the attention and MLP inputs (4sbh) and
    two 1-byte dropout masks (2sbh); the 24 TP divides are Q, K, V and the projection input
    (8sbh) and the MLP's two 4h-wide tensors (16sbh); the scores are softmax output (2),
    dropout mask (1) and dropout output (2) per a s^2 b. Other element sizes scale the
    2-byte terms; masks stay 1 byte. Under sequence parallel the attention's and the MLP's
    inputs are kept as this rank's sequence slice and all-gathered again in backward (§4.2.2;
    meshtrain's runtime does so: strategies/tensor_parallel/sequence.py), so all 10 divide.
    A mixture of experts' MLP saves what its router and its `routed` rows per token keep
    (default: top-k; experts.saved_bytes_per_token), whole on every tensor-parallel rank (its
    experts are), and its shared experts as a dense MLP of their width.
    A model traced in this precision (ModelSpec.traced_layer_bytes: what its own layer
    saves, e.g. a transformers RMSNorm's fp32 copy of its input) keeps what the trace finds
    beyond these counts as well, whole on every tensor-parallel rank (as the norms' are),
    a slice under sequence parallel.
    """
    s, b, h, a, e = seq, micro_batch, spec.hidden, spec.heads, elem_bytes
    sbh = s * b * h
    split = tp if sp else 1
    if recompute == "full":
        return e * sbh / split
    if recompute == "selective":
        return selective_layer_bytes(spec, seq, micro_batch, tp, sp, elem_bytes, routed)
    masks = 2 if spec.dropout else 0
    kept = 4 * e + masks
    attn = e * (2 + 2 * spec.kv_dim / h)
    mlp = e * (4 if spec.mlp == "swiglu" else 2) * spec.ffn_hidden / h
    if spec.experts:   # the routed experts' part of ffn_hidden is priced per routed row
        mlp = e * (4 if spec.mlp == "swiglu" else 2) * spec.shared_ffn / h
        rows = spec.top_k if routed is None else routed
        kept += experts.saved_bytes_per_token(spec, rows, e) / h
    divided = attn + mlp
    span = spec.attention_span or s   # keys per query: the whole sequence under cp
    scores = 0.0 if spec.flash_attention else (a * span / h) * (e + (1 + e if spec.dropout else 0))
    traced = spec.traced_bytes_per_token(e)
    if traced is not None:   # the counts above at tp = 1 fall short of the trace by this
        kept += traced / h - (kept + divided + scores)
    if recompute == "attention":
        scores = 0.0
    if spec.output_twice:   # context parallel's all-to-all (planner/context_parallel.py)
        divided += e
    return sbh * (kept / split + (divided + scores) / tp)


def selective_layer_bytes(spec: ModelSpec, seq: int, micro_batch: int, tp: int = 1,
                          sp: bool = False, elem_bytes: int = 2,
                          routed: float | None = None) -> float:
    """What one layer keeps under per-op selective recomputation (strategies/recompute.py's
    SAVED_OPS): its input and the outputs of its matmuls and attention kernel, nothing else.
    Per token, in elements of e bytes:
        input h (a slice under sequence parallel)
      + Q, K, V projections (h + 2 kv) / t  + attention output h / t (+ its fp32 log-sum-exp,
        a / t floats; without a fused kernel the scores' matmul, a s / t)
      + output projection h  + MLP in (2 ffn for SwiGLU's gate and up, else ffn) / t
      + MLP out h
    The two row-parallel outputs are whole on every tensor-parallel rank (the partial sums
    before their all-reduce or reduce-scatter). A GPT's: 11 h (t = 1); a Llama's:
    5 h + 2 kv + 2 ffn. Dropout masks are not counted (recomputed from the saved RNG).
    A mixture of experts' MLP keeps its router's logits and each of its `routed` rows'
    expert matmuls (default: top-k; experts.selective_bytes_per_token), whole on every
    tensor-parallel rank as its experts are; its shared experts' as a dense MLP's.
    A model traced in this precision (ModelSpec.traced_selective_bytes: what the policy
    kept, run on the model itself) keeps what the trace finds beyond these counts as well,
    whole on every tensor-parallel rank, a slice under sequence parallel."""
    s, b, h, a, e = seq, micro_batch, spec.hidden, spec.heads, elem_bytes
    split = tp if sp else 1
    ffn = spec.shared_ffn if spec.experts else spec.ffn_hidden
    mlp_in = (2 if spec.mlp == "swiglu" else 1) * ffn
    sliced = e * (h + 2 * spec.kv_dim + h + mlp_in) + 4 * a
    if not spec.flash_attention:
        sliced += e * a * (spec.attention_span or s)
    outputs = 2 * e * h   # the output projection's and the MLP's
    if spec.experts:   # the MLP's out only with shared experts; the routed rows' their own
        rows = spec.top_k if routed is None else routed
        outputs = e * h * (2 if spec.shared_ffn else 1) + \
            experts.selective_bytes_per_token(spec, rows, e)
    whole = e * h / split + outputs
    traced = spec.traced_bytes_per_token(e, selective=True)
    if traced is not None:   # the counts at tp = 1 fall short of the trace by this
        whole += (traced - (e * h + sliced + outputs)) / split
    return s * b * (whole + sliced / tp)


def stage_layers_bytes(spec: ModelSpec, cand: Candidate, setup: Setup, layers: int) -> float:
    """What `layers` transformer layers of one stage keep for one micro-batch: under full
    recomputation every `recompute_every`-th of them keeps only its input (a stage's share
    counted as floor(layers / k), the layers' count from its start), the others everything."""
    p = cand.plan
    per_layer = partial(layer_activation_bytes, spec, spec.seq, cand.micro_batch, p.tp, cand.sp,
                        elem_bytes=setup.act_bytes, routed=experts.routed_rows(spec, cand))
    k = p.recompute_every if cand.recompute == "full" else 1
    recomputed = layers // k
    return (recomputed * per_layer(recompute=cand.recompute)
            + (layers - recomputed) * per_layer(recompute="none"))


def inflight_microbatches(schedule: str, pp: int, m: int, v: int = 1, stage: int = 0) -> float:
    """Micro-batches whose activations pipeline stage `stage` holds at its peak.

    pp = 1: micro-batches run one after another (gradient accumulation): 1.
    GPipe (Huang et al. 2019): all m forwards before any backward: m, on every stage.
    1F1B (PipeDream-Flush, Narayanan et al. 2021 §2.2.1): stage s runs p - s forwards before
    its first backward: min(m, p - s) (p on the first stage, 1 on the last).
    Interleaved with v chunks per rank (Megatron 2021 §2.2.2 warm-up of 2(p - s - 1) +
    (v - 1) p chunk-forwards, then one more before the first backward): in units of a whole
    stage's layers, (2(p - s - 1) + (v - 1) p + 1) / v; on the first stage that is
    p (1 + (p-1)/(p v)), Korthikanti 2022 §4.2.3.
    Naive model parallel: one micro-batch moves through at a time: 1.
    """
    if pp == 1 or schedule == "naive":
        return 1
    if schedule == "gpipe":
        return m
    if schedule == "interleaved":
        return min(m, (2 * (pp - stage - 1) + (v - 1) * pp + 1) / v)
    if schedule == "zb-h1":   # rank r defers r W's: every stage holds up to P (schedules.py)
        return min(m, pp)
    return min(m, pp - stage)


def logits_bytes(spec: ModelSpec, seq: int, micro_batch: int, tp: int) -> float:
    """The output layer's fp32 logits for cross-entropy: 4 s b V / t bytes (Korthikanti 2022,
    §4.3), kept on the last stage for one micro-batch."""
    return 4 * seq * micro_batch * spec.vocab / tp


def lean_loss(cand: Candidate) -> bool:
    """Whether the loss keeps no fp32 copy of the logits (`lean_cross_entropy` keeps their
    gradient in the logits' own buffer)."""
    return uses_lean_loss(cand.recompute, cand.plan.tp)


def kept_logits_bytes(spec: ModelSpec, cand: Candidate, setup: Setup) -> float:
    """What the loss keeps for backward: the fp32 logits (Korthikanti's 4 s b V / t), or with
    the lean loss their gradient in the compute dtype, in place of the logits."""
    fp32 = logits_bytes(spec, spec.seq, cand.micro_batch, cand.plan.tp)
    return fp32 * setup.act_bytes / 4 if lean_loss(cand) else fp32


def transient_bytes(spec: ModelSpec, cand: Candidate, setup: Setup) -> float:
    """Working tensors that exist beside the saved activations at the step's peak (derived).

    The peak falls as backward starts, when every saved activation is still alive. Then:
    - the cross-entropy's gradient w.r.t. the log-probabilities and the log-softmax
      backward's gradient w.r.t. the logits, both fp32 and logits-shaped: 2 x 4 s b V / t;
    - one freshly produced parameter gradient before it is copied into its DDP bucket (the
      "absorb" transient; also the size of a single-tensor AdamW temporary): the largest
      weight matrix's gradient, grad_bytes x largest_tensor_params / t.
    Checked against the CPU allocator's exact peak (torch.profiler profile_memory) for
    meshtrain's GPT: exact when an h x 4h matrix is the largest (the absorb transient then
    coincides with the logits' gradients); when the vocabulary dominates, the second term
    does not coincide with the first and this over-states the peak by that one gradient.
    The lean loss of recomputation plans makes no logits-shaped fp32 tensor: its two fp32
    chunks as forward ends, or the absorb transient, whichever is larger.
    """
    p = cand.plan
    absorb = setup.grad_bytes * spec.largest_tensor_params / p.tp
    if lean_loss(cand):   # its fp32 working chunk and logsumexp's, as forward ends
        rows = min(spec.seq * cand.micro_batch, chunk_rows(spec.vocab))
        return max(2 * 4 * rows * spec.vocab, absorb)
    logits = 2 * logits_bytes(spec, spec.seq, cand.micro_batch, p.tp)
    return logits + absorb


def output_bytes(spec: ModelSpec, cand: Candidate, setup: Setup) -> float:
    """The output layer's activations for one micro-batch, on the last stage: the final
    norm's and the projection's inputs (2 s b h elements, or what a traced model's save;
    under sequence parallel a slice, the projection's gathered again in backward) and
    what the loss keeps of the logits (`kept_logits_bytes`)."""
    p = cand.plan
    tokens = spec.seq * cand.micro_batch
    traced = spec.traced_bytes_per_token(setup.act_bytes, head=True)
    head = tokens * traced if traced is not None else 2 * setup.act_bytes * tokens * spec.hidden
    split = p.tp if cand.sp else 1
    return head / split + kept_logits_bytes(spec, cand, setup)


def full_layer_bytes(spec: ModelSpec, cand: Candidate, setup: Setup) -> float:
    """Everything one layer's forward makes for one micro-batch, saved or not (nothing
    recomputed): what a recomputed layer holds again, and a dense layer's heap unit."""
    return layer_activation_bytes(spec, spec.seq, cand.micro_batch, cand.plan.tp, cand.sp,
                                  "none", setup.act_bytes, experts.routed_rows(spec, cand))


def heap_layer_bytes(spec: ModelSpec, cand: Candidate, setup: Setup) -> float:
    """The runtime heap's unit (`forward_traffic`): `full_layer_bytes`, a mixture's routed
    part counted as a dense MLP of one expert's width (experts.heap_bytes_per_token): the
    heap was calibrated on dense layers, and keeps a mixture's as its dense counterpart's."""
    layer = full_layer_bytes(spec, cand, setup)
    if not spec.experts:
        return layer
    e = setup.act_bytes
    saved = experts.saved_bytes_per_token(spec, experts.routed_rows(spec, cand), e)
    return layer + spec.seq * cand.micro_batch * (experts.heap_bytes_per_token(spec, e) - saved)


def forward_traffic(spec: ModelSpec, cand: Candidate, setup: Setup, stage: int
                    ) -> tuple[float, float]:
    """What one micro-batch's forward allocates on `stage`, saved or not, as (its first
    layer's, the rest: its other layers' and the output layer's on the last stage). The heap
    the runtime keeps grows with it (the next micro-batch reuses what this one freed,
    whatever is in flight); measured, glibc keeps most of one layer's temporaries and a
    smaller part of each further layer's (meshtrain.measure.fit.fit_runtime_memory). An interleaved
    stage runs its chunks' forwards apart, each from its own first layer: "first" is theirs.
    A mixture's layer counts as its heap holds it (`heap_layer_bytes`)."""
    p = cand.plan
    layer = heap_layer_bytes(spec, cand, setup)
    layers_here = stage_blocks(spec, p)[stage]
    chunks = min(p.virtual_stages, layers_here)
    rest = layer * (layers_here - chunks)
    if stage == p.pp - 1:
        rest += output_bytes(spec, cand, setup)
    return layer * chunks, rest
