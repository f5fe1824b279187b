"""The planner is pure and its measuring half sits apart (ARCHITECTURE.md, layers).

`meshtrain.planner` imports only `meshtrain.core` and itself, never torch; `meshtrain.measure`
runs ranks and may import anything below it. Neither hides a meshtrain import inside a
function unless startup time needs it, said by a `# lazy:` comment on the line (sizes: test_sizes.py).
"""
import ast
import subprocess
import sys
from pathlib import Path

import meshtrain

ROOT = Path(meshtrain.__file__).parent
PACKAGES = ("planner", "measure")
FORBIDDEN = ("meshtrain.train", "meshtrain.strategies", "meshtrain.launch", "meshtrain.bench",
             "meshtrain.measure", "meshtrain.models", "torch")

# what importing every planner module adds to what `import meshtrain` already loads
# (the package's own __init__ binds `launch`: that is not the planner's doing)
PROBE = """
import importlib, pkgutil, sys
import meshtrain
before = set(sys.modules)
import meshtrain.planner as planner
for info in pkgutil.iter_modules(planner.__path__):
    importlib.import_module("meshtrain.planner." + info.name)
print("\\n".join(sorted(set(sys.modules) - before)))
"""


def _sources(package: str):
    return sorted((ROOT / package).glob("*.py"))


def test_planner_modules_import_no_strategy_runner_or_torch():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True).stdout.split()
    assert "meshtrain.planner.time_model" in out and "meshtrain.planner.profile" in out
    leaked = [m for m in out if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert leaked == []


def _meshtrain_imports(tree: ast.Module):
    """(line, module, inside a function) for every import of a meshtrain module."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and (child.module or "").startswith("meshtrain"):
                found.append((child.lineno, child.module, in_function))
            elif isinstance(child, ast.Import):
                found.extend((child.lineno, a.name, in_function) for a in child.names
                             if a.name.startswith("meshtrain"))
            visit(child, inner)

    visit(tree, False)
    return found


def test_imports_point_down_and_function_local_ones_say_why():
    wrong = []
    for package in PACKAGES:
        for path in _sources(package):
            lines = path.read_text().splitlines()
            for line, module, in_function in _meshtrain_imports(ast.parse("\n".join(lines))):
                where = f"{package}/{path.name}:{line} {module}"
                if in_function and "# lazy:" not in lines[line - 1]:
                    wrong.append(f"{where}: function-local without a `# lazy:` reason")
                if package == "planner" and not module.startswith(("meshtrain.core",
                                                                   "meshtrain.planner")):
                    wrong.append(f"{where}: the planner imports only core and itself")
    assert wrong == []
