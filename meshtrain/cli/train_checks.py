"""`meshtrain train`'s refusals of a model, plan and batch that cannot train together, in the
command's process before any rank starts (the model built on the meta device where one is
needed)."""
from __future__ import annotations

from meshtrain.core.plan import Plan, PlanError


def check_batch_split(config, plan: Plan) -> None:
    """The global batch must split evenly over the dp ranks, and each rank's over its
    micro-batches."""
    if plan.dp and config.batch_size % plan.dp:
        raise PlanError(f"global batch {config.batch_size} does not split over dp="
                        f"{plan.dp} ranks; use --batch a multiple of {plan.dp}")
    if (config.batch_size // plan.dp) % plan.microbatches:
        raise PlanError(f"each dp rank's batch of {config.batch_size // plan.dp} does not "
                        f"split into --microbatches {plan.microbatches}; use --batch a "
                        f"multiple of {plan.dp * plan.microbatches}")


def check_model_plan(config, plan: Plan) -> None:
    """Refuse, before any rank starts, what this model cannot do under this plan (and fp8
    without torchao, or on a CPU unemulated, each rank checking its GPU's float8 matmuls;
    CUDA graphs off a GPU)."""
    from meshtrain.models.gpt import gpt_config
    from meshtrain.models.registry import kind_of
    from meshtrain.strategies.float8 import check_fp8

    check_fp8(plan.precision, plan.fp8_emulate, config.device)
    if plan.compile == "cudagraphs" and config.device != "cuda":   # torch would run inductor
        raise PlanError(f"--compile cudagraphs replays CUDA graphs, which need a GPU, and this "
                        f"run is on the {config.device.upper()}; use --compile (inductor) or "
                        "--compile aot_eager here")
    kind = kind_of(config.model)
    gpt = gpt_config(config.model, **config.model_overrides) if kind == "gpt" else None
    no_experts = kind == "callable" or gpt is not None and not gpt.experts
    if plan.ep > 1 and no_experts:
        raise PlanError(f"--ep {plan.ep} splits the experts of mixture-of-experts layers, and "
                        f"{config.model!r} has none; use --ep 1, or a MoE model (--model "
                        "gpt-moe-tiny, mixtral-tiny, qwen3-moe-tiny, olmoe-tiny; a GPT preset "
                        "with --experts N)")
    if plan.capacity_factor is not None and no_experts:
        raise PlanError(f"--capacity-factor {plan.capacity_factor} limits the tokens each "
                        f"expert of a mixture-of-experts layer takes, and {config.model!r} has "
                        "none; drop --capacity-factor, or use a MoE model (--model "
                        "gpt-moe-tiny, mixtral-tiny, qwen3-moe-tiny, olmoe-tiny)")
    check_context(config, plan)
    if gpt is not None:
        from meshtrain.strategies.tensor_parallel.gpt import check_tensor_parallel
        check_gpt_experts(gpt, plan)
        check_tensor_parallel(gpt, plan)
        stages = plan.pp * plan.virtual_stages
        if plan.pp > 1 and stages > gpt.n_layer + 2:
            raise PlanError(f"--pp {plan.pp} x --virtual-stages {plan.virtual_stages} = "
                            f"{stages} stages, but {config.model!r} has {gpt.n_layer + 2} layers "
                            f"(embedding, {gpt.n_layer} blocks, head); use fewer stages or "
                            "--layers")
    elif kind in ("transformers", "hf-preset"):
        check_transformers_plan(config.model, plan, config.seq_len)
        if plan.sequence_parallel and config.seq_len:
            from meshtrain.strategies.tensor_parallel.gpt import check_sequence
            check_sequence(config.seq_len, plan.tp)
    elif plan.tp > 1:
        raise PlanError(f"--tp {plan.tp}: tensor parallel from the command line shards "
                        f"meshtrain's GPT presets and transformers causal LMs; {config.model!r} "
                        "needs a tp_plan, which the Python API takes (Plan(tp=T, tp_plan={...}))")


def check_gpt_experts(gpt, plan: Plan) -> None:
    """The Trainer's refusals of a GPT's experts under this plan (ep not dividing them,
    pipeline stages, sequence parallel...), on the GPT built on the meta device."""
    import torch

    from meshtrain.models import moe
    from meshtrain.models.gpt import GPT
    from meshtrain.strategies import expert_parallel

    if not gpt.experts:
        return
    with torch.device("meta"):
        model = GPT(gpt)
    moe.check(model, plan)
    expert_parallel.check(model, plan)


def add_shape_options(p) -> None:
    """A GPT preset's shape overrides (GPTConfig's fields)."""
    p.add_argument("--layers", type=int, help="override the preset's number of layers")
    p.add_argument("--d-model", type=int, help="override the preset's width")
    p.add_argument("--heads", type=int, help="override the preset's attention heads")
    p.add_argument("--experts", type=int, help="a GPT preset's experts per block (0: dense "
                   "MLPs; gpt-moe-tiny has 4): each MLP a mixture of SwiGLU experts")
    p.add_argument("--top-k", type=int, help="with --experts (or gpt-moe-tiny): the experts "
                   "each token is routed to (default 2)")


SHAPE_FLAGS = {"n_layer": "layers", "d_model": "d_model", "n_head": "heads",
               "experts": "experts", "top_k": "top_k"}


def shape_overrides(args, is_gpt: bool) -> dict:
    """GPTConfig's fields the command line overrides (--seq only for a GPT preset: another
    model takes it as its context)."""
    shape = {field: getattr(args, flag) for field, flag in SHAPE_FLAGS.items()}
    shape["seq_len"] = args.seq if is_gpt else None
    return {k: v for k, v in shape.items() if v is not None}


def check_context(config, plan: Plan) -> None:
    """Context parallel's refusals of the model and its sequence length, on the model
    built without memory: attention meshtrain cannot replace, heads all-to-all cannot
    scatter, a sequence that 2 cp chunks do not cut evenly."""
    if plan.cp == 1:
        return
    if config.link:   # gradients travel over dp x cp, an axis the emulated link does not price
        raise PlanError(f"--link with --cp {plan.cp} is not built yet: the gradients then "
                        "travel over dp x cp, which the emulated link does not price; drop "
                        "--link or --cp")
    from meshtrain.models.registry import build_model
    from meshtrain.strategies import context_parallel

    built = build_model(config.model, config.model_overrides, config.seq_len, on_meta=True)
    context_parallel.check(built.module, plan)
    context_parallel.check_sequence(built.seq_len, plan.cp)
    if plan.sequence_parallel:   # tp splits each cp rank's tokens
        from meshtrain.strategies.tensor_parallel.gpt import check_sequence
        check_sequence(built.seq_len // plan.cp, plan.tp)


def check_transformers_plan(spec: str, plan: Plan, seq_len: int | None = None) -> None:
    """The Trainer's own refusals for a transformers causal LM (heads tp does not divide,
    more stages than layers, a sequence past its learned positions...), on the model built
    without memory (meta tensors)."""
    import torch
    from transformers import AutoModelForCausalLM

    from meshtrain.models import hf, moe
    from meshtrain.models.registry import check_positions, transformers_config
    from meshtrain.strategies import pipeline
    from meshtrain.train.slots import check_layer_sharding

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(transformers_config(spec))
    if seq_len:
        check_positions(model, seq_len)
    moe.check(model, plan)   # before tp's styles: the experts are why it is refused
    check_layer_sharding(model, plan, hf.tp_plan_of(model, plan.tp) if plan.tp > 1 else None)
    pipeline.check(model, plan)


def check_init_from(config) -> None:
    """Refuse a folder whose weights do not fit --model (names, shapes, kinds, missing or
    truncated files), reading only its headers, before any rank starts."""
    from meshtrain.models.pretrained import SafetensorsFolder, attach
    from meshtrain.models.registry import build_model

    built = build_model(config.model, config.model_overrides, config.seq_len, on_meta=True)
    attach(built.module, SafetensorsFolder(config.init_from))


RESUME_TAKES = {"resume", "steps", "nproc", "device", "no_progress", "tensorboard",
                "check_collectives", "collective_timeout", "max_restarts"}
"""What `--resume` reads from the command line; everything else is the run's own."""


def ignored_on_resume(args, defaults: dict) -> str | None:
    """A resumed run keeps its own model, data and plan (its config.json): the refusal of
    flags it would silently ignore, so that no one believes a resume changed them."""
    ignored = [f"--{dest.replace('_', '-')}" for dest, value in vars(args).items()
               if dest in defaults and dest not in RESUME_TAKES and value != defaults[dest]]
    if not ignored:
        return None
    return (f"--resume {args.resume} continues the run with its own settings (its "
            f"config.json), so {', '.join(ignored)} would be ignored: drop them (a resume "
            "takes --steps, --nproc, --device, --max-restarts, --collective-timeout and the "
            "output flags), or start a new run")
