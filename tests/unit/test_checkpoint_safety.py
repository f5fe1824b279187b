"""Loading a checkpoint never runs code from it: crafted pickles in DCP's `.metadata` or in
a non-tensor value of the state dict are refused by name, and their side effect never
happens; genuine checkpoints still load to the same numbers."""
import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import meshtrain as mt
from meshtrain.data.sampler import BatchSampler
from meshtrain.train import checkpoint
from meshtrain.train.checkpoint import CheckpointError, UnsafeCheckpoint
from tests.multirank import ddp_cases

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Payload:
    """Pickles as a call of `fn(*args)`: what an attacker puts in a checkpoint file."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def payloads(marker) -> dict[str, bytes]:
    """Pickles that would create `marker` (or import an unknown module) when unpickled."""
    return {
        "os.system": pickle.dumps(Payload(os.system, f"touch {marker}")),
        "builtins.eval": pickle.dumps(Payload(eval, f"open({str(marker)!r}, 'w')")),
        "subprocess.Popen": pickle.dumps(Payload(subprocess.Popen, ["touch", str(marker)])),
        # protocol 0 by hand: GLOBAL of a module nobody has, then a call
        "unknown module": b"cmeshtrain_evil_module_xyz\nrun\n(tR.",
    }


def make_trainer(seed: int) -> mt.Trainer:
    torch.manual_seed(seed)
    return mt.Trainer(ddp_cases.GPT(ddp_cases.CONFIG), mt.Plan(),
                      optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))


def batches(n: int = 3):
    sampler = BatchSampler(ddp_cases.data(), 16, ddp_cases.CONFIG.seq_len)
    return [sampler.batch(s) for s in range(n)]


@pytest.fixture(scope="module")
def genuine(tmp_path_factory):
    """A checkpoint after two steps, and the trainer's next losses from there."""
    path = tmp_path_factory.mktemp("genuine") / "ck"
    trainer = make_trainer(0)
    data = batches()
    for x, y in data[:2]:
        trainer.step(x, y)
    trainer.save(path)
    return path, trainer.step(*data[2]), trainer.full_state_dict()


def test_a_genuine_checkpoint_loads_to_the_same_numbers(genuine):
    path, next_loss, state = genuine
    restored = make_trainer(1)
    restored.load(path)
    assert restored.optimizer.param_groups[0]["betas"] == (0.9, 0.999)
    assert restored.step(*batches()[2]) == next_loss
    for name, value in state.items():
        assert torch.equal(restored.full_state_dict()[name], value), name


def resign(path) -> None:
    """What an attacker who edits files also does: rewrite meshtrain.json's manifest (plain
    JSON) to match them, so that only the restricted unpicklers stand in the way."""
    meta_file = path / checkpoint.META
    meta = json.loads(meta_file.read_text())
    meta["files"] = checkpoint.manifest(path)
    meta_file.write_text(json.dumps(meta))


@pytest.mark.parametrize("kind", list(payloads("x")))
def test_a_crafted_metadata_file_is_refused_and_never_runs(genuine, tmp_path, kind):
    marker = tmp_path / "marker"
    crafted = tmp_path / "ck"
    shutil.copytree(genuine[0], crafted)
    (crafted / ".metadata").write_bytes(payloads(marker)[kind])
    with pytest.raises(CheckpointError, match="does not match its checksum|the manifest says"):
        make_trainer(1).load(crafted)      # the manifest notices first
    resign(crafted)
    with pytest.raises(UnsafeCheckpoint) as info:
        make_trainer(1).load(crafted)
    assert not marker.exists()
    message = str(info.value)
    assert f"{crafted}/.metadata refers to " in message
    assert "loading it would run code from the file. Refused" in message
    expected = {"os.system": "posix.system", "builtins.eval": "builtins.eval",
                "subprocess.Popen": "subprocess.Popen",
                "unknown module": "meshtrain_evil_module_xyz.run"}[kind]
    assert expected in message
    assert "meshtrain_evil_module_xyz" not in __import__("sys").modules


def save_with_value(path, value) -> None:
    """A checkpoint of the tiny GPT whose optimizer's lr is `value` (a non-tensor item)."""
    trainer = make_trainer(0)
    trainer.step(*batches(1)[0])
    trainer.save(path)   # meshtrain.json from a genuine save
    model_sd, optim_sd = trainer.full_state_dict(), trainer.full_optimizer_state()
    optim_sd["param_groups"][0]["lr"] = value
    for f in list(path.glob("*.distcp")) + [path / ".metadata"]:
        f.unlink()
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path), no_dist=True)
    resign(path)


@pytest.mark.parametrize("kind", ["os.system", "builtins.eval", "subprocess.Popen"])
def test_a_crafted_value_inside_a_shard_is_refused_and_never_runs(tmp_path, kind):
    marker = tmp_path / "marker"
    fn, *args = {"os.system": (os.system, f"touch {marker}"),
                 "builtins.eval": (eval, f"open({str(marker)!r}, 'w')"),
                 "subprocess.Popen": (subprocess.Popen, ["touch", str(marker)])}[kind]
    path = tmp_path / "ck"
    save_with_value(path, Payload(fn, *args))
    assert not marker.exists()   # saving pickles the payload, it does not run it
    with pytest.raises(UnsafeCheckpoint) as info:
        make_trainer(1).load(path)
    assert not marker.exists()
    message = str(info.value)
    assert "the value of 'optim.param_groups.0.lr' is not plain data" in message
    assert "GLOBAL" in message and "Refused" in message


def test_the_same_rewrite_with_plain_data_loads(tmp_path):
    """The rewrite itself is sound: with a plain number in place of the payload, it loads."""
    path = tmp_path / "ck"
    save_with_value(path, 0.125)
    trainer = make_trainer(1)
    trainer.load(path)
    assert trainer.optimizer.param_groups[0]["lr"] == 0.125


def test_metadata_that_is_not_a_pickle_is_refused_clearly(genuine, tmp_path):
    crafted = tmp_path / "ck"
    shutil.copytree(genuine[0], crafted)
    (crafted / ".metadata").write_bytes(b"not a pickle at all")
    resign(crafted)
    with pytest.raises(CheckpointError, match="is not a checkpoint's metadata"):
        make_trainer(1).load(crafted)


# ---- the manifest: every file's size and checksum, verified on load ------------------------
def damage(kind: str, path):
    shard = sorted(path.glob("*.distcp"))[0]
    if kind == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
        return f"{shard.name} has "
    if kind == "flipped byte":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
        return f"{shard.name} does not match its checksum (corrupted)"
    if kind == "missing":
        shard.unlink()
        return f"{shard.name} is missing"
    (path / "extra.distcp").write_bytes(b"x")
    return "holds files its manifest does not list (extra.distcp)"


@pytest.mark.parametrize("kind", ["truncated", "flipped byte", "missing", "added"])
def test_a_damaged_checkpoint_is_refused_naming_the_file(genuine, tmp_path, kind):
    damaged = tmp_path / "ck"
    shutil.copytree(genuine[0], damaged)
    expected = damage(kind, damaged)
    with pytest.raises(CheckpointError) as info:
        make_trainer(1).load(damaged)
    assert expected in str(info.value) and "use an earlier checkpoint" in str(info.value)


def test_the_manifest_lists_every_file_with_its_checksum(genuine):
    import hashlib

    path = genuine[0]
    files = json.loads((path / checkpoint.META).read_text())["files"]
    on_disk = sorted(f.name for f in path.iterdir() if f.name != checkpoint.META)
    assert sorted(files) == on_disk and ".metadata" in files
    for name, entry in files.items():
        data = (path / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_a_save_that_fails_while_writing_leaves_no_partial_folder(tmp_path, monkeypatch):
    """A full disk mid-write: the error propagates, `<path>.partial` is removed, and the
    previous complete checkpoint (even one at the same path) is untouched."""
    state = {"w": torch.arange(6.0, device="cpu").reshape(2, 3)}
    ck = tmp_path / "step_1"
    checkpoint.save(ck, state, None, mt.Plan(), {"steps_done": 1})
    (tmp_path / "latest").write_text("step_1")
    before = {p.name: p.read_bytes() for p in ck.iterdir()}

    def full_disk(state, checkpoint_id, **kwargs):
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half a shard")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.dcp, "save", full_disk)
    for path in (tmp_path / "step_2", ck):   # a new step, and a rewrite of the same one
        with pytest.raises(OSError, match="No space left on device"):
            checkpoint.save(path, state, None, mt.Plan(), {"steps_done": 2})
        assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_1"]
    assert {p.name: p.read_bytes() for p in ck.iterdir()} == before
    assert (tmp_path / "latest").read_text() == "step_1"
    assert checkpoint.inspect(ck)["extra"] == {"steps_done": 1}
