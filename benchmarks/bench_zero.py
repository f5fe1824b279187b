"""Our DDP, ZeRO-1 and ZeRO-2 against torch's ZeroRedundancyOptimizer at world 2 and 4.

    python benchmarks/bench_zero.py             # same as: meshtrain bench zero
"""
import sys

from meshtrain.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "zero", *sys.argv[1:]]))
