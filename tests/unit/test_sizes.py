"""Small files, short functions: no module in meshtrain/ over 400 lines, no function (or method)
over 80, counted from its `def` line (decorators excluded) to its last line."""
import ast
import functools
import pathlib

import meshtrain

PACKAGE = pathlib.Path(meshtrain.__file__).parent
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80

# Files and functions allowed over the limits for now ("path under meshtrain/" for a file,
# "path:function" for a function): none. An entry that is no longer over its limit fails
# test_known_oversize_still_over.
KNOWN_OVERSIZE: set[str] = set()


def oversize(root: pathlib.Path) -> dict[str, int]:
    """Every file and function under `root` over its limit -> its length in lines."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root).as_posix()
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            found[where] = len(text.splitlines())
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found[f"{where}:{node.name}"] = length
    return found


@functools.cache
def package_oversize() -> dict[str, int]:
    return oversize(PACKAGE)


def test_no_new_oversize_file_or_function():
    new = {k: n for k, n in package_oversize().items() if k not in KNOWN_OVERSIZE}
    assert not new, (f"over {MAX_FILE_LINES} lines per file / {MAX_FUNCTION_LINES} per "
                     f"function, split them: " + ", ".join(f"{k} ({n} lines)"
                                                          for k, n in new.items()))


def test_known_oversize_still_over():
    stale = KNOWN_OVERSIZE - set(package_oversize())
    assert not stale, f"now within the limits, so remove from KNOWN_OVERSIZE: {sorted(stale)}"


def test_checker_counts_files_and_functions(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    (tmp_path / "ok.py").write_text(f"def fits():\n{body}")          # exactly 80 lines
    method = body.replace("    ", "        ")
    (tmp_path / "long.py").write_text(
        f"class C:\n    def grown(self):\n{method}        return 1\n")   # 81 lines
    (tmp_path / "big.py").write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    assert oversize(tmp_path) == {"big.py": 401, "long.py:grown": 81}
