"""`meshtrain export RUN_DIR OUT.safetensors`: the run's latest checkpoint as one safetensors
file of consolidated weights (the model's own state-dict keys, whatever plan trained it),
loadable with `safetensors.torch.load_file` into the model.
`meshtrain export RUN_DIR OUT_FOLDER` (a transformers model's run): a transformers model
folder (config.json + model.safetensors, and the run's tokenizer where it has one) that
`AutoModelForCausalLM.from_pretrained` (and `AutoTokenizer.from_pretrained`) loads.

    meshtrain export runs/2026-11-23_10-00-00 gpt.safetensors
    meshtrain export runs/2026-11-23_11-00-00 my-llama/
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from contextlib import contextmanager
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a run's latest weights as one safetensors file "
                       "or a transformers folder",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder made by meshtrain train")
    p.add_argument("out", metavar="OUT", help="the .safetensors file to write, or (a "
                   "transformers model's run) the model folder to write")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--shard-mb", type=int, default=SHARD_BYTES >> 20, metavar="MB",
                   help="a model folder's safetensors files hold at most this many MB (or "
                        "the largest tensor, if larger): what the export holds in memory at "
                        f"once (default {SHARD_BYTES >> 20})")
    p.set_defaults(run=run)


def export(run_dir, out, force: bool = False, shard_bytes: int | None = None
           ) -> tuple[Path, int, int]:
    """Write the latest checkpoint's model state to `out` (atomically); returns (path,
    tensors, steps trained)."""
    out = Path(out)
    if out.suffix == "":
        return export_folder(run_dir, out, force, shard_bytes or SHARD_BYTES)
    if out.suffix != ".safetensors":
        raise ValueError(f"{out}: give a file name ending in .safetensors (or, for a "
                         "transformers model's run, a folder name without a suffix)")
    if out.exists() and not force:
        raise ValueError(f"{out} exists; pass --force to replace it, or choose another name")
    if not out.parent.is_dir():
        raise ValueError(f"{out.parent} is not a folder; create it first")
    if not os.access(out.parent, os.W_OK):
        raise ValueError(f"{out.parent} is not writable; choose another folder")
    from safetensors.torch import save_file

    from meshtrain.train.generate import load_trained

    model, _, steps = load_trained(run_dir)
    # tied weights are one tensor under several keys: safetensors wants each key its own
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    tmp = out.with_name(out.name + ".tmp")
    with _writing(tmp, out):
        save_file(state, str(tmp), metadata={"meshtrain_run": str(run_dir), "step": str(steps)})
    os.replace(tmp, out)
    return out, len(state), steps


@contextmanager
def _writing(tmp: Path, out: Path):
    """Writes into `tmp`: a failed write (a full disk) leaves nothing behind and is said in
    one line (safetensors raises its own error type)."""
    import shutil

    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as exc:
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        raise OSError(f"cannot write {out}: {exc}; free space there or choose another place"
                      ) from None


def export_folder(run_dir, out: Path, force: bool = False, shard_bytes: int = 0
                  ) -> tuple[Path, int, int]:
    """A transformers model's latest checkpoint as a transformers model folder, written
    tensor by tensor beside `out` and moved into place once whole: the model is built on the
    meta device, and the weights go into safetensors shards no larger than the largest
    tensor (at least `shard_bytes`), each read from the checkpoint alone, so the process
    never holds the whole model."""
    import shutil

    from meshtrain.models import hf
    from meshtrain.models.registry import build_model
    from meshtrain.train import checkpoint
    from meshtrain.train.config import RunConfig, latest_checkpoint
    from meshtrain.train.errors import CheckpointError
    from meshtrain.core.state import StateLayout

    if out.exists() and not force:
        raise ValueError(f"{out} exists; pass --force to replace it, or choose another name")
    if not out.parent.is_dir():
        raise ValueError(f"{out.parent} is not a folder; create it first")
    config = RunConfig.load(run_dir)
    path = latest_checkpoint(run_dir)
    if path is None:
        raise CheckpointError(f"{run_dir} has no checkpoint yet (checkpoints/latest is "
                              "missing): let the run reach a checkpoint, or train it to the end")
    model = build_model(config.model, config.model_overrides, config.seq_len,
                        on_meta=True).module
    if not hf.is_causal_lm(model):
        raise ValueError(f"{run_dir} trained a {type(model).__name__}, not a transformers "
                         f"model: export it as a file, e.g. {out.name}.safetensors")
    meta = checkpoint.inspect(path)
    layout = StateLayout.of(model)
    checkpoint.check_shapes(meta, layout, path)
    saved = checkpoint.tensor_entries(path)
    # a tied tensor once, under its first name (as save_pretrained writes it)
    entries = {k: saved[k] for k in layout.keys if layout.canonical[k] == k}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with _writing(tmp, out):
        tmp.mkdir()
        model.config.save_pretrained(str(tmp))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(str(tmp))
        write_shards(tmp, entries, lambda group: checkpoint.read_tensors(path, group),
                     shard_bytes, progress=True)
        tokenizer = Path(run_dir) / "tokenizer"
        if tokenizer.is_dir():   # the run's tokenizer: the folder loads with AutoTokenizer too
            for file in tokenizer.iterdir():
                shutil.copyfile(file, tmp / file.name)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out, len(entries), int(meta.get("extra", {}).get("steps_done", 0))


SHARD_BYTES = 256 << 20   # 25 files for a 6 GB model; about this much held at once


def write_shards(folder: Path, entries: dict, read, shard_bytes: int,
                 progress: bool = False) -> None:
    """`entries` (key -> (shape, dtype)) as safetensors files in `folder`: model.safetensors,
    or model-0000i-of-0000n.safetensors and their index; `read(group)` gives a group's
    tensors. A file holds at most `shard_bytes`, or the largest tensor where larger.
    `progress`: a bar of the bytes written (on a terminal), with an ETA for a large model."""
    import json

    from safetensors.torch import save_file
    from tqdm import tqdm

    size = {k: math.prod(shape) * dtype.itemsize for k, (shape, dtype) in entries.items()}
    cap = max([shard_bytes, *size.values()])
    groups: list[dict] = [{}]
    for key, entry in entries.items():
        if groups[-1] and sum(size[k] for k in groups[-1]) + size[key] > cap:
            groups.append({})
        groups[-1][key] = entry
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    bar = tqdm(total=sum(size.values()), desc="export", unit="B", unit_scale=True,
               disable=None if progress else True, file=sys.stderr)
    with bar:
        for name, group in zip(names, groups):
            save_file(read(group), str(folder / name), metadata={"format": "pt"})
            bar.update(sum(size[k] for k in group))
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(size.values())},
                 "weight_map": {k: name for name, g in zip(names, groups) for k in g}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def run(args) -> int:
    from meshtrain.train.errors import CheckpointError

    try:
        out, count, steps = export(args.run_dir, args.out, args.force, args.shard_mb << 20)
    except (ValueError, FileNotFoundError, CheckpointError, OSError) as exc:
        print(f"meshtrain export: {exc}", file=sys.stderr)
        return 2
    print(f"exported {count} tensors of {args.run_dir} at step {steps} to {out}")
    return 0
