"""`meshtrain` command: one sub-command per module, each exposing `add_parser` and `run`."""
from __future__ import annotations

import argparse
import atexit
import importlib
import os
import sys
import threading

# name -> module under meshtrain.cli; each module defines add_parser(subparsers) and run(args)
COMMANDS = {
    "train": "train_cmd",
    "plan": "plan_cmd",
    "bench": "bench_cmd",
    "report": "report_cmd",
    "generate": "generate_cmd",
    "export": "export_cmd",
    "schedule": "schedule_cmd",
    "prepare": "prepare_cmd",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshtrain",
        description="Train PyTorch models across many devices with every classic "
                    "parallelism strategy, and plan which one fits.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module in COMMANDS.items():
        try:
            mod = importlib.import_module(f"meshtrain.cli.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"meshtrain.cli.{module}":
                raise
            continue  # that command is not built yet
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from meshtrain.core.device import prefer_expandable_segments   # every command needs torch
    prefer_expandable_segments()   # before any CUDA allocation of this process or its ranks
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("meshtrain: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into e.g. `head`, which stopped reading
        sys.stdout = open(os.devnull, "w")
        return 0


def command() -> None:
    """The `meshtrain` command (and `python -m meshtrain`): `main()`, then the exit. What a
    normal exit runs is run here (other threads finish, atexit handlers such as
    multiprocessing's cleanup, the streams flushed), then the process ends without the
    interpreter's teardown of every module and torch's static objects: 0.4 s of a command's
    end on an idle machine, several seconds on a loaded one, and nothing left to save."""
    code = main()
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()   # CPython's own: the handlers sys.exit would run, in order
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # a closed pipe: nothing more can be written
            pass
    os._exit(code)


if __name__ == "__main__":
    command()
