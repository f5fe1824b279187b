"""`meshtrain plan`: which parallel plan fits this model on this cluster, and how fast.

    meshtrain plan --model gpt2-1.3b --nodes 2 --gpus-per-node 8 --gpu A100-80GB --inter-bw 25GB/s
    meshtrain plan --layers 48 --hidden 6144 --heads 48 --vocab 51200 --seq 2048 --json
    meshtrain plan --calibrate            # measure this machine, save a profile
    meshtrain plan --cluster local ...    # plan with the measured profile
    meshtrain plan --verify               # run the top supported plans for real, compare
    meshtrain plan --verify --model llama-tiny  # ... on any model `meshtrain train` builds
"""
from __future__ import annotations

import argparse
import sys

from meshtrain.core.gpus import GPUS


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="rank parallel plans for a model on a cluster (memory, step time, MFU)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model (a preset, or a raw description)")
    m.add_argument("--model", help="preset: gpt2-124m, gpt2-350m, gpt2-1.3b, gpt3-175b, "
                   "llama-7b, llama-70b, llama3.1-8b, or a meshtrain GPT preset (tiny, small, "
                   "gpt-moe-tiny); or any "
                   "model `meshtrain train --model` takes (a transformers preset or "
                   "config.json, package.module:function)")
    for flag in ("layers", "hidden", "heads", "vocab"):
        m.add_argument(f"--{flag}", type=int)
    m.add_argument("--seq", type=int, help="sequence length (overrides the preset's)")
    c = p.add_argument_group("cluster")
    c.add_argument("--cluster", choices=["local"], help="'local': the calibrated profile")
    c.add_argument("--profile", help="profile path (default: this device's, or --gpu's, "
                   "~/.cache/meshtrain/profiles/KIND.json)")
    c.add_argument("--nodes", type=int, default=1)
    c.add_argument("--gpus-per-node", type=int, default=8)
    c.add_argument("--gpu", help=f"{', '.join(GPUS)} (with its calibrated profile where "
                   "one exists, else the published figures)")
    c.add_argument("--gpu-mem", help="device memory, e.g. 80GB")
    c.add_argument("--intra-bw", help="per-GPU link inside a node, e.g. 600GB/s or nvlink3")
    c.add_argument("--inter-bw", help="per-GPU link across nodes, e.g. 25GB/s, 200Gb/s, ib-hdr")
    c.add_argument("--peak-flops", help="peak FLOP/s per device, e.g. 312TFLOPS")
    c.add_argument("--efficiency", type=float, help="achievable fraction of peak (default 0.5)")
    c.add_argument("--host-mem", help="host memory per node for offload, e.g. 1TB")
    t = p.add_argument_group("training")
    t.add_argument("--global-batch", type=int, default=64, help="sequences per step")
    t.add_argument("--micro-batch", type=int, default=0, help="sequences per micro-batch "
                   "(default: the planner chooses)")
    t.add_argument("--precision", default="bf16", help="bf16 (mixed), fp8 (bf16 with the "
                   "block linears in float8, at the card's float8 peak) or fp32")
    t.add_argument("--optimizer", default="adam", help="adam or sgd")
    t.add_argument("--recompute", default="auto", help="auto, none, selective, attention or full")
    t.add_argument("--no-sequence-parallel", action="store_true")
    t.add_argument("--expert-imbalance", type=float, default=1.0, help="a mixture of experts: "
                   "the busiest expert-parallel rank's routed tokens over the mean (1: even)")
    o = p.add_argument_group("output and actions")
    o.add_argument("--top", type=int, default=10, help="plans to show")
    o.add_argument("--json", action="store_true", help="print the result as JSON")
    o.add_argument("--calibrate", action="store_true", help="measure this machine's compute "
                   "and collective bandwidths on local ranks; save a profile")
    o.add_argument("--verify", action="store_true", help="run the top plans the Trainer "
                   "supports on local ranks; compare predicted and measured (on --model, any "
                   "model `meshtrain train` builds, or a --layers ... description, where given)")
    o.add_argument("--rank", action="store_true", help="with --verify: run the planner's "
                   "top plans and a sample of the rest at --nproc ranks; report the rank "
                   "correlation of predicted and measured step times")
    o.add_argument("--rounds", type=int, help="with --calibrate or --verify: how many times "
                   "each run is repeated, interleaved with the others (default 3; 5 calibrating "
                   "CPU ranks): fewer are quicker, more ride out a noisy machine")
    o.add_argument("--nproc", type=int, default=4, help="largest number of local ranks "
                   "--calibrate measures (it measures 1, 2 and this; --verify needs 4)")
    p.set_defaults(run=run)


def _fail(message: str) -> int:
    print(f"meshtrain plan: error: {message}", file=sys.stderr)
    return 2


def check_counts(args) -> None:
    """The whole-number options, each at least its least sensible value."""
    for flag, value, least in (("--top", args.top, 1), ("--nproc", args.nproc, 1),
                               ("--micro-batch", args.micro_batch, 0), ("--seq", args.seq, 1),
                               ("--gpus-per-node", args.gpus_per_node, 1),
                               ("--rounds", args.rounds, 1)):
        if value is not None and value < least:
            raise ValueError(f"{flag} {value}: must be a whole number >= {least}")


def verified_model(args):
    """The model `--verify` trains: --model's meshtrain GPT preset (GPTConfig's fields, with
    --seq) or any other model `meshtrain train --model` builds (a TrainedModel), or a
    --layers --hidden --heads --vocab --seq description; None without either (verify's own
    GPT for the device). Checked here, before any rank starts."""
    from meshtrain.core.gpt_shapes import GPT_SHAPES
    from meshtrain.models.gpt import GPTConfig
    from meshtrain.planner.model_spec import PRESETS

    raw = {f: getattr(args, f) for f in ("layers", "hidden", "heads", "vocab")}
    given = [f"--{f}" for f, v in raw.items() if v is not None]
    if args.model and given:
        raise ValueError("give either --model or --layers/--hidden/--heads/--vocab, not both")
    if args.model and args.model.lower() in PRESETS and args.model.lower() not in GPT_SHAPES:
        raise ValueError(f"--verify trains the model it checks, and {args.model!r} is a shape "
                         "the planner describes but does not build: give a model `meshtrain "
                         f"train --model` builds ({', '.join(GPT_SHAPES)}, a transformers "
                         "preset or config.json, a callable) or --layers --hidden --heads "
                         "--vocab --seq")
    if args.model and args.model.lower() not in GPT_SHAPES:
        from meshtrain.core.processes import start_forkserver
        from meshtrain.measure.trained_model import TrainedModel
        from meshtrain.models.hf_presets import names_transformers
        from meshtrain.models.registry import check_model_spec

        check_model_spec(args.model, {})   # names what it cannot build, before any rank
        # its ranks start with transformers imported, as `meshtrain train`'s do: what they
        # grow resident is the training's, not the imports' (~30 MB)
        if names_transformers(args.model):
            start_forkserver(transformers=True)
        return TrainedModel(args.model, args.seq)
    if args.model:
        shape = GPT_SHAPES[args.model.lower()]
        model = dict(shape, seq_len=args.seq or shape["seq_len"])
    elif given:
        missing = [f"--{f}" for f, v in {**raw, "seq": args.seq}.items() if v is None]
        if missing:
            raise ValueError(f"--verify on a described model needs {' '.join(missing)} too")
        model = dict(vocab_size=raw["vocab"], seq_len=args.seq, n_layer=raw["layers"],
                     n_head=raw["heads"], d_model=raw["hidden"])
    elif args.seq is not None:
        raise ValueError("--seq with --verify resizes --model's GPT: give --model too")
    else:
        return None
    GPTConfig(**model)   # its own checks (heads dividing the width, ...), before any rank
    return model


def build_inputs(args):
    """(ModelSpec, Setup, Cluster) from the parsed arguments; raises ValueError subclasses."""
    from meshtrain.planner import hardware, model_spec
    from meshtrain.planner.setup import Setup

    raw = [getattr(args, f) for f in ("layers", "hidden", "heads", "vocab")]
    if args.model and any(v is not None for v in raw):
        raise ValueError("give either --model or --layers/--hidden/--heads/--vocab, not both")
    if args.model:
        try:
            spec = model_spec.preset(args.model, seq=args.seq)
        except model_spec.ModelSpecError:   # a model `train` builds: torch, only for those
            from meshtrain.measure.trained_model import model_of
            print(f"reading {args.model}: built on the meta device, a transformers model also "
                  "run once on fake tensors (seconds)", file=sys.stderr)
            spec = model_of(args.model, args.seq)
    elif all(v is not None for v in raw) and args.seq:
        spec = model_spec.from_description(*raw, seq=args.seq)
    else:
        raise ValueError("no model: give --model PRESET (e.g. gpt2-1.3b) or all of --layers "
                         "--hidden --heads --vocab --seq")
    recompute = "" if args.recompute == "auto" else args.recompute
    setup = Setup(global_batch=args.global_batch, micro_batch=args.micro_batch,
                  precision=args.precision, optimizer=args.optimizer, recompute=recompute,
                  sequence_parallel=not args.no_sequence_parallel,
                  expert_imbalance=args.expert_imbalance)
    extra = {"efficiency": args.efficiency} if args.efficiency is not None else {}
    if args.host_mem:
        from meshtrain.core.units import parse_bytes
        extra["host_mem"] = parse_bytes(args.host_mem)
    if args.cluster == "local":
        from meshtrain.measure.probe import local_kind
        from meshtrain.planner.profile import load_profile_cluster
        cluster = load_profile_cluster(args.profile, nodes=args.nodes,
                                       kind=None if args.profile else local_kind(), **extra)
    else:
        cluster = hardware.make_cluster(args.gpu, args.nodes, args.gpus_per_node, args.gpu_mem,
                                        args.intra_bw, args.inter_bw, args.peak_flops,
                                        precision=setup.precision, **extra)
        if args.gpu:
            cluster = with_calibration(cluster, spec, setup, args)
    return spec, setup, cluster


def with_calibration(cluster, spec, setup, args):
    """The named GPU's cluster with its kind's calibrated profile, where there is one
    (--profile, else profiles/KIND.json); unchanged without."""
    from meshtrain.planner.calibrated import calibrated_cluster
    from meshtrain.planner.profile import kind_path, load_profile

    path = args.profile or kind_path(cluster.name)
    if not args.profile and not path.exists():
        return cluster
    given = tuple(k for k in ("efficiency", "intra_bw") if getattr(args, k) is not None)
    return calibrated_cluster(cluster, load_profile(path), spec, setup.precision, str(path),
                              given)


def run(args) -> int:
    from meshtrain.core.plan import PlanError
    from meshtrain.planner.advisor import advise, require_fit

    try:
        check_counts(args)
        if args.calibrate:
            from meshtrain.measure.calibrate import calibrate_command
            return calibrate_command(args, args.rounds)
        if args.rounds is not None and not (args.verify or args.calibrate):
            raise ValueError("--rounds repeats --calibrate's or --verify's runs: add either")
        if args.rank and not args.verify:
            raise ValueError("--rank ranks plans by running them: add --verify")
        if args.verify and args.rank:
            from meshtrain.measure.ranking import rank_command
            return rank_command(args, verified_model(args))
        if args.verify:
            from meshtrain.measure.verify_cli import verify_command
            return verify_command(args, verified_model(args))
        spec, setup, cluster = build_inputs(args)
        advice = advise(spec, setup, cluster)
        require_fit(advice)
    except (ValueError, PlanError, OSError) as exc:
        return _fail(str(exc))
    from meshtrain.planner import report
    if args.json:
        print(report.to_json(advice, args.top))
    else:
        print(report.table(advice, args.top))
        print()
        print(report.words(advice))
        print()
        print(train_command(advice, args.model))
    return 0


def train_command(advice, model: str | None) -> str:
    """The command that trains with the fastest plan: `meshtrain train` on one node, each
    node's torchrun across several."""
    from meshtrain.cli.plan_options import FLAGLESS, plan_flags
    from meshtrain.models.gpt import GPT_SHAPES
    from meshtrain.planner.model_spec import PRESETS

    best = advice.ranked[0].cand
    flags = plan_flags(best.full_plan())
    if flags is None:
        return (f"The fastest plan sets one of {', '.join(FLAGLESS)}, which only "
                "Plan(...) in Python takes.")
    builds = model and not (model.lower() in PRESETS and model.lower() not in GPT_SHAPES)
    flags = ["--model", model if builds else "YOUR_MODEL", "--batch",
             str(advice.setup.global_batch), "--seq", str(advice.spec.seq), *flags]
    cluster = advice.cluster
    if cluster.nodes == 1:
        line = "meshtrain train " + " ".join(flags)
    else:   # --nproc is each node's torchrun's to set
        at = flags.index("--nproc")
        line = (f"torchrun --nnodes {cluster.nodes} --node-rank K --nproc-per-node "
                f"{cluster.gpus_per_node} --rdzv-backend c10d --rdzv-endpoint HOST:29500 "
                "-m meshtrain train " + " ".join(flags[:at] + flags[at + 2:]))
    note = ("" if builds else f" ({model or 'the described model'} is a shape the planner "
            "prices; give your model's folder or config.json as --model)")
    return f"To train with the fastest plan{note}:\n  {line}"
