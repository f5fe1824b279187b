"""Our DDP vs torch DDP at world 2 and 4, and scaling against one process.

    python benchmarks/bench_ddp.py            # same as: meshtrain bench ddp
"""
import sys

from meshtrain.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "ddp", *sys.argv[1:]]))
