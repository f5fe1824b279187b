"""`meshtrain bench`: meshtrain's strategies against PyTorch's own, side by side, as ratios."""
from __future__ import annotations

import json
import shutil
import sys

from meshtrain.core.plan import Plan


# benchmarks that time something other than a GPT's training step
NO_MODEL = ("collectives", "harness", "startup", "survival")


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark a strategy against PyTorch's own "
                                     "implementation, or meshtrain's own machinery")
    p.add_argument("strategy", choices=["ddp", "zero", "tp", "hybrid", "collectives", "dp",
                                        "pp", "harness", "startup", "survival", "slowlink",
                                        "single", "data", "ep", "recipe"],
                   help="ddp: our DDP vs torch DDP; zero: our DDP, ZeRO-1/2/3 vs torch's "
                        "ZeroRedundancyOptimizer and FSDP2; tp: vs DTensor tensor parallel; "
                        "hybrid: every 8-rank dp x pp x tp plan vs FSDP2 + DTensor TP; "
                        "collectives: all-reduce, reduce-scatter and all-gather algorithms "
                        "from 4 KiB to 64 MiB; dp: the data-parallel family (DP, DDP, "
                        "parameter server sync/async, a straggler, the three all-reduces); "
                        "pp: our GPipe, 1F1B, interleaved and zb-h1 vs "
                        "torch.distributed.pipelining's schedules (world = pp); "
                        "harness: how fast the test harness starts N ranks; "
                        "startup: time to first step of `meshtrain train`; "
                        "survival: kill -9 a rank under every plan, restart, end bit-equal; "
                        "slowlink: DDP vs DiLoCo H=8, 32 and local SGD H=8 over an EMULATED "
                        "slow dp link (--link, on max --world ranks); single: one device, "
                        "plain PyTorch eager and compiled vs meshtrain Plan() eager and "
                        "compiled (--device); data: windows/s the loader delivers per rank "
                        "against what a training step consumes (--data, --world); ep: "
                        "expert parallel vs replicated experts on a transformers MoE preset "
                        "(--model, default mixtral-tiny), the all-to-all against its formula; "
                        "recipe: a Llama-3-shaped model on one device, meshtrain's best plan "
                        "vs the torchtitan recipe from PyTorch's parts (FSDP2, per-layer "
                        "compile, selective checkpointing, AdamW; --size, --seq, --precision)")
    p.add_argument("--microbatches", type=int, nargs="+", default=[4, 8],
                   help="pp: micro-batch counts (4 8)")
    p.add_argument("--world", type=int, nargs="+", default=[2, 4], help="world sizes (2 4)")
    p.add_argument("--model", default=None,
                   help="GPT preset (default small: 4 layers, d_model 256, seq 128; slowlink: "
                        "tiny; single: gpt2-124m on CUDA, tiny on CPU)")
    p.add_argument("--batch", type=int, default=None,
                   help="global batch (16; recipe: 1 sequence)")
    p.add_argument("--seq", type=int, default=None,
                   help="slowlink: sequence length (default: the preset's); recipe: 4096 "
                        "for --size 1b, 128 for tiny")
    p.add_argument("--steps", type=int, default=5, help="timed steps per repetition")
    p.add_argument("--reps", type=int, default=10, help="repetitions, alternating")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=Plan().bucket_mb)
    p.add_argument("--runs", type=int, default=5,
                   help="startup: runs per installation; survival: runs of each kind (5)")
    p.add_argument("--seed", type=int, default=0, help="survival: where the faults land")
    p.add_argument("--against", metavar="MESHTRAIN",
                   help="startup: another installation's meshtrain command, run alternately")
    p.add_argument("--train-args", default="",
                   help="startup: more `meshtrain train` arguments, as one string")
    p.add_argument("--link", default="dp=1Gb/s,5ms", help="slowlink: the emulated dp link")
    p.add_argument("--train-steps", type=int, default=128,
                   help="slowlink: training steps per method (128)")
    p.add_argument("--eval-every", type=int, default=4, metavar="N",
                   help="slowlink: evaluate every N steps (outside the step times; the step "
                        "the common loss is crossed at is interpolated between them) (4)")
    p.add_argument("--sync-warmup-steps", type=int, default=0, metavar="K",
                   help="slowlink: DDP steps before each other method starts (0)")
    p.add_argument("--methods", nargs="+", metavar="NAME",
                   help="slowlink: a subset of the methods, e.g. ddp 'diloco H=8' (all)")
    p.add_argument("--out", default="slowlink_bench",
                   help="slowlink: folder for the runs and slowlink.png")
    p.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"],
                   help="single: where to run (default auto: CUDA when a GPU is visible)")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp8"],
                   help="single, recipe: compute precision (default bf16 on CUDA, fp32 on "
                        "CPU); fp8: recipe only (torchao's float8, emulated on the CPU)")
    p.add_argument("--compile-backend", default="inductor",
                   choices=["inductor", "aot_eager", "none"],
                   help="single, recipe: torch.compile's backend for the compiled contenders "
                        "(recipe: none runs both sides eagerly)")
    p.add_argument("--size", choices=["1b", "tiny"],
                   help="recipe: Llama 3.2 1B's shape (default on CUDA) or a tiny Llama "
                        "(default on CPU)")
    p.add_argument("--data", help="data: the token dataset to read (default: 2**24 random "
                                  "tokens in a temporary shard)")
    p.add_argument("--json", metavar="FILE", help="also write the full result as JSON")
    p.set_defaults(run=run)


def run(args) -> int:
    from meshtrain.bench import ddp, tp

    problem = check_bench_args(args)
    if problem:
        print(f"meshtrain bench: {problem}", file=sys.stderr)
        return 2
    for world in ([] if args.strategy in ("hybrid", "startup", "survival", "single", "recipe")
                  else args.world):
        if world < 2 or (args.strategy not in NO_MODEL and args.batch % world):
            split = ("" if args.strategy in NO_MODEL
                     else f" and divide the global batch {args.batch}")
            print(f"meshtrain bench: world {world} needs to be >= 2{split}", file=sys.stderr)
            return 2
    progress = lambda msg: print(msg, file=sys.stderr)
    ok = True   # False: a benchmark that checks its outcome found it wrong (survival)
    if args.strategy == "data":
        from meshtrain.bench import data
        result = data.run(args.data, args.model, args.batch, max(args.world), args.steps,
                          args.reps, args.warmup, progress)
        print(data.format_report(result))
    elif args.strategy in ("single", "recipe"):
        result, report = run_one_device(args, progress)
        print(report)
    elif args.strategy == "slowlink":
        from meshtrain.bench import slowlink
        result = slowlink.run(args.out, nproc=max(args.world), link=args.link,
                              steps=args.train_steps, batch=args.batch,
                              model=args.model, seq=args.seq,
                              eval_every=args.eval_every,
                              methods=slowlink.pick(args.methods),
                              sync_warmup=args.sync_warmup_steps, progress=progress)
        print(slowlink.format_report(result))
    elif args.strategy in ("harness", "startup", "survival"):
        result, report, ok = run_machinery(args, progress)
        print(report)
    elif args.strategy == "dp":
        from meshtrain.bench import dp
        result = dp.run(worlds=args.world, model_name=args.model, global_batch=args.batch,
                        steps=args.steps, reps=args.reps, warmup=args.warmup,
                        progress=progress)
        print(dp.format_report(result))
    elif args.strategy == "pp":
        from meshtrain.bench import pipeline
        result = pipeline.bench(worlds=args.world, model_name=args.model, batch=args.batch,
                                microbatches=args.microbatches, steps=args.steps,
                                reps=args.reps, warmup=args.warmup, progress=progress)
        print(pipeline.format_bench(result))
    elif args.strategy == "collectives":
        from meshtrain.bench import collectives
        result = collectives.run(worlds=args.world, reps=args.reps, progress=progress)
        print(collectives.format_report(result))
    elif args.strategy == "zero":
        from meshtrain.bench import zero
        result = zero.run(worlds=args.world, model_name=args.model, global_batch=args.batch,
                          steps=args.steps, reps=args.reps, warmup=args.warmup, progress=progress)
        print(zero.format_report(result))
    elif args.strategy == "hybrid":
        from meshtrain.bench import hybrid
        result = hybrid.run(model_name=args.model, global_batch=args.batch, steps=args.steps,
                            reps=args.reps, warmup=args.warmup, progress=progress)
        print(hybrid.format_report(result))
    elif args.strategy == "ep":
        result = _run_ep(args, progress)
    elif args.strategy == "tp":
        result = tp.run(worlds=args.world, model_name=args.model, global_batch=args.batch,
                        steps=args.steps, reps=args.reps, warmup=args.warmup, progress=progress)
        print(tp.format_report(result))
    else:
        result = ddp.run(worlds=args.world, model_name=args.model, global_batch=args.batch,
                         steps=args.steps, reps=args.reps, warmup=args.warmup,
                         bucket_mb=args.bucket_mb, progress=progress)
        print(ddp.format_report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if ok else 1


def _run_ep(args, progress) -> dict:
    """`bench ep`: expert parallel vs replicated experts; prints the report."""
    from meshtrain.bench import ep
    result = ep.run(worlds=args.world, model=args.model, global_batch=args.batch,
                    steps=args.steps, reps=args.reps, warmup=args.warmup, progress=progress)
    print(ep.format_report(result))
    return result


def run_one_device(args, progress) -> tuple[dict, str]:
    """The benchmarks on one device: (result, report)."""
    if args.strategy == "single":
        from meshtrain.bench import single
        result = single.run(args.device, args.model, args.batch, args.precision,
                            args.compile_backend, args.steps, args.reps, args.warmup, progress)
        return result, single.format_report(result)
    from meshtrain.bench import recipe
    result = recipe.run(args.device, args.size, args.batch, args.seq, args.precision,
                        None if args.compile_backend == "none" else args.compile_backend,
                        args.steps, args.reps, args.warmup, progress)
    return result, recipe.format_report(result)


def run_machinery(args, progress) -> tuple[object, str, bool]:
    """The benchmarks of meshtrain's own machinery: (result, report, whether all went well)."""
    if args.strategy == "harness":
        from meshtrain.bench import harness
        result = harness.run(worlds=args.world, reps=args.reps, progress=progress)
        return result, harness.format_report(result), True
    if args.strategy == "startup":
        import shlex

        from meshtrain.bench import startup
        commands = {"this meshtrain": [sys.executable, "-m", "meshtrain"]}
        if args.against:
            commands[args.against] = [args.against]
        result = startup.run(commands, args.runs, shlex.split(args.train_args), progress)
        return result, startup.format_report(result), True
    from dataclasses import asdict

    from meshtrain.bench import survival
    outcomes = survival.run(args.runs, args.seed, progress)
    return ([asdict(o) for o in outcomes], survival.format_report(outcomes),
            all(o.bit_equal for o in outcomes))


def check_bench_args(args) -> str | None:
    """What makes these arguments unusable, in words, or None."""
    from meshtrain.models.gpt import PRESETS

    if args.batch is None:
        args.batch = 1 if args.strategy == "recipe" else 16
    for flag, value, least in (("--reps", args.reps, 1), ("--steps", args.steps, 1),
                               ("--warmup", args.warmup, 0), ("--batch", args.batch, 1)):
        if value < least:
            return f"{flag} {value}: give a whole number >= {least}"
    if any(m < 1 for m in args.microbatches):
        return f"--microbatches {' '.join(map(str, args.microbatches))}: each must be >= 1"
    if not args.bucket_mb > 0:
        return f"--bucket-mb {args.bucket_mb:g}: give a positive size in MiB"
    if args.runs < 1:
        return f"--runs {args.runs}: give a whole number >= 1"
    if args.strategy == "slowlink":
        from meshtrain.core.link import LinkSpecError, parse_link_spec
        from meshtrain.bench.slowlink import pick
        if args.train_steps < 1:
            return f"--train-steps {args.train_steps}: give a whole number >= 1"
        if args.seq is not None and args.seq < 1:
            return f"--seq {args.seq}: give a sequence length >= 1"
        if args.batch < 1 or args.batch % max(args.world):
            return (f"--batch {args.batch}: give a multiple of the {max(args.world)} ranks "
                    "(--world)")
        if not 1 <= args.eval_every <= args.train_steps:
            return (f"--eval-every {args.eval_every}: give a whole number of steps from 1 to "
                    f"--train-steps {args.train_steps}")
        if not 0 <= args.sync_warmup_steps < args.train_steps:
            return (f"--sync-warmup-steps {args.sync_warmup_steps}: give 0 or more DDP steps, "
                    f"fewer than --train-steps {args.train_steps}")
        try:
            pick(args.methods)
        except ValueError as e:
            return str(e)
        try:
            if "dp" not in parse_link_spec(args.link):
                return f"--link {args.link!r}: slowlink slows the dp axis; e.g. 'dp=1Gb/s,5ms'"
        except LinkSpecError as e:
            return str(e)
    if args.strategy == "data" and args.data is not None:
        from meshtrain.data.shards import DataError
        from meshtrain.data.source import load_data
        try:
            load_data(args.data)
        except DataError as e:
            return str(e)
    if args.against and shutil.which(args.against) is None:
        return (f"--against {args.against}: no such command; give the path of another "
                f"installation's meshtrain (e.g. OTHER_VENV/bin/meshtrain)")
    if args.strategy in ("single", "recipe"):
        from meshtrain.core.device import DeviceError, resolve_device
        try:
            args.device = resolve_device(args.device)
        except DeviceError as e:
            return str(e)
    if args.strategy == "recipe":
        return check_recipe_args(args)
    if args.precision == "fp8":
        return "--precision fp8: the recipe bench only (single runs fp32 or bf16)"
    if args.compile_backend == "none" and args.strategy == "single":
        return ("--compile-backend none: single races compiled contenders; give inductor or "
                "aot_eager")
    if args.strategy == "single":
        from meshtrain.bench.single import default_model
        args.model = args.model or default_model(args.device)
    if args.strategy == "ep":
        return check_ep_args(args)
    if args.strategy in ("slowlink", "data"):   # the smallest preset: the default GPT's
        args.model = args.model or "tiny"
    args.model = args.model or "small"
    if args.strategy not in NO_MODEL and args.model not in PRESETS:
        return f"--model {args.model!r}: the benchmarks run a GPT preset ({', '.join(PRESETS)})"
    return None


def check_ep_args(args) -> str | None:
    """bench ep's own refusals (it runs a transformers MoE preset, ep = world)."""
    from meshtrain.models.hf_presets import MOE, config_of
    from meshtrain.models.moe import router_of_config

    args.model = args.model or "mixtral-tiny"
    if args.model not in MOE:
        return f"--model {args.model!r}: bench ep runs a MoE preset ({', '.join(MOE)})"
    experts = router_of_config(config_of(args.model)).experts
    uneven = [w for w in args.world if experts % w]
    if uneven:
        return (f"--world {' '.join(map(str, uneven))}: ep = world must divide "
                f"{args.model}'s {experts} experts")
    return None


def check_recipe_args(args) -> str | None:
    """The recipe bench's own refusals (it runs a transformers Llama, not a GPT preset)."""
    import importlib.util

    if args.model is not None:
        return (f"--model {args.model}: the recipe bench runs a Llama of --size 1b or tiny "
                "(transformers' LlamaConfig), not a GPT preset")
    if args.seq is not None and args.seq < 1:
        return f"--seq {args.seq}: give a sequence length >= 1"
    if importlib.util.find_spec("transformers") is None:
        return ("the recipe bench builds transformers' Llama, which is not installed; "
                "pip install 'meshtrain[hf]'")
    if args.precision == "fp8":   # the Trainer's refusals, before the rank starts
        import torch

        from meshtrain.core.device import device_capability
        from meshtrain.core.plan import PlanError
        from meshtrain.strategies.float8 import check_fp8
        try:
            check_fp8("fp8", args.device == "cpu", args.device,
                      *device_capability(torch.device(args.device)))
        except PlanError as e:
            return f"--precision fp8: {e}"
    return None
