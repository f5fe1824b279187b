"""`meshtrain train`: train a model on local ranks (or under torchrun), then summarise.

Local:    meshtrain train --nproc 2
torchrun: torchrun --nproc-per-node 2 -m meshtrain train        (one node)
          torchrun --nnodes 2 --node-rank K --nproc-per-node 1 \\
                   --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m meshtrain train
Under torchrun (RANK and WORLD_SIZE set) every rank runs the job itself and --nproc is ignored.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

from meshtrain.cli.summary import (after_failure, failure_cause, fall_back, print_report,
                                   print_summary)
from meshtrain.cli.plan_options import add_plan_options, plan_from_args
from meshtrain.cli.train_checks import (add_shape_options, check_batch_split, check_init_from,
                                        check_model_plan, ignored_on_resume, shape_overrides)
from meshtrain.cli.train_data import check_resumed_data, settle_data
from meshtrain.core.plan import Plan, PlanError
from meshtrain.train.config import DEFAULT_LR, OPTIMIZERS, latest_checkpoint


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model (default: tiny GPT, DDP over 2 "
                                     "CPU ranks, or a rank per GPU)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, help="local ranks to start (default: one per GPU on "
                                           "CUDA, 2 on CPU; with --resume, the run's own, or "
                                           "a new count: DDP over them)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"],
                   help="where the ranks run (default: $MESHTRAIN_DEVICE, else auto: CUDA "
                        "when a GPU is visible, one rank per GPU, else the CPU; with "
                        "--resume, the run's own)")
    _add_run_options(p)
    add_plan_options(p.add_argument_group("plan (default: DDP over all ranks)"))
    p.add_argument("--link", metavar="AXIS=BW[,LAT]",
                   help="emulate a slow link: sleep each collective's modelled time on that "
                        "axis, e.g. dp=1Gb/s,5ms (several joined by ';'); labelled as emulation")
    p.add_argument("--straggler", metavar="RANK:SECONDS",
                   help="delay this rank by SECONDS every step (to measure asynchrony)")
    p.set_defaults(run=run)
    p.set_defaults(defaults=vars(p.parse_args([])))   # what was not given, for --resume


TRAIN_RANK = ("meshtrain.train.run", "train_rank")   # the function every rank runs


def _add_run_options(p) -> None:
    """The model, the data, the schedule of steps and the run folder."""
    p.add_argument("--init-from", metavar="FOLDER",
                   help="start from the weights of a transformers model folder (config.json "
                        "and model.safetensors, or shards with their index, as save_pretrained "
                        "or meshtrain export write): each rank reads only the slices it keeps; "
                        "--model defaults to the folder's config.json")
    p.add_argument("--model", default=None,
                   help="a GPT preset (tiny, small, gpt2-124m, ...), your own model as "
                        "package.module:function (returns an nn.Module reading token ids), or "
                        "a transformers causal-LM config.json (random weights; needs .[hf]), "
                        "or a tiny transformers preset (llama-tiny, llama-tiny-tied, qwen2-tiny, "
                        "mistral-tiny, hf-gpt2-tiny, mixtral-tiny...); gpt-moe-tiny: the GPT "
                        "with 4 experts, top-2")
    p.add_argument("--loss", default="auto", choices=["auto", "cross-entropy"],
                   help="auto: the model's own .loss(logits, targets), else cross-entropy "
                        "over every token")
    add_shape_options(p)
    p.add_argument("--seq", type=int, help="sequence length (a GPT preset's override; for "
                                           "another model, default its config's context, at "
                                           "most 2048, else 128)")
    p.add_argument("--data", help="token shards (a folder `meshtrain prepare` made, .bin "
                                   "files, a glob; several blended as PATH@WEIGHT,...), or a "
                                   "text file or folder, read as bytes or with --tokenizer "
                                   "(default: this Python's standard library source, as bytes)")
    p.add_argument("--tokenizer", help="the model's tokenizer (tokenizer.json or a tokenizer "
                                        "folder): --data text is tokenised with it once, "
                                        "checked against a dataset's, kept in the run folder")
    p.add_argument("--steps", type=int, help="optimizer steps (default 250; with --resume, "
                                           "the run's own or a new total)")
    p.add_argument("--batch", type=int, default=32, help="global batch in sequences")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="adamw (weight decay 0.1) or sgd (with --momentum, no weight decay)")
    p.add_argument("--lr", type=float,
                   help=f"peak learning rate (default {DEFAULT_LR['adamw']:g} for adamw, "
                        f"{DEFAULT_LR['sgd']:g} for sgd)")
    p.add_argument("--momentum", type=float, default=0.9, help="sgd: momentum (0.9)")
    p.add_argument("--warmup", type=int, help="steps of linear lr warmup (default 30, at most "
                                              "a quarter of --steps: a short run reaches its lr)")
    p.add_argument("--seed", type=int, default=0, help="the model's and the batches' seed")
    p.add_argument("--max-grad-norm", type=float,
                   help="clip gradients to this global norm (default: no clipping)")
    p.add_argument("--eval-every", type=int, default=100, help="steps between val losses")
    p.add_argument("--ckpt-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--run-dir", help="run folder (default runs/<date-time>)")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its latest checkpoint "
                        "(--steps may raise its step count)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="when a rank dies, restart the group up to K times; each restart "
                        "resumes from the latest complete checkpoint (under torchrun, use "
                        "torchrun's own --max-restarts)")
    p.add_argument("--collective-timeout", type=float, metavar="SECONDS",
                   help="a collective that waits longer fails, naming the rank behind, "
                        "diverged or gone and the call (default 300)")
    p.add_argument("--check-collectives", action="store_true",
                   help="after the first step, compare every rank's collective calls (op, "
                        "axis, shape, dtype) and stop at the first difference")
    p.add_argument("--trace", action="store_true",
                   help="pipeline (--pp > 1): save the last step's measured timeline in the "
                        "run folder: trace.json, trace.chrome.json (Perfetto) and trace.png "
                        "(measured beside theory, with both bubble fractions)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--tensorboard", action="store_true",
                   help="also write TensorBoard event files into RUN_DIR/tensorboard "
                        "(needs pip install -e \".[tb]\")")


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def build_config(args):
    from meshtrain.core.admit import check_plan
    from meshtrain.core.device import check_ranks_fit, default_ranks, resolve_device
    from meshtrain.train.config import RunConfig

    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"--nproc {args.nproc}: give the number of local ranks, 1 or more")
    if args.resume:
        config = RunConfig.load(args.resume)
        config.device = resolve_device(args.device or config.device)
        config.resume, config.progress = True, not args.no_progress
        config.tensorboard = config.tensorboard or args.tensorboard
        config.check_collectives = args.check_collectives
        if args.collective_timeout is not None:
            config.collective_timeout = args.collective_timeout
        config.steps = config.steps if args.steps is None else args.steps
        world = int(os.environ["WORLD_SIZE"]) if _under_torchrun() else args.nproc
        old = Plan.from_dict(config.plan)
        if world and world != old.world_size and old.dp_mode != "dp":
            # checkpoints load under any plan: keep the run's own, with dp over the new world
            _check_local_steps_resume(config, old, world)
            if world % (fixed := old.pp * old.cp * old.tp):
                raise PlanError(f"the run's plan has pp*cp*tp = {fixed}, which does not "
                                f"divide --nproc {world}; resume on a multiple of it")
            config.plan = dataclasses.replace(old, dp=world // fixed).to_dict()
        plan = Plan.from_dict(config.plan)
        check_plan(plan, world_size=world or plan.world_size)
        if not _under_torchrun():   # under torchrun, each rank checks its LOCAL_RANK
            check_ranks_fit(config.device, plan.world_size)
        return config
    device = resolve_device(args.device)
    one_process = args.dp_mode == "dp"   # DP's replicas are threads of one process
    default_world = args.pp * args.tp if one_process else default_ranks(device)
    world = int(os.environ["WORLD_SIZE"]) if _under_torchrun() else (args.nproc or default_world)
    plan = plan_from_args(args, world)
    if not _under_torchrun():   # one GPU per rank: refused here, before any rank starts
        check_ranks_fit(device, plan.world_size)
    check_plan(plan, world_size=world)   # before any rank starts
    straggler = parse_straggler(args.straggler, world) if args.straggler else None
    if args.link:   # a bad spec is refused here, before any rank starts
        from meshtrain.core.link import LinkSpecError, parse_link_spec
        try:
            parse_link_spec(args.link)
        except LinkSpecError as e:
            raise PlanError(str(e)) from None
    if args.trace and plan.pp == 1:
        raise PlanError("--trace records a pipeline's timeline: it needs --pp 2 or more")
    from meshtrain.models.registry import kind_of
    _default_model(args)
    is_gpt = kind_of(args.model) == "gpt"
    overrides = shape_overrides(args, is_gpt)
    run_dir = args.run_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    check_new_run_dir(run_dir)
    return RunConfig(run_dir=run_dir, plan=plan.to_dict(), model=args.model, device=device,
                     model_overrides=overrides, seq_len=None if is_gpt else args.seq,
                     loss=args.loss, data=args.data, tokenizer=args.tokenizer,
                     init_from=args.init_from,
                     steps=250 if args.steps is None else args.steps,
                     batch_size=args.batch, optimizer=args.optimizer,
                     lr=DEFAULT_LR[args.optimizer] if args.lr is None else args.lr,
                     momentum=args.momentum, warmup=args.warmup, seed=args.seed,
                     eval_every=args.eval_every, ckpt_every=args.ckpt_every,
                     progress=not args.no_progress, tensorboard=args.tensorboard,
                     collective_timeout=300.0 if args.collective_timeout is None
                     else args.collective_timeout,
                     check_collectives=args.check_collectives,
                     straggler=straggler, trace=args.trace, link=args.link)


def _check_local_steps_resume(config, old: Plan, world: int) -> None:
    """A DiLoCo / local-SGD checkpoint holds each worker's parameters and inner state: it
    resumes on the dp it was saved with, refused here rather than on every rank."""
    if old.dp_mode in ("diloco", "local-sgd") and latest_checkpoint(config.run_dir):
        raise PlanError(f"this {old.dp_mode} run's checkpoint holds {old.dp} workers' own "
                        f"parameters and optimizer states; resume it with --nproc "
                        f"{old.world_size} (its dp={old.dp}), not {world}")


def make_run_dir(run_dir, offload_dir=None) -> None:
    """Create the run folder (and its checkpoints/) and --offload-dir, refusing in one line
    a path that cannot hold it (unwritable, under a file, in a pseudo file system such as
    /proc), here rather than on every rank once it starts."""
    for flag, path, folder in [("--offload-dir", offload_dir, offload_dir),
                               ("--run-dir", run_dir, Path(run_dir, "checkpoints"))]:
        try:
            if folder is not None:
                Path(folder).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"{flag} {path}: cannot create the {flag[2:-4]} folder there "
                             f"({exc.strerror or exc}); give a writable folder") from None


def check_new_run_dir(run_dir) -> None:
    """A new run's folder must not hold another run: its config, metrics and `latest` would
    be overwritten and its checkpoints mixed with the new run's. (A restarted attempt under
    torchrun runs this command again on a folder its first attempt made: left alone.)"""
    from meshtrain.train.faults import attempt

    folder = Path(run_dir)
    held = [n for n in ("config.json", "metrics.jsonl", "checkpoints/latest")
            if (folder / n).exists()]
    if held and attempt() == 0:
        latest = folder / "checkpoints" / "latest"
        last = f", last checkpoint {latest.read_text().strip()[:40]}" if latest.exists() else ""
        raise PlanError(f"--run-dir {run_dir} holds a run already ({held[0]}{last}): continue "
                        f"it with --resume {run_dir}, or give a new --run-dir (or delete "
                        "that folder to start again)")


def parse_straggler(text: str, world: int) -> list:
    """"RANK:SECONDS" -> [rank, seconds], refusing a rank outside the world."""
    try:
        rank, seconds = text.split(":")
        rank, seconds = int(rank), float(seconds)
    except ValueError:
        raise PlanError(f"--straggler {text!r}: expected RANK:SECONDS, e.g. 1:0.05") from None
    if not 0 <= rank < world:
        raise PlanError(f"--straggler {text}: rank {rank} does not exist in a world of {world} "
                        f"rank(s) (0..{world - 1})")
    if seconds < 0:
        raise PlanError(f"--straggler {text}: the delay must be >= 0 seconds")
    return [rank, seconds]


def _default_model(args) -> None:
    """--model left out: the folder's own config with --init-from, else the tiny GPT."""
    folder_config = Path(args.init_from or "", "config.json")
    if args.model is None:   # a folder without one is refused by its own check
        args.model = str(folder_config) if args.init_from and folder_config.is_file() else "tiny"


def run(args) -> int:
    if args.resume and (refused := ignored_on_resume(args, args.defaults)):   # --model unset
        print(f"meshtrain train: {refused}", file=sys.stderr)
        return 2
    _default_model(args)
    if not _under_torchrun():   # the ranks' process imports torch while this one does
        from meshtrain.core.processes import start_forkserver
        from meshtrain.models.hf_presets import names_transformers
        start_forkserver(transformers=names_transformers(args.model))
    from meshtrain.models.registry import check_model_spec
    from meshtrain.train import errors
    from meshtrain.train.config import check_run_config

    try:
        config = build_config(args)
        plan = Plan.from_dict(config.plan)
        check_run_config(config)
        if args.max_restarts < 0:
            raise ValueError(f"--max-restarts {args.max_restarts}: give 0 (no restart) or more")
        if args.max_restarts and _under_torchrun():
            raise ValueError("under torchrun, pass --max-restarts to torchrun itself (the "
                             "ranks resume from the latest checkpoint on their own)")
        check_model_spec(config.model, config.model_overrides)   # here, not on N ranks
        if config.init_from and not config.resume:
            check_init_from(config)
        check_model_plan(config, plan)
        check_batch_split(config, plan)
        tokenizer = settle_data(config)   # bad data refused, a GPT's vocabulary set
        if config.tensorboard:
            from meshtrain.train.tensorboard import require_tensorboard
            require_tensorboard()
        if config.resume:   # refuse a bad checkpoint here, before any rank starts
            ckpt = latest_checkpoint(config.run_dir)
            if ckpt is not None:
                from meshtrain.train import checkpoint
                check_resumed_data(config, checkpoint.inspect(ckpt))
        make_run_dir(config.run_dir, plan.offload_dir if plan.offload == "disk" else None)
        if tokenizer is not None:   # the run's tokenizer, for generate and export
            tokenizer.save(Path(config.run_dir) / "tokenizer")
    except errors.CheckpointError as exc:
        return _refused(exc, config.run_dir)
    except (PlanError, ValueError, FileNotFoundError) as exc:
        print(f"meshtrain train: {exc}", file=sys.stderr)
        return 2
    from meshtrain.core.processes import process_start_time
    config.started_at = process_start_time()
    if _under_torchrun():
        from meshtrain.launch import shutdown_distributed
        from meshtrain.train.run import train_rank
        try:
            summary = train_rank(config)
        except errors.CheckpointError as exc:
            return _refused(exc, config.run_dir)
        if int(os.environ["RANK"]) == 0:
            print_summary(summary)
            print_report(config.run_dir)
        shutdown_distributed(exit_code=0)   # see docs/history.md on gloo's abort at exit
    print(f"meshtrain train: {plan.describe()} on {plan.world_size} local rank(s) "
          f"({config.device}), run folder {config.run_dir}", file=sys.stderr)
    return _launch_ranks(config, plan, args.max_restarts)


def _launch_ranks(config, plan: Plan, max_restarts: int) -> int:
    """The run on local ranks, then its summary; a failure or an interrupt in a few lines."""
    from meshtrain.launch import Interrupted, LaunchError, launch

    try:
        # by name: this process need not import the training stack the ranks run
        summary = launch(TRAIN_RANK, nproc=plan.world_size, args=(config,),
                         max_restarts=max_restarts, device=config.device,
                         collective_timeout_s=config.collective_timeout)[0]
    except Interrupted as exc:   # Ctrl-C: the ranks are stopped; an unfinished save never counts
        print(f"meshtrain train: interrupted ({exc.signal_name}); the ranks were stopped. "
              f"{after_failure(config.run_dir, failed=False)}", file=sys.stderr)
        return 128 + signal.Signals[exc.signal_name].value   # the shell's code: 130 for Ctrl-C
    except LaunchError as exc:
        first = exc.first_raised()
        if first and first["type"] in ("CheckpointError", "UnsafeCheckpoint"):
            return _refused(first["message"], config.run_dir)
        print(f"meshtrain train: the run failed: {failure_cause(exc)}.\n"
              f"  {_keep_failure(exc, Path(config.run_dir) / 'failure.log')} "
              f"{after_failure(config.run_dir)}", file=sys.stderr)
        return 1
    print_summary(summary)
    print_report(config.run_dir)
    return 0


def _keep_failure(exc, log: Path) -> str:
    """Every rank's error in full, in the run folder's failure.log; here if it cannot be
    written there (a full or read-only disk)."""
    try:
        log.write_text(str(exc) + "\n")
        return f"Each rank's error in full: {log}."
    except OSError as err:
        print(str(exc), file=sys.stderr)
        return f"Each rank's error in full above ({log} could not be written: {err.strerror})."


def _refused(message, run_dir) -> int:
    """A checkpoint that cannot be loaded: one line, nothing written to the run folder."""
    print(f"meshtrain train: cannot resume {run_dir}: {message}{fall_back(message, run_dir)}",
          file=sys.stderr)
    return 1
