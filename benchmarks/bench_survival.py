"""Kill a random rank at a random step (and during a checkpoint write) under every plan;
each run must restart, resume and end bit-equal to the uninterrupted run.

    python benchmarks/bench_survival.py --runs 10
"""
import sys

from meshtrain.bench.survival import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
