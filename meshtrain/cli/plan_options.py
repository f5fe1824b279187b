"""`meshtrain train`'s plan flags (the Plan's fields), and the Plan they make."""
from __future__ import annotations

import dataclasses

from meshtrain.core.plan import (COMPILE_BACKENDS, FP8_RECIPES, PRECISIONS, RECOMPUTES,
                                 STAGE_BALANCES, Plan)


def add_plan_options(plan) -> None:
    """The Plan's fields as flags."""
    plan.add_argument("--dp", type=int, help="data-parallel ranks (default: all ranks)")
    plan.add_argument("--pp", type=int, default=1, help="pipeline stages (layers over ranks)")
    plan.add_argument("--tp", type=int, default=1,
                      help="tensor-parallel ranks: each layer's matrices split over them")
    add_mesh_axis_options(plan)
    plan.add_argument("--sequence-parallel", action="store_true",
                      help="with --tp > 1: split LayerNorm and residual activations along the "
                           "sequence (same bytes, activations of those regions / tp)")
    plan.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                      help="ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also "
                           "parameters")
    plan.add_argument("--zero3-regather", action="store_true",
                      help="with --zero 3 and --pp > 1: gather each unit for every "
                           "micro-batch's forward and backward (a unit or two held; 2M "
                           "gathers a step) instead of once a step, kept to the stage's last "
                           "backward (torchtitan's policy, the default)")
    plan.add_argument("--offload", default="none", choices=["none", "cpu", "disk"],
                      help="with --zero: keep optimizer states in host memory or on disk")
    plan.add_argument("--offload-dir", help="where --offload disk writes (default: the run "
                                            "folder's offload/)")
    plan.add_argument("--recompute", default="none", choices=RECOMPUTES,
                      help="every layer, per op (matmul/attention outputs kept), attention core")
    plan.add_argument("--recompute-every", type=int, default=1, metavar="K",
                      help="with --recompute full: every K-th layer (default 1: each)")
    plan.add_argument("--compile", nargs="?", const=True, default=False,
                      choices=list(COMPILE_BACKENDS), metavar="BACKEND",
                      help="torch.compile each transformer block (default backend inductor; "
                           "cudagraphs: inductor replayed as CUDA graphs on a GPU; "
                           "aot_eager traces without generating code)")
    plan.add_argument("--precision", default="fp32", choices=[*PRECISIONS, "fp8-emulated"],
                      help="bf16 compute, fp32 masters; fp8: float8 linears (torchao)")
    plan.add_argument("--fp8-recipe", default="tensorwise", choices=list(FP8_RECIPES),
                      help="with --precision fp8: one scale per tensor, or per row (torchao's "
                           "recipes; rowwise keeps more precision, runs a little slower)")
    plan.add_argument("--dp-mode", default="ddp",
                      choices=["ddp", "dp", "ps-sync", "ps-async", "diloco", "local-sgd"],
                      help="how data-parallel replicas agree: ddp (ring all-reduce), dp (one "
                           "process, --dp replicas as threads, a master), ps-sync / ps-async "
                           "(parameter server), diloco / local-sgd (workers step alone and "
                           "sync every --sync-every steps, for a slow dp link)")
    plan.add_argument("--staleness", type=int, default=0,
                      help="ps-async: how many steps a worker may run ahead of the slowest")
    plan.add_argument("--ps-shards", type=int, default=1,
                      help="ps-sync/ps-async: parameter-server shards (shard k on rank k)")
    plan.add_argument("--sync-every", type=int, default=Plan().sync_every, metavar="H",
                      help="diloco/local-sgd: inner steps between two syncs")
    plan.add_argument("--outer-lr", type=float, default=Plan().outer_lr,
                      help="diloco: the outer SGD's learning rate on the averaged "
                           "pseudo-gradient")
    plan.add_argument("--outer-momentum", type=float, default=Plan().outer_momentum,
                      help="diloco: the outer SGD's Nesterov momentum, in [0, 1)")
    plan.add_argument("--microbatches", type=int, default=1, help="per step (accumulation)")
    plan.add_argument("--schedule", default="1f1b",
                      help="pipeline schedule with --pp > 1: naive | gpipe | 1f1b | "
                           "interleaved | zb-h1 (zero bubble)")
    plan.add_argument("--virtual-stages", type=int, default=1,
                      help="model chunks per pipeline rank (with --schedule interleaved)")
    plan.add_argument("--stage-balance", default="compute", choices=list(STAGE_BALANCES),
                      help="with --pp > 1: balance the stages by each layer's training FLOPs "
                           "(the embedding ~0, a large vocabulary's head several blocks) or "
                           "by its parameters (memory)")
    plan.add_argument("--bucket-mb", type=float, default=Plan().bucket_mb)
    plan.add_argument("--compression", default="none", choices=["none", "powersgd"],
                      help="DDP's gradient sync: powersgd sends large gradients as low-rank "
                           "factors (error feedback, warm start)")
    plan.add_argument("--compression-rank", type=int, default=Plan().compression_rank,
                      metavar="R", help="powersgd: the factors' rank")
    plan.add_argument("--sync-warmup-steps", type=int, default=Plan().sync_warmup_steps,
                      metavar="K", help="diloco/local-sgd/powersgd: plain DDP for the first "
                                        "K steps, then the method")


def add_mesh_axis_options(plan) -> None:
    """`meshtrain train`'s context- and expert-parallel flags (Plan.cp, cp_style, ep,
    capacity_factor)."""
    plan.add_argument("--cp", type=int, default=1,
                      help="context-parallel ranks: each sequence split over them (2 cp chunks, "
                           "load-balanced), attention across them")
    plan.add_argument("--cp-style", default="ring", choices=["ring", "all-to-all"],
                      help="with --cp > 1: K/V passed round a ring, or heads scattered by an "
                           "all-to-all (the heads must divide by --cp)")
    plan.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (of the dp "
                      "ranks): each MoE layer's experts split over them")
    plan.add_argument("--capacity-factor", type=float, default=None, metavar="C",
                      help="a mixture of experts: each expert takes at most ceil(C x seq x "
                           "top-k / experts) choices of each sequence, the rest dropped and "
                           "counted (default: dropless)")


def plan_from_args(args, world: int) -> Plan:
    """The Plan the flags ask for on `world` ranks (dp: --dp, else what pp x cp x tp leave;
    --dp-mode dp: 2 replicas, threads of one process, unless --dp says)."""
    one_process = args.dp_mode == "dp"
    dp = args.dp or (2 if one_process else max(1, world // (args.pp * args.cp * args.tp)))
    return Plan(dp=dp, pp=args.pp, tp=args.tp, cp=args.cp, cp_style=args.cp_style,
                ep=args.ep, capacity_factor=args.capacity_factor, staleness=args.staleness,
                ps_shards=args.ps_shards, sync_every=args.sync_every, outer_lr=args.outer_lr,
                outer_momentum=args.outer_momentum, zero=args.zero, dp_mode=args.dp_mode,
                microbatches=args.microbatches, virtual_stages=args.virtual_stages,
                stage_balance=args.stage_balance,
                bucket_mb=args.bucket_mb, precision=args.precision.removesuffix("-emulated"),
                fp8_emulate=args.precision == "fp8-emulated", fp8_recipe=args.fp8_recipe,
                offload=args.offload,
                recompute=args.recompute, recompute_every=args.recompute_every,
                sequence_parallel=args.sequence_parallel, max_grad_norm=args.max_grad_norm,
                offload_dir=args.offload_dir, measure_activations=True, schedule=args.schedule,
                compression=args.compression, compression_rank=args.compression_rank,
                compile=args.compile, sync_warmup_steps=args.sync_warmup_steps,
                zero3_regather=args.zero3_regather)


FLAGLESS = ("zero3_units", "stage_cuts", "tp_plan", "compression_min_rate",
            "zero3_fp8_gather")   # Plan(...) only
_NOT_FLAGS = ("measure_activations", "fp8_emulate")   # always on / part of --precision


def plan_flags(plan: Plan) -> list[str] | None:
    """The flags `plan_from_args` makes `plan` from (over `--nproc plan.world_size`), its
    defaults left out; None where it sets a field no flag reaches (FLAGLESS)."""
    default, flags = Plan(), ["--nproc", str(plan.world_size)]
    if plan.dp_mode == "dp":   # one process: its replicas are threads, not ranks
        flags += ["--dp", str(plan.dp)]
    for f in dataclasses.fields(Plan):
        value = getattr(plan, f.name)
        if f.name in ("dp", *_NOT_FLAGS) or value == getattr(default, f.name):
            continue
        if f.name in FLAGLESS:
            return None
        flag = "--" + f.name.replace("_", "-")
        if f.name == "precision" and plan.fp8_emulate:
            value = "fp8-emulated"
        flags += [flag] if value is True else [flag, str(value)]
    return flags
