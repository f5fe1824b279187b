"""The README's library example runs as written (a script launching its own function)."""
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_example_runs_on_two_ranks(tmp_path):
    code = re.search(r"## Use it\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    losses = eval(out.stdout.strip().splitlines()[-1])  # one global mean loss per rank
    assert len(losses) == 2 and losses[0] == losses[1]
    assert abs(losses[0] - 5.545) < 0.1  # ln(256): an untrained byte-level model
