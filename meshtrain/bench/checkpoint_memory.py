"""A checkpoint's memory beside training's: a 209M-parameter Llama (vocab 32768, width 1024,
12 layers, untied embeddings) over ZeRO-3 on 4 CPU ranks, 2 steps of AdamW and a checkpoint
after the second; per rank, its share of the checkpoint, the training peak and the save's
peak (the process's resident high-water marks, `Trainer.memory_report`).

    python -m meshtrain.bench.checkpoint_memory                    # this checkout
    python -m meshtrain.bench.checkpoint_memory --code /other/checkout   # another one's

Each run is a real `meshtrain train` command (about 2 minutes on 2 cores, ~11 GB of memory).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LLAMA_209M = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
              "vocab_size": 32768, "hidden_size": 1024, "intermediate_size": 2816,
              "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 8,
              "max_position_embeddings": 2048, "tie_word_embeddings": False}
RUN = ["--nproc", "4", "--dp", "4", "--zero", "3", "--steps", "2", "--ckpt-every", "2",
       "--batch", "4", "--seq", "64", "--eval-every", "100", "--no-progress"]
MiB = 1 << 20


def measure(code: str | None) -> list[dict]:
    """Each rank's memory report from one run, with meshtrain imported from `code`."""
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "config.json"
        config.write_text(json.dumps(LLAMA_209M))
        env = dict(os.environ, PYTHONPATH=code or str(Path(__file__).parents[2]))
        subprocess.run([sys.executable, "-m", "meshtrain", "train", "--model", str(config),
                        *RUN, "--run-dir", f"{folder}/run"], env=env, check=True,
                       stdout=subprocess.DEVNULL, cwd=folder)   # not this folder's meshtrain
        return json.loads(Path(f"{folder}/run/summary.json").read_text())["memory_per_rank"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", help="a meshtrain checkout to import (default: this one)")
    ranks = measure(parser.parse_args(argv).code)
    print("rank  share MiB  training peak MiB  checkpoint peak MiB  checkpoint - training")
    for rank, m in enumerate(ranks):
        print(f"{rank:>4}  {m['checkpoint_share'] / MiB:>9.1f}  {m['peak_process'] / MiB:>17.1f}"
              f"  {m['checkpoint_peak'] / MiB:>19.1f}"
              f"  {(m['checkpoint_peak'] - m['peak_process']) / MiB:>+21.1f}")


if __name__ == "__main__":
    main()
