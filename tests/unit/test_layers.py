"""Imports point downward only: every import in meshtrain/ (module-level, function-local, under
TYPE_CHECKING) goes to its own component or to a lower layer, as ARCHITECTURE.md's import-rule
table says. The table is read from the document, so the document and this test cannot drift."""
import ast
import functools
import pathlib
import re
from dataclasses import dataclass

import meshtrain

PACKAGE = pathlib.Path(meshtrain.__file__).parent
ARCHITECTURE = PACKAGE.parent / "ARCHITECTURE.md"

# Upward or sideways imports allowed for now, as (importer, imported) module pairs: none. An
# entry added here must be removed once its import is gone (test_known_violations_still_hold).
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    importer: str
    imported: str
    rule: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} imports {self.imported}: {self.rule}"


def read_layers(text: str) -> dict[str, int]:
    """Component -> layer, from the `| layer | components |` rows under "The import rule"."""
    section = text.split("### The import rule", 1)[1].split("\n#", 1)[0]
    layers = {}
    for number, cell in re.findall(r"^\| (\d+) \| (.+) \|$", section, re.MULTILINE):
        for name in re.findall(r"`([^`]+)`", cell):
            layers[name] = int(number)
    return layers


def component_of(module: str, layers: dict[str, int]) -> str | None:
    """The longest component in `layers` that prefixes `module` (a dotted name under meshtrain)."""
    parts = module.split(".")[1:] or ["__init__"]   # the package root itself is `__init__`
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in layers:
            return ".".join(parts[:n])
    return None


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path, root: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every meshtrain import in the file, wherever it sits; `from a import b`
    names a.b when b is a module of the package, else a."""
    here = module_name(path, root).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                as_path = root.parent.joinpath(*sub.split("."))
                is_module = as_path.with_suffix(".py").exists() or as_path.is_dir()
                found.append((node.lineno, sub if is_module else base))
    return sorted({(line, m) for line, m in found
                   if m == root.name or m.startswith(root.name + ".")})


def check(root: pathlib.Path, layers: dict[str, int]) -> list[Violation]:
    """Every import in the package under `root` that breaks the rule."""
    found = []
    for path in sorted(root.rglob("*.py")):
        importer = module_name(path, root)
        mine = component_of(importer, layers)
        where = str(path.relative_to(root.parent))
        if mine is None:
            found.append(Violation(where, 1, importer, "-", "its component is in no layer of "
                                   "ARCHITECTURE.md's import-rule table: add it there"))
            continue
        for line, imported in imports_of(path, root):
            theirs = component_of(imported, layers)
            if theirs == mine or (theirs is not None and layers[theirs] < layers[mine]):
                continue
            rule = (f"{imported} is in no layer" if theirs is None else
                    f"layer {layers[mine]} ({mine}) may import only its own component and "
                    f"lower layers, not layer {layers[theirs]} ({theirs})")
            found.append(Violation(where, line, importer, imported, rule))
    return found


@functools.cache
def package_violations() -> tuple[Violation, ...]:
    return tuple(check(PACKAGE, read_layers(ARCHITECTURE.read_text())))


def test_imports_point_downward():
    new = [v for v in package_violations()
           if (v.importer, v.imported) not in KNOWN_VIOLATIONS]
    assert not new, "imports against ARCHITECTURE.md's import rule:\n" + "\n".join(map(str, new))


def test_known_violations_still_hold():
    found = {(v.importer, v.imported) for v in package_violations()}
    stale = KNOWN_VIOLATIONS - found
    assert not stale, f"fixed, so remove from KNOWN_VIOLATIONS: {sorted(stale)}"


def test_table_names_the_layers_the_rule_needs():
    layers = read_layers(ARCHITECTURE.read_text())
    assert layers["core"] == 0 and layers["cli"] == layers["__init__"] == 8
    assert [n for n, k in layers.items() if k == layers["planner"]] == \
        ["models", "data", "launch", "testing", "planner"]   # planner: core only
    assert layers["strategies"] < layers["strategies.zero"] < layers["train"] < \
        layers["bench"] < layers["measure"] < layers["cli"]


def test_checker_catches_a_planted_upward_import(tmp_path):
    root = tmp_path / "meshtrain"
    for package in ("core", "train", "planner", "models"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "train" / "trainer.py").write_text("from meshtrain.core import comm\n")
    (root / "core" / "comm.py").write_text("import os\n")
    (root / "models" / "gpt.py").write_text("")
    (root / "core" / "bad.py").write_text(
        "import os\n\n\ndef late():\n    from meshtrain.train import trainer\n")
    (root / "planner" / "side.py").write_text("from ..models.gpt import x\n")
    layers = {"core": 0, "models": 1, "planner": 1, "train": 2, "__init__": 3}
    found = check(root, layers)
    assert [str(v) for v in found] == [
        "meshtrain/core/bad.py:5: meshtrain.core.bad imports meshtrain.train.trainer: layer 0 "
        "(core) may import only its own component and lower layers, not layer 2 (train)",
        "meshtrain/planner/side.py:1: meshtrain.planner.side imports meshtrain.models.gpt: "
        "layer 1 (planner) may import only its own component and lower layers, not layer 1 "
        "(models)"]
    del layers["planner"]
    assert any(v.importer == "meshtrain.planner.side" and "in no layer" in v.rule
               for v in check(root, layers))
