"""Ranks that build transformers models start with its modeling stack preloaded: the command
asks its forkserver for it exactly where --model names a transformers model, told before
torch is imported (the forkserver starts first)."""
import subprocess
import sys

import pytest

from meshtrain.cli import train_cmd
from meshtrain.core import processes
from meshtrain.models.hf_presets import PRESETS, names_transformers
from meshtrain.models.registry import kind_of
from tests.unit.test_device import _train_args


@pytest.mark.parametrize("spec", ["tiny", "gpt2-124m", "tests.multirank.own_model:build",
                                  "llama-tiny", "qwen2-tiny", "runs/llama/config.json"])
def test_names_transformers_agrees_with_the_registry(spec):
    assert names_transformers(spec) == (kind_of(spec) in ("hf-preset", "transformers"))


def test_names_transformers_needs_no_torch():
    code = ("import sys; from meshtrain.models.hf_presets import names_transformers; "
            "assert names_transformers('llama-tiny'); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("spec,preload", [("tiny", False), (PRESETS[0], True)])
def test_the_command_asks_for_the_preload_its_model_needs(spec, preload, monkeypatch,
                                                          tmp_path):
    asked = []
    monkeypatch.setattr(processes, "start_forkserver", lambda **kw: asked.append(kw))
    # refused after the forkserver's start, before any check that would build the model
    args = _train_args("--model", spec, "--max-restarts", "-1", "--run-dir", str(tmp_path))
    assert train_cmd.run(args) == 2
    assert asked == [{"transformers": preload}]


SHIELDED = """
import builtins, os, signal
real = builtins.__import__
def hook(name, *args, **kwargs):
    if name in ("torch", "transformers.modeling_utils"):   # the preload's first import
        os.kill(os.getpid(), signal.SIGINT)                # Ctrl-C as it preloads
        raise ImportError("stop here")
    return real(name, *args, **kwargs)
builtins.__import__ = hook
for module in ("meshtrain._preload", "meshtrain._preload_transformers"):
    try:
        __import__(module)
    except ImportError:   # the forkserver skips such a module
        pass
    print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)
"""


def test_ctrl_c_while_preloading_leaves_no_traceback_and_the_handler_back():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SHIELDED], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "KeyboardInterrupt" not in done.stderr, done.stderr
    assert done.stdout.split() == ["True", "True"]


def test_the_resource_tracker_started_for_the_ranks_keeps_its_leak_warnings_quiet():
    """A killed rank's semaphores: released by multiprocessing's resource tracker, which
    otherwise warns of each below the failure's own message."""
    import subprocess

    from meshtrain.core.processes import QUIET_TRACKER, forkserver_context

    forkserver_context()
    assert "-W" + QUIET_TRACKER in subprocess._args_from_interpreter_flags()
