"""Checkpoints: torch.distributed.checkpoint, written atomically, readable by any plan.

Layout of a checkpoint folder:
    meshtrain.json     plan, step and extras, every parameter's name and shape, and the
                       manifest: every other file's size and SHA-256, verified on load
    *.distcp, .metadata   torch.distributed.checkpoint's own files (model + optimizer)

What is saved is the consolidated, one-process state (core/state.py): the model's own
state-dict keys at full shapes, and the optimizer's state keyed by parameter name. So a
checkpoint does not depend on the plan that wrote it: it loads under any other plan, each
rank reading only the regions of each tensor it keeps (`load_regions`, written in chunks for
that: [Note: a checkpoint in chunks] in checkpoint_regions.py). Each rank hands DCP an even
share of the state, its rows of each tensor at their offsets in the whole (`placed`;
[Note: even shares] in checkpoint_shares.py: no rank holds the state whole, nor writes much
more than its part of it); DCP writes their union, as it writes a sharded DTensor's chunks.
A checkpoint written with each tensor by one rank (before the shares) reads the same way.

[Note: atomic save]
Every rank writes into `<path>.partial`; after a barrier, rank 0 writes meshtrain.json last
and renames the folder to `<path>` (moving an older one aside first). A crash at any point
leaves either the previous checkpoint or the new one, never a half-written one under `path`;
a folder without meshtrain.json is refused on load. A write that fails with an error (a full
disk) removes `<path>.partial` on its way out; a killed process leaves it to the next save.

[Note: loading runs no code]
Every read goes through `checkpoint_reader`: DCP's `.metadata` and the state dict's
non-tensor values are unpickled by restricted unpicklers (tensors were already read
weights-only), and meshtrain.json is JSON. A file that would call or import anything else is
refused with `UnsafeCheckpoint` before anything from it runs.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from meshtrain.train.checkpoint_reader import (CheckpointError, SafeFileSystemReader,
                                               SafeLoadPlanner, UnsafeCheckpoint,
                                               check_checkpoint_files)
from meshtrain.train import checkpoint_regions, faults
from meshtrain.train.checkpoint_regions import (ChunkedSavePlanner, CutsOf, Placed,
                                                RegionLoadPlanner, RegionOf)
from meshtrain.core.state import StateLayout

META = "meshtrain.json"
METADATA = ".metadata"   # DCP's own


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def save(path, model_state: dict[str, torch.Tensor], optimizer_state: dict | None, plan,
         extra: dict, shapes: dict[str, tuple[int, ...]] | None = None,
         cuts_of: CutsOf | None = None, placed: Placed | None = None) -> None:
    """Write the consolidated state: every rank passes its share of it (DCP writes the union,
    each element once), or all the same; `optimizer_state` is None before the first
    optimizer step. `shapes`: every state-dict key's shape (default: `model_state`'s).
    `cuts_of`: where the saving plan cuts each tensor ([Note: a checkpoint in chunks];
    default: none). `placed`: the tensors passed as a part of the whole, by entry path:
    (whole shape, the boxes of it the part fills) ([Note: even shares] in
    checkpoint_shares.py)."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier()
    state = {"model": model_state}
    if optimizer_state is not None:
        state["optim"] = optimizer_state
    try:
        with _single_process_quiet():
            dcp.save(state, checkpoint_id=str(partial), no_dist=not _distributed(),
                     planner=ChunkedSavePlanner(cuts_of or _no_cuts,
                                                checkpoint_regions.CHUNK_BYTES, placed))
        faults.maybe_kill(_rank(), int(extra.get("steps_done", -1)), "checkpoint")
        _barrier()
        if _rank() == 0:
            meta = {"format": 3, "plan": plan.to_dict(), "extra": extra,
                    "has_optimizer_state": optimizer_state is not None,
                    "shapes": {k: list(v) for k, v in (shapes or {
                        k: v.shape for k, v in model_state.items()}).items()},
                    "files": manifest(partial)}
            tmp = partial / (META + ".tmp")
            tmp.write_text(json.dumps(meta, indent=1))
            os.replace(tmp, partial / META)
    except BaseException:
        # a write that failed (a full disk) leaves no half checkpoint taking the space; only
        # the partial folder goes, `path` and `latest` are untouched, the error propagates
        # (DCP raises its failure on every rank, after they all stopped writing)
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    if _rank() == 0:
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


def manifest(folder: Path, hashed: set[str] | None = None) -> dict[str, dict]:
    """Every file of a checkpoint (but meshtrain.json) with its size and SHA-256 (only of
    the files named in `hashed`, where given)."""
    return {f.name: {"bytes": f.stat().st_size,
                     **({"sha256": _sha256(f)} if hashed is None or f.name in hashed else {})}
            for f in sorted(Path(folder).iterdir()) if f.is_file() and f.name != META
            and not f.name.endswith(".tmp")}


def _sha256(path: Path) -> str:
    # one small buffer read into again and again: hashing a rank's file after a save adds
    # 64 KiB to rank 0's peak, not the two 1 MiB blocks that fresh reads kept in flight
    digest, block = hashlib.sha256(), bytearray(1 << 16)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(block):
            digest.update(view[:n])
    return digest.hexdigest()


def verify_manifest(path, meta: dict, hashed: set[str] | None = None) -> None:
    """Refuse a checkpoint whose files differ from its manifest: missing, truncated,
    changed or added after the save; the checksums of the files in `hashed` only, where
    given (a rank's reads). (Checkpoints of format 2 carry no manifest.)"""
    listed = meta.get("files")
    if listed is None:
        return
    if not isinstance(listed, dict):
        raise CheckpointError(f"{Path(path) / META} is corrupted (its manifest is not a "
                              "mapping); use an earlier checkpoint")
    present = manifest(path, hashed) if Path(path).is_dir() else {}
    for name, want in listed.items():
        got = present.get(name)
        if got is None:
            problem = "is missing"
        elif got["bytes"] != want.get("bytes"):
            problem = f"has {got['bytes']} bytes, the manifest says {want.get('bytes')} (truncated?)"
        elif "sha256" in got and got["sha256"] != want.get("sha256"):
            problem = "does not match its checksum (corrupted)"
        else:
            continue
        raise CheckpointError(f"checkpoint {path}: {name} {problem}; use an earlier checkpoint")
    extra = sorted(set(present) - set(listed))
    if extra:
        raise CheckpointError(f"checkpoint {path} holds files its manifest does not list "
                              f"({', '.join(extra[:3])}): it was changed after it was saved; "
                              "use an earlier checkpoint")


def inspect(path, hashed: set[str] | None = None) -> dict:
    """Check, in this process alone, what can be checked before any rank loads:
    meshtrain.json, every file against the manifest's size and checksum (of the files in
    `hashed` only, where given), and everything DCP would unpickle, read the restricted way.
    Returns meshtrain.json."""
    meta = read_meta(path)
    verify_manifest(path, meta, hashed)
    check_checkpoint_files(path)
    return meta


def check_shapes(meta: dict, layout: StateLayout, path) -> None:
    """Refuse, by name, a checkpoint whose parameters do not match the model's."""
    saved = meta.get("shapes", {})
    ours = {k: list(v) for k, v in layout.shapes.items()}
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


def load(path, layout: StateLayout) -> tuple[dict, dict | None, dict]:
    """The consolidated state saved at `path`: (model state by state-dict key, optimizer
    state by parameter name or None, extras). This process reads all of it (export,
    generate); a resumed rank reads its part (`load_regions`)."""
    meta = inspect(path)   # a refused .metadata stops here, before DCP reads anything
    check_shapes(meta, layout, path)
    planner = SafeLoadPlanner(path)
    _read(path, planner, SafeFileSystemReader(str(path)))
    state = planner.original_state_dict   # rebuilt from the checkpoint's own metadata
    return state["model"], state.get("optim"), meta.get("extra", {})


def load_regions(path, layout: StateLayout, region_of: RegionOf
                 ) -> tuple[dict, dict | None, dict, int]:
    """What this rank keeps of the state saved at `path`: (model state by state-dict key,
    optimizer state by parameter name or None, extras, tensor bytes read). Of each tensor, only
    the region `region_of(entry path, shape)` names is read (None: none of it), and given
    as that region assembles it ([Note: a checkpoint in chunks]). Every file's size is
    checked against the manifest, the checksums of the files this rank reads (once its
    reads are planned: a refusal on any rank is every rank's)."""
    meta = inspect(path, hashed={METADATA})
    check_shapes(meta, layout, path)
    planner = RegionLoadPlanner(path, region_of,
                                lambda files: verify_manifest(path, meta, hashed=files))
    reader = SafeFileSystemReader(str(path))
    _read(path, planner, reader)
    state = planner.state()
    return state.get("model", {}), state.get("optim"), meta.get("extra", {}), reader.tensor_bytes


def _read(path, planner, reader) -> None:
    """dcp.load through `planner` and `reader`, its failures said as CheckpointError."""
    try:
        with _single_process_quiet():
            dcp.load({}, storage_reader=reader, planner=planner, no_dist=not _distributed())
    # DCP's own errors are long and deep: name the file and the fix. Its CheckpointException
    # (what a corrupted shard raises) derives from BaseException, not Exception.
    except (Exception, dcp.CheckpointException) as exc:
        cause = _unwrap(exc)
        if isinstance(cause, CheckpointError):   # ours, raised inside DCP: already clear
            raise type(cause)(str(cause)) from None
        raise CheckpointError(f"checkpoint {path} could not be read ({_describe(cause)}); it "
                              "is corrupted or incomplete: use an earlier checkpoint") from None


def _no_cuts(entry, shape: tuple[int, ...]) -> list[list[int]]:
    return []


def tensor_entries(path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every model tensor saved at `path`: state-dict key -> (shape, dtype), from DCP's
    metadata alone (call `inspect` first)."""
    metadata = SafeFileSystemReader(str(path)).read_metadata()
    out = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if fqn.startswith("model.") and hasattr(entry, "properties"):
            out[fqn[len("model."):]] = (tuple(entry.size), entry.properties.dtype)
    return out


def read_tensors(path, entries: dict[str, tuple[tuple[int, ...], torch.dtype]]
                 ) -> dict[str, torch.Tensor]:
    """Only the model tensors named in `entries` (key -> (shape, dtype)), read from the
    checkpoint at `path` in this process: DCP reads those and nothing else."""
    state = {key: torch.empty(shape, dtype=dtype, device="cpu")   # read into host memory
             for key, (shape, dtype) in entries.items()}
    with _single_process_quiet():
        dcp.load({"model": state}, storage_reader=SafeFileSystemReader(str(path)), no_dist=True)
    return state


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
