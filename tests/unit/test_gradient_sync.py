"""The GradientSync protocol (strategies/slots.py) states its optional steps: every
implementation subclasses it, inherits `settle`, `idle`, `close` and `step_driver` unless it
needs its own, and no caller looks them up by getattr."""
import ast
import pathlib
import pytest

import meshtrain
from meshtrain.strategies.data_parallel.ddp import DDP
from meshtrain.strategies.data_parallel.diloco import DiLoCo
from meshtrain.strategies.data_parallel.master_dp import MasterDP
from meshtrain.strategies.data_parallel.parameter_server import ParameterServer
from meshtrain.strategies.data_parallel.ps_async import AsyncParameterServer
from meshtrain.strategies import slots
from meshtrain.strategies.slots import GradientSync
from meshtrain.strategies.zero.sharded import ZeRO
from meshtrain.strategies.zero.zero3 import ZeRO3

OPTIONAL = ("settle", "idle", "close", "step_driver")


def _with(skip: str = ""):
    """A GradientSync defining every required method but `skip`, and no optional one."""
    required = {name: (lambda self, *a, **k: None)
                for name in GradientSync.__abstractmethods__ if name != skip}
    return type("Sync", (GradientSync,), required)


def test_optional_steps_have_defaults_and_required_ones_are_named():
    overrides = {cls: {name for name in OPTIONAL if name in vars(cls)}
                 for cls in (DDP, ZeRO, ZeRO3, MasterDP, ParameterServer, AsyncParameterServer,
                             DiLoCo)}
    assert all(issubclass(cls, GradientSync) for cls in overrides)
    # who needs its own: offload's files (ZeRO), messages in flight (ps-async), threads (DP)
    assert overrides == {DDP: set(), ZeRO: {"close"}, ZeRO3: set(),
                         MasterDP: {"step_driver"}, ParameterServer: set(),
                         AsyncParameterServer: {"settle", "idle"}, DiLoCo: set()}
    sync = _with()()
    assert sync.settle() is None and sync.close() is None
    assert sync.step_driver(lambda o, t: o, 1, None) is None
    slept = []
    with pytest.MonkeyPatch.context() as patch:   # the default delay is a sleep
        patch.setattr(slots.time, "sleep", slept.append)
        sync.idle(0.01)
    assert slept == [0.01]
    with pytest.raises(TypeError, match="abstract method.*step"):
        _with(skip="step")()


def test_no_caller_looks_the_optional_steps_up():
    root = pathlib.Path(meshtrain.__file__).parent
    found = [f"{path.relative_to(root)}:{node.lineno}"
             for path in root.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
             and isinstance(node.args[1], ast.Constant) and node.args[1].value in OPTIONAL]
    assert found == []
