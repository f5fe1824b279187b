"""The `meshtrain` command ends without the interpreter's teardown, but only after what a
normal exit runs: other threads finished, atexit handlers (multiprocessing's cleanup), the
streams flushed, and the command's exit code."""
import subprocess
import sys

# the thread starts after "buffered" is written (not before the import, which a loaded
# machine can make outlast the thread's sleep), so the order on stdout is fixed
SCRIPT = """
import atexit, sys, threading, time
atexit.register(lambda: print("atexit ran"))
from meshtrain.cli.main import command
sys.argv = ["meshtrain", "report", "/nonexistent-run"]
print("buffered", end="")
threading.Thread(target=lambda: (time.sleep(0.2), print("thread finished"))).start()
command()
print("never printed")
"""


def test_the_command_exits_with_its_code_after_threads_atexit_and_flushed_streams():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stdout.split() == ["bufferedthread", "finished", "atexit", "ran"]
    assert "/nonexistent-run is not a meshtrain run folder" in done.stderr
    assert "never printed" not in done.stdout
