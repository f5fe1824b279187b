"""Whether a Plan can run: the one function every entry point asks before building anything.

    check_plan(plan)                          what the plan alone says (the planner's ranking)
    check_plan(plan, world_size=4)            and that it covers the world (the command line)
    check_plan(plan, model, world_size)       and what the model's layers allow (the Trainer)

Each refusal is a PlanError naming the problem and the fix. `Plan.__post_init__` keeps only
the checks of one field's own value range and the mesh's own structure; everything about
combining knobs, strategies not built yet, the model and the world is here. What needs a
strategy's own objects (process groups, shards, a model's modules matched by a tp_plan) stays
in that strategy's `check`.
"""
from __future__ import annotations

import inspect
import math

from meshtrain.core.plan import LOCAL_STEP_MODES, Plan, PlanError


def check_plan(plan: Plan, model=None, world_size: int | None = None) -> None:
    """Raise PlanError for the first reason `plan` cannot run (on `model`, over
    `world_size` ranks, where given)."""
    _refuse_unbuilt(plan)
    _check_max_grad_norm(plan)
    _check_local_steps(plan)
    _check_compression(plan)
    _check_sync_warmup(plan)
    _check_offload_dir(plan)
    _check_zero3_units(plan)
    _check_zero3_regather(plan)
    _check_zero3_fp8_gather(plan)
    _check_stage_cuts(plan, _layer_count(model) if model is not None else None)
    _check_tp_plan(plan)
    if not isinstance(plan.measure_activations, bool):
        raise PlanError(f"Plan.measure_activations={plan.measure_activations!r}: must be True "
                        "or False")
    if world_size is not None:
        plan.check_world_size(world_size)


def _refuse_unbuilt(plan: Plan) -> None:
    """Name the first strategy in `plan` that meshtrain cannot run yet."""
    unbuilt = [
        (plan.dp_mode not in ("ddp", *LOCAL_STEP_MODES) and (plan.pp > 1 or plan.tp > 1),
         f"dp_mode={plan.dp_mode!r} with pp={plan.pp}, tp={plan.tp}: DP and the parameter "
         "server run with pp = tp = 1 for now"),
        (plan.dp_mode in LOCAL_STEP_MODES and plan.precision != "fp32",
         f"dp_mode={plan.dp_mode!r} with precision={plan.precision!r}: DiLoCo and local SGD "
         "run in fp32 for now"),
        (plan.dp_mode != "ddp" and plan.precision != "fp32",
         f"dp_mode={plan.dp_mode!r} with precision={plan.precision!r}: DP and the parameter "
         "server run in fp32 for now"),
        (plan.precision == "fp8" and plan.compile == "cudagraphs",
         "precision='fp8' with compile='cudagraphs': float8 training is compiled with "
         "inductor or aot_eager for now (compile=True)"),
        (plan.ep > 1 and (plan.dp_mode != "ddp" or plan.compression != "none"
                          or plan.precision == "fp8"),
         f"ep={plan.ep} with dp_mode={plan.dp_mode!r}, compression={plan.compression!r}, "
         f"precision={plan.precision!r}: expert parallel runs with DDP and ZeRO, in fp32 or "
         "bf16, for now; use dp_mode='ddp', compression='none' and precision 'fp32' or "
         "'bf16'"),
        (plan.capacity_factor is not None and plan.dp_mode == "dp",
         f"capacity_factor={plan.capacity_factor} with dp_mode='dp': the replicas, threads of "
         "one process, would share each MoE layer's capacity counters; use dp_mode='ddp'"),
    ]
    for applies, message in unbuilt:
        if applies:
            raise PlanError(f"{message}; use a data-parallel plan such as Plan(dp=N)")
    _check_compile(plan)
    _check_context_parallel(plan)


def _check_context_parallel(plan: Plan) -> None:
    """Context parallel (strategies/context_parallel) with what it is not built with yet."""
    if plan.cp == 1:
        return
    unbuilt = {"compile": plan.compile is not False,
               f"dp_mode={plan.dp_mode!r}": plan.dp_mode != "ddp",
               f"recompute={plan.recompute!r}": plan.recompute not in ("none", "full"),
               f"compression={plan.compression!r}": plan.compression != "none",
               f"ep={plan.ep}": plan.ep > 1,
               # capacity counts per whole sequence (models/experts.py), which cp splits
               f"capacity_factor={plan.capacity_factor}": plan.capacity_factor is not None}
    for name, applies in unbuilt.items():
        if applies:
            raise PlanError(f"cp with {name} is not built yet: context parallel runs with "
                            "tp, pp, DDP or ZeRO over dp, fp32, bf16 or fp8, eager, recompute "
                            f"'none' or 'full'; drop {name.split('=')[0]}, or use cp=1")


def _check_compile(plan: Plan) -> None:
    """Compiled blocks (strategies/compile.py) with the strategies they are not built for."""
    if plan.compile is False:
        return
    if plan.pp > 1 and plan.schedule == "zb-h1":
        raise PlanError("compile with schedule='zb-h1': zero bubble splits each backward into "
                        "input and weight gradients, but a compiled block's backward is one "
                        "graph that computes both, so the weight work would run twice; use "
                        "schedule='1f1b' (or another), or drop compile")
    if plan.compile == "cudagraphs":
        _check_cuda_graphs(plan)


def _check_cuda_graphs(plan: Plan) -> None:
    """CUDA graphs replay fixed addresses, one step's graphs after another: what moves
    parameters or interleaves steps' graphs is refused."""
    conflicts = {"zero=3 frees and regathers each unit's parameters at new addresses":
                 plan.zero == 3,
                 "tensor parallel's collectives split each block into many graphs": plan.tp > 1,
                 "a pipeline runs micro-batches' forwards between others' backwards": plan.pp > 1,
                 "recomputation runs a block's forward again inside backward":
                 plan.recompute != "none",
                 f"dp_mode={plan.dp_mode!r} runs replicas or servers in threads":
                 plan.dp_mode not in ("ddp",) + LOCAL_STEP_MODES}
    for why, refused in conflicts.items():
        if refused:
            raise PlanError(f"compile='cudagraphs' with this plan: {why}; use compile=True "
                            f"(inductor without CUDA graphs)")


def _check_max_grad_norm(plan: Plan) -> None:
    norm = plan.max_grad_norm
    if norm is None:
        return
    if (isinstance(norm, bool) or not isinstance(norm, (int, float))
            or not math.isfinite(norm) or norm <= 0):
        raise PlanError(f"max_grad_norm={norm!r}: must be a positive number (the largest "
                        "global gradient norm), or None for no clipping")
    if plan.dp_mode == "ps-async":
        raise PlanError("max_grad_norm with dp_mode='ps-async': clipping needs every "
                        "step's global gradient norm, which asynchronous workers never "
                        "wait for; use ps-sync, or drop max_grad_norm")
    if plan.dp_mode in LOCAL_STEP_MODES:
        raise PlanError(f"max_grad_norm with dp_mode={plan.dp_mode!r} is not built: each "
                        "worker would clip by its own norm; drop max_grad_norm")


def _check_local_steps(plan: Plan) -> None:
    """diloco / local-sgd's fields against the rest of the plan."""
    default = Plan.__dataclass_fields__
    h, lr, mom = plan.sync_every, plan.outer_lr, plan.outer_momentum
    outer_set = (lr != default["outer_lr"].default
                 or mom != default["outer_momentum"].default)
    if plan.dp_mode not in LOCAL_STEP_MODES:
        if h != 1 or outer_set:
            raise PlanError(f"Plan(sync_every={h}, outer_lr={lr}, outer_momentum={mom}) only "
                            f"applies to dp_mode='diloco' (or 'local-sgd' for sync_every), "
                            f"not dp_mode={plan.dp_mode!r}; drop them or choose diloco")
        return
    if plan.dp_mode == "local-sgd" and outer_set:
        raise PlanError(f"Plan(dp_mode='local-sgd', outer_lr={lr}, outer_momentum={mom}): "
                        "local SGD averages the parameters (outer lr 1, no momentum); use "
                        "dp_mode='diloco' to set outer_lr / outer_momentum")
    if plan.dp == 1:
        raise PlanError(f"Plan(dp_mode={plan.dp_mode!r}, dp=1): there are no other workers "
                        "to sync with; set dp >= 2, or use dp_mode='ddp'")


def _check_compression(plan: Plan) -> None:
    """PowerSGD is built for plain fp32 DDP only: anything else is refused by name."""
    if plan.compression == "none":
        return
    refused = [f"{name}={getattr(plan, name)!r}" for name, ok in (
        ("dp_mode", plan.dp_mode == "ddp"), ("zero", plan.zero == 0), ("pp", plan.pp == 1),
        ("tp", plan.tp == 1), ("precision", plan.precision == "fp32")) if not ok]
    if refused:
        raise PlanError(f"Plan(compression={plan.compression!r}) with {', '.join(refused)}: "
                        "PowerSGD is built for DDP's gradient sync only (dp_mode='ddp', "
                        "zero=0, pp=1, tp=1, precision='fp32'); change those, or set "
                        "compression='none'")


def _check_sync_warmup(plan: Plan) -> None:
    k = plan.sync_warmup_steps
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise PlanError(f"Plan.sync_warmup_steps={k!r}: must be a whole number >= 0 (steps "
                        "of plain DDP before the slow-link method starts, e.g. 32)")
    if k and plan.dp_mode not in LOCAL_STEP_MODES and plan.compression == "none":
        raise PlanError(f"Plan.sync_warmup_steps={k} delays a slow-link method (dp_mode="
                        f"'diloco' or 'local-sgd', or compression='powersgd'), but the plan "
                        f"has dp_mode={plan.dp_mode!r} and no compression; choose one, or "
                        "drop sync_warmup_steps")


def _check_offload_dir(plan: Plan) -> None:
    if plan.offload_dir is None:
        return
    if not isinstance(plan.offload_dir, str) or not plan.offload_dir:
        raise PlanError(f"Plan.offload_dir={plan.offload_dir!r}: give a folder path")
    if plan.offload != "disk":
        raise PlanError(f"offload_dir (--offload-dir) is where offload='disk' writes, but "
                        f"Plan.offload={plan.offload!r}; set offload='disk' (--offload disk) "
                        "or drop offload_dir")


def _check_zero3_regather(plan: Plan) -> None:
    if not plan.zero3_regather:
        return
    if plan.zero3_regather is not True:
        raise PlanError(f"Plan.zero3_regather={plan.zero3_regather!r}: must be True or False")
    if plan.zero != 3 or plan.pp == 1:
        raise PlanError(f"zero3_regather chooses how ZeRO-3 gathers under pipeline stages, but "
                        f"Plan.zero={plan.zero}, pp={plan.pp} (at pp=1 ZeRO-3 gathers every "
                        "micro-batch already); set zero=3 and pp > 1, or drop zero3_regather")
    if plan.schedule == "zb-h1":
        raise PlanError("zero3_regather with schedule='zb-h1' is not built (its weight pass "
                        "would gather the units a third time); use schedule='1f1b', 'gpipe', "
                        "'interleaved' or 'naive', or drop zero3_regather")


def _check_zero3_fp8_gather(plan: Plan) -> None:
    asked = plan.zero3_fp8_gather
    if asked is None or asked is False:
        return
    if asked is not True:
        raise PlanError(f"Plan.zero3_fp8_gather={asked!r}: must be True, False or None")
    if plan.zero != 3 or plan.precision != "fp8":
        raise PlanError(f"zero3_fp8_gather all-gathers ZeRO-3's float8 linears' weights in "
                        f"float8, but Plan.zero={plan.zero}, precision={plan.precision!r}; "
                        "set zero=3 and precision='fp8', or drop zero3_fp8_gather")
    if plan.fp8_recipe != "tensorwise":
        raise PlanError(f"zero3_fp8_gather with fp8_recipe={plan.fp8_recipe!r}: a float8 "
                        "all-gather is built for tensorwise scaling only (torchao has none "
                        "for rowwise, whose weight is cast along each dim apart); drop "
                        "zero3_fp8_gather (the weights are gathered in bf16) or use "
                        "fp8_recipe='tensorwise'")


def _check_zero3_units(plan: Plan) -> None:
    units = plan.zero3_units
    if units is None:
        return
    if (not isinstance(units, tuple) or not units
            or not all(isinstance(u, str) and u for u in units)):
        raise PlanError(f"Plan.zero3_units={units!r}: give a non-empty list of module names "
                        "(as model.named_modules() names them)")
    if plan.zero != 3:
        raise PlanError(f"zero3_units names ZeRO-3's wrapping units, but Plan.zero="
                        f"{plan.zero}; set zero=3 or drop zero3_units")


def _check_stage_cuts(plan: Plan, layers: int | None) -> None:
    cuts = plan.stage_cuts
    if cuts is None:
        return
    if plan.pp == 1:
        raise PlanError("stage_cuts is given but Plan.pp=1: set pp > 1 to cut stages, "
                        "or drop stage_cuts")
    stages = plan.pp * plan.virtual_stages
    top = "the last layer's index" if layers is None else str(layers - 1)
    whole = isinstance(cuts, tuple) and all(
        isinstance(c, int) and not isinstance(c, bool) for c in cuts)
    bounds = [0, *cuts, layers if layers is not None else math.inf] if whole else []
    if (not whole or len(cuts) != stages - 1
            or any(a >= b for a, b in zip(bounds, bounds[1:]))):
        raise PlanError(f"stage_cuts={cuts!r}: give {stages - 1} increasing layer indices "
                        f"between 1 and {top} (where stages 1..{stages - 1} start)")


def _check_tp_plan(plan: Plan) -> None:
    tp_plan = plan.tp_plan
    if tp_plan is None:
        return
    pairs = isinstance(tp_plan, tuple) and tp_plan and all(
        isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
        and isinstance(pair[1], str) for pair in tp_plan)
    if not pairs:
        raise PlanError(f"tp_plan={tp_plan!r}: must be a non-empty dict of module-name pattern "
                        "-> style ('column', 'row', 'qkv' or 'vocab')")
    if plan.tp == 1:
        raise PlanError("tp_plan is given but Plan.tp=1: set tp > 1 to shard layers, or "
                        "drop tp_plan")


def _layer_count(model) -> int | None:
    """The model's pipeline layers, duck-typed (a `layers()` method, or an nn.Sequential's
    length); None where only the pipeline strategy knows how to find them."""
    layers = getattr(model, "layers", None)
    if inspect.ismethod(layers):   # not a ModuleList attribute, which is callable too
        return len(list(layers()))
    if type(model).__name__ == "Sequential" and hasattr(model, "__len__"):
        return len(model)
    return None
