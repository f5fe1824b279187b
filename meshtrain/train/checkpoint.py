"""Checkpoints: torch.distributed.checkpoint (sharded, reshardable), written atomically.

Layout of a checkpoint folder:
    meshtrain.json     plan, step and extras, and every parameter's name and shape
    *.distcp, .metadata   torch.distributed.checkpoint's own files (model + optimizer)

Keys are the model's own parameter names (fully qualified), so a checkpoint does not depend
on the plan that wrote it: it loads under any other plan.

[Note: atomic save]
Every rank writes into `<path>.partial`; after a barrier, rank 0 writes meshtrain.json last
and renames the folder to `<path>` (moving an older one aside first). A crash at any point
leaves either the previous checkpoint or the new one, never a half-written one under `path`;
a folder without meshtrain.json is refused on load.

[Note: loading runs no code]
Every read goes through `checkpoint_reader`: DCP's `.metadata` and the state dict's
non-tensor values are unpickled by restricted unpicklers (tensors were already read
weights-only), and meshtrain.json is JSON. A file that would call or import anything else is
refused with `UnsafeCheckpoint` before anything from it runs.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from meshtrain.train.checkpoint_reader import (CheckpointError, SafeFileSystemReader,
                                               SafeLoadPlanner, UnsafeCheckpoint,
                                               check_checkpoint_files)

META = "meshtrain.json"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def save(path, model: nn.Module, optimizer, plan, extra: dict) -> None:
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier()
    has_optimizer_state = bool(optimizer.state)  # False before the first optimizer step
    if has_optimizer_state:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    else:  # get_state_dict would fill the empty optimizer with placeholder state (a step)
        state = {"model": get_model_state_dict(model)}
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=str(partial), no_dist=not _distributed())
    _barrier()
    if _rank() == 0:
        meta = {"format": 1, "plan": plan.to_dict(), "extra": extra,
                "has_optimizer_state": has_optimizer_state,
                "shapes": {k: list(v.shape) for k, v in model.state_dict().items()}}
        tmp = partial / (META + ".tmp")
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, partial / META)
        old = path.with_name(path.name + ".old")
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(partial, path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


def read_meta(path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}: the folder does not exist")
    meta_file = path / META
    if not meta_file.exists():
        raise CheckpointError(f"{path} is not a complete meshtrain checkpoint ({META} is "
                              "missing: an interrupted save?); use an earlier checkpoint")
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{meta_file} is corrupted ({exc}); use an earlier "
                              "checkpoint") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_file} is corrupted (not a JSON object); use an earlier "
                              "checkpoint")
    return meta


def inspect(path) -> dict:
    """Check, in this process alone and cheaply, what can be checked before any rank loads:
    meshtrain.json, and everything DCP would unpickle, read the restricted way. Returns
    meshtrain.json."""
    meta = read_meta(path)
    check_checkpoint_files(path)
    return meta


def check_shapes(meta: dict, model: nn.Module, path) -> None:
    """Refuse, by name, a checkpoint whose parameters do not match the model's."""
    saved = meta.get("shapes", {})
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(ours) - set(saved))
    unexpected = sorted(set(saved) - set(ours))
    changed = [f"{k}: checkpoint {saved[k]} vs model {ours[k]}"
               for k in sorted(set(ours) & set(saved)) if saved[k] != ours[k]]
    if missing or unexpected or changed:
        details = "; ".join(filter(None, [
            f"missing from checkpoint: {missing[:5]}" if missing else "",
            f"not in model: {unexpected[:5]}" if unexpected else "",
            f"shape differs: {changed[:5]}" if changed else ""]))
        raise CheckpointError(f"checkpoint {path} was saved from a different model ({details}); "
                              "build the model with the configuration it was saved with")


def load(path, model: nn.Module, optimizer) -> dict:
    meta = inspect(path)   # a refused .metadata stops here, before DCP reads anything
    check_shapes(meta, model, path)
    with_optimizer = meta.get("has_optimizer_state", True)
    if with_optimizer:
        # get_state_dict creates a fresh optimizer's state (the slots to load into) only when
        # no parameter holds a gradient, else it silently leaves the optimizer unloaded.
        # The caller starts its next step with fresh gradients anyway.
        for p in model.parameters():
            p.grad = None
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    else:  # saved before the first step: the optimizer starts fresh, as it did then
        state = {"model": get_model_state_dict(model)}
    try:
        with _single_process_quiet():
            dcp.load(state, storage_reader=SafeFileSystemReader(str(path)),
                     planner=SafeLoadPlanner(path), no_dist=not _distributed())
    # DCP's own errors are long and deep: name the file and the fix. Its CheckpointException
    # (what a corrupted shard raises) derives from BaseException, not Exception.
    except (Exception, dcp.CheckpointException) as exc:
        cause = _unwrap(exc)
        if isinstance(cause, CheckpointError):   # ours, raised inside DCP: already clear
            raise type(cause)(str(cause)) from None
        raise CheckpointError(f"checkpoint {path} could not be read ({_describe(cause)}); it "
                              "is corrupted or incomplete: use an earlier checkpoint") from None
    if with_optimizer:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    else:
        set_model_state_dict(model, state["model"])
    return meta.get("extra", {})


@contextmanager
def _single_process_quiet():
    """DCP warns that it assumes one process even when told so (no_dist=True)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _unwrap(exc: BaseException) -> BaseException:
    """The first rank's own exception, unwrapped from DCP's CheckpointException (whose text
    is a traceback per rank)."""
    if isinstance(exc, dcp.CheckpointException) and exc.failures:
        failure = next(iter(exc.failures.values()))
        return failure[0] if isinstance(failure, tuple) else failure
    return exc


def _describe(exc: BaseException) -> str:
    """One line: the exception's type and the first line of its text."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__
