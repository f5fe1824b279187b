"""Each strategy folder stands alone (ARCHITECTURE.md, "Layers"): a module under
meshtrain/strategies/<folder>/ imports no sibling strategy folder and nothing above the
strategies (train, cli, bench, planner). What two strategies both need lives in
strategies/shared/ (which imports no strategy folder at all); the slot protocols live in the
top-level strategies/slots.py, which every folder may import. Imports are read from the
source (absolute and relative, inside functions and TYPE_CHECKING blocks too), so an import
that never runs still counts.
"""
import ast
import pathlib

import meshtrain

ABOVE = ("meshtrain.train", "meshtrain.cli", "meshtrain.bench", "meshtrain.planner")
STRATEGIES = "meshtrain.strategies"
FOLDERS = {p.parent.name for p in
           (pathlib.Path(meshtrain.__file__).parent / "strategies").glob("*/__init__.py")}


def imported_modules(source: str, module: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every module `source` (the module `module`) imports; for
    `from X import a`, both X and X.a (a may be a submodule)."""
    package = module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:   # relative: up `level - 1` packages from this module's package
                parts = package.split(".")
                anchor = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def violations(source: str, module: str) -> list[str]:
    """`module:line imports name`, in line order, for each import that breaks the rule."""
    parts = module.split(".")
    folder = parts[2] if len(parts) > 3 else None   # None: a top-level strategies module
    found = []
    for line, name in imported_modules(source, module):
        target = name.split(".")
        above = any(name == a or name.startswith(a + ".") for a in ABOVE)
        other = (len(target) > 2 and name.startswith(STRATEGIES + ".")
                 and target[2] in FOLDERS and target[2] != folder)
        # shared/ is below every folder; every folder may use shared/
        sibling = other and folder is not None and (folder == "shared" or target[2] != "shared")
        if above or sibling:
            found.append((line, f"{module}:{line} imports {name}"))
    return [text for _, text in sorted(set(found))]


def strategy_modules() -> dict[str, str]:
    """Dotted module name -> source, for every module under meshtrain/strategies/."""
    root = pathlib.Path(meshtrain.__file__).parent
    out = {}
    for path in sorted((root / "strategies").rglob("*.py")):
        dotted = ".".join(("meshtrain",) + path.relative_to(root).with_suffix("").parts)
        out[dotted.removesuffix(".__init__")] = path.read_text()
    return out


def test_no_strategy_module_imports_a_sibling_or_a_layer_above():
    modules = strategy_modules()
    folders = {m.split(".")[2] for m in modules if m.count(".") >= 3}
    assert {"data_parallel", "zero", "pipeline", "tensor_parallel", "shared"} <= folders
    found = [v for m, source in modules.items() for v in violations(source, m)]
    assert found == []


def test_the_checker_finds_planted_imports():
    planted = ("from typing import TYPE_CHECKING\n"
               "import torch\n"
               "from meshtrain.core.comm import Comm\n"
               "from meshtrain.strategies.shared.buckets import Bucket\n"
               "from meshtrain.strategies.slots import GradientSync\n"
               "from meshtrain.strategies.zero.flat import FlatLayout\n"
               "from ..data_parallel import ddp\n"
               "from meshtrain.strategies import pipeline\n"
               "if TYPE_CHECKING:\n"
               "    from meshtrain.train.state import StateLayout\n"
               "def later():\n"
               "    import meshtrain.planner.model\n"
               "    from . import sharded\n")
    module = "meshtrain.strategies.zero.x"
    assert violations(planted, module) == [
        f"{module}:7 imports meshtrain.strategies.data_parallel",
        f"{module}:7 imports meshtrain.strategies.data_parallel.ddp",
        f"{module}:8 imports meshtrain.strategies.pipeline",
        f"{module}:10 imports meshtrain.train.state",
        f"{module}:10 imports meshtrain.train.state.StateLayout",
        f"{module}:12 imports meshtrain.planner.model"]
    # shared/ may import no strategy folder, zero included (its own `from . import` stays)
    module = "meshtrain.strategies.shared.x"
    assert violations(planted, module) == [
        f"{module}:6 imports meshtrain.strategies.zero.flat",
        f"{module}:6 imports meshtrain.strategies.zero.flat.FlatLayout",
        f"{module}:7 imports meshtrain.strategies.data_parallel",
        f"{module}:7 imports meshtrain.strategies.data_parallel.ddp",
        f"{module}:8 imports meshtrain.strategies.pipeline",
        f"{module}:10 imports meshtrain.train.state",
        f"{module}:10 imports meshtrain.train.state.StateLayout",
        f"{module}:12 imports meshtrain.planner.model"]
    # a top-level module (slots.py: the protocols) may name any folder, never a layer above
    module = "meshtrain.strategies.slots"
    assert violations(planted, module) == [
        f"{module}:10 imports meshtrain.train.state",
        f"{module}:10 imports meshtrain.train.state.StateLayout",
        f"{module}:12 imports meshtrain.planner.model"]
