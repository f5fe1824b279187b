"""One micro-batch's compute on one rank, for the step's time model (time_model.py): its
FLOPs at the cluster's rate (or at the measured efficiency of its own GEMMs and attention,
with the elementwise work around them at the memory's speed), and the host's dispatch of it
(kernel launches, autograd, Python), which a GPU runs beside the device's work and CPU ranks
pay on top."""
from __future__ import annotations

from meshtrain.planner.calibrated import model_efficiency
from meshtrain.planner.flops import elementwise_bytes_per_token, forward_flops_per_token
from meshtrain.planner.hardware import RECOMPUTED_BLOCK, Cluster
from meshtrain.planner.model_spec import ModelSpec
from meshtrain.planner.setup import Candidate, element_bytes
from meshtrain.planner.stage_split import most_blocks, stage_blocks


def micro_batch_compute(spec: ModelSpec, cand: Candidate, cluster: Cluster, b: float,
                        precision: str | None = None, stage: int | None = None) -> float:
    """Seconds of one micro-batch of `b` sequences on pipeline rank `stage` (None: the
    slowest), before the Trainer's factor: its blocks' FLOPs, as the pipeline cuts the
    stages (planner/stage_split.py), and the logit layer's on the last, over tp ranks, plus
    a fixed cost per block that no FLOP count sees. With measured efficiency curves (a
    GPU's local profile) in `precision`, the FLOPs run at the efficiency of this
    micro-batch's GEMMs and attention, and its elementwise work at the memory's speed
    (flops.ELEMENTWISE_BYTES; also where `elementwise_apart`: an efficiency measured on
    GEMMs and attention alone, or CPU ranks calibrated at two widths, whose elementwise
    work runs at its own `elementwise_bw`); where the host dispatches while the device
    computes (`async_dispatch`), the slower of the two bounds the micro-batch."""
    p = cand.plan
    if stage is None:
        return max(micro_batch_compute(spec, cand, cluster, b, precision, s)
                   for s in range(p.pp))
    blocks, last = stage_blocks(spec, p)[stage], stage == p.pp - 1
    layer_f, scores_f, logits_f = forward_flops_per_token(spec, spec.span)
    extra = (layer_f / p.recompute_every if cand.recompute == "full"
             else scores_f if cand.recompute == "attention" else 0)
    mb_flops = b * spec.seq * (blocks * (3 * layer_f + extra) + 3 * logits_f * last) / p.tp
    dispatch = dispatch_time(spec, cand, cluster, blocks)
    device = mb_flops / cluster.achievable_flops + float8_saving(spec, cand, cluster, b, blocks)
    apart = cluster.elementwise_apart
    curves = cluster.efficiency_curves
    if curves and precision == curves["dtype"]:   # one sequence's shapes, times b
        device = mb_flops / (cluster.peak_flops * model_efficiency(curves, spec, max(1, b)))
        apart = True
    if apart:   # the FLOPs' rate is the GEMMs' and attention's alone: the rest at memory speed
        moved = elementwise_bytes_per_token(spec, blocks_run(spec, cand, blocks=blocks), p.tp,
                                            element_bytes(precision), loss=last)
        device += b * spec.seq * moved / (cluster.elementwise_bw or cluster.mem_bw)
    return max(device, dispatch) if cluster.async_dispatch else device + dispatch


def float8_saving(spec: ModelSpec, cand: Candidate, cluster: Cluster, b: float,
                  blocks: int | None = None) -> float:
    """Seconds (negative) an fp8 plan's micro-batch saves on a stage of `blocks` blocks
    (None: the most a stage holds): its block linears' matmuls (forward, both backward
    GEMMs, and a fully recomputed layer's forward again) run at the float8 peak, at the same
    achievable fraction as bf16's; attention and the output layer stay in bf16 (torchao
    leaves the output layer alone). 0 for other precisions."""
    p = cand.plan
    if p.precision != "fp8" or not cluster.fp8_flops:
        return 0.0
    linear_f = 2 * spec.layer_matmul_params   # forward FLOPs per token per layer
    runs = 3 + (1 / p.recompute_every if cand.recompute == "full" else 0)
    blocks = most_blocks(spec, p) if blocks is None else blocks
    flops = b * spec.seq * blocks * runs * linear_f / p.tp
    return flops / (cluster.fp8_flops * cluster.efficiency) - flops / cluster.achievable_flops


def float8_amax_time(spec: ModelSpec, cand: Candidate, cluster: Cluster, layers: int,
                     b: float) -> float:
    """fp8 under tp: each block linear's float8 scales are the whole tensors' (strategies/
    float8.SplitFloat8): per micro-batch two all-reduces of amaxes over tp (tensorwise: the
    weight's and the split input's or output gradient's, 4 bytes each; rowwise: per-row
    ones, priced as one 4-byte amax per token), a third in a fully recomputed forward
    (counted for every linear)."""
    p = cand.plan
    if p.precision != "fp8" or p.tp == 1:
        return 0.0
    per_linear = 3 if cand.recompute == "full" else 2
    linears = 4 + spec.mlp_matrices   # q, k, v, o and the MLP's
    nbytes = 4 if p.fp8_recipe == "tensorwise" else 4 * b * spec.seq
    return (per_linear * linears * layers
            * cluster.collective_time("all_reduce", nbytes, p.tp, p.tp))


def dispatch_time(spec: ModelSpec, cand: Candidate, cluster: Cluster,
                  blocks: int | None = None) -> float:
    """Host seconds to dispatch one micro-batch on a rank of a stage of `blocks` blocks
    (None: the most a stage holds): kernel launches, autograd, Python (calibrated; 0 on
    GPU presets), per block it runs, a fully recomputed one `cluster.recompute_dispatch`
    blocks; tensor parallel does not divide it; the embedding, head and loss count as one
    more block."""
    p = cand.plan
    run = blocks_run(spec, cand, cluster.recompute_dispatch, blocks)
    dispatch = cluster.block_overhead * (run + 1)
    if p.dp_mode == "dp":   # the replicas' threads take turns at Python's interpreter lock
        dispatch *= p.dp
    return dispatch


def blocks_run(spec: ModelSpec, cand: Candidate, recomputed: float = RECOMPUTED_BLOCK,
               blocks: int | None = None) -> float:
    """The blocks one micro-batch runs forward and backward on a stage of `blocks` blocks
    (None: the most a stage holds, as the pipeline cuts them), a fully recomputed one
    `recomputed` blocks (its second forward: a third more of a block's work; of its
    dispatch, as calibrated); under recompute_every k one block in k. Per-op selective
    recomputation re-runs all of a block's forward but its matmuls and attention: its
    elementwise work and its dispatch count as full recomputation's."""
    blocks = most_blocks(spec, cand.plan) if blocks is None else blocks
    if cand.recompute == "selective":
        return blocks * recomputed
    if cand.recompute == "full":
        return blocks * (1 + (recomputed - 1) / cand.plan.recompute_every)
    return blocks
