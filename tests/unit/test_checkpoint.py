"""Checkpoints in one process: saved before any step, and atomic under a crash mid-save."""
import pytest
import torch

import meshtrain as mt
from meshtrain.data.sampler import BatchSampler
from meshtrain.train import checkpoint
from tests.multirank import ddp_cases


def make_trainer(seed: int) -> mt.Trainer:
    torch.manual_seed(seed)
    return mt.Trainer(ddp_cases.GPT(ddp_cases.CONFIG), mt.Plan(),
                      optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))


def batches():
    sampler = BatchSampler(ddp_cases.data(), 16, ddp_cases.CONFIG.seq_len)
    return [sampler.batch(s) for s in range(3)]


def test_checkpoint_saved_before_the_first_step_loads(tmp_path):
    original = make_trainer(seed=0)
    original.save(tmp_path / "ck")
    restored = make_trainer(seed=1)  # other weights, to be overwritten
    restored.load(tmp_path / "ck")
    assert not restored.optimizer.state  # fresh, as it was when saved
    for x, y in batches():
        assert restored.step(x, y) == original.step(x, y)


def test_a_crash_mid_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    trainer = make_trainer(seed=0)
    x, y = batches()[0]
    trainer.step(x, y)
    trainer.save(tmp_path / "ck")
    saved = trainer.full_state_dict()
    trainer.step(x, y)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.dcp, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        trainer.save(tmp_path / "ck")
    assert not (tmp_path / "ck.partial").exists()   # removed on the failure's way out
    monkeypatch.undo()

    fresh = make_trainer(seed=1)
    fresh.load(tmp_path / "ck")  # still the first, complete checkpoint
    for name, value in saved.items():
        assert torch.equal(fresh.full_state_dict()[name], value), name
    trainer.save(tmp_path / "ck")  # and the next save goes through
    assert not (tmp_path / "ck.partial").exists()
