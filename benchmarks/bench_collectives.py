"""All-reduce (c10d, ring, parameter server), reduce-scatter and all-gather algorithms, 4 KiB
to 64 MiB, at world 2 and 4: time and bus bandwidth.

    python benchmarks/bench_collectives.py      # same as: meshtrain bench collectives
"""
import sys

from meshtrain.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "collectives", *sys.argv[1:]]))
