"""Offload of the optimizer's tensors (Plan(offload="cpu" | "disk")) under every ZeRO stage:
one-process equivalence, the disk's resident memory gone from the process (read from the
OS), its files private to the run and removed after it, bad paths refused."""
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import meshtrain as mt
from meshtrain.strategies.zero.offload import OffloadNotice, _trim_heap
from meshtrain.testing import run_ranks
from tests.multirank import equivalence as eq

CASES = [(zero, offload, model) for zero in (1, 2, 3) for offload in ("cpu", "disk")
         for model in ("gpt", "tied")]

pytestmark = pytest.mark.filterwarnings("ignore::meshtrain.strategies.zero.offload.OffloadNotice")


def offload_cases(microbatches: int, directory: str) -> dict:
    out = {}
    for zero, offload, model in CASES:
        plan = mt.Plan(dp=eq.world_size(), zero=zero, offload=offload, microbatches=microbatches)
        kw = {"offload_dir": directory} if offload == "disk" else {}
        out[(zero, offload, model)] = eq.train(plan, model, "sgd", **kw)
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 4])
def test_offload_matches_one_process(world, microbatches, tmp_path):
    refs = {model: eq.reference(model, "sgd") for model in ("gpt", "tied")}
    for results in run_ranks(world, offload_cases, microbatches, str(tmp_path), timeout=120):
        for (zero, offload, model), result in results.items():
            eq.assert_equivalent(result, refs[model], what=f"zero={zero} offload={offload} {model}")


# ---- the disk's resident memory, from the OS ----------------------------------------------------
def wide() -> nn.Module:
    """4.2M parameters in few tensors: AdamW's 33.6 MB of states dwarf the noise."""
    return nn.Sequential(nn.Embedding(64, 2048), nn.Linear(2048, 2048), nn.Linear(2048, 64))


def resident_after_steps(zero: int, offload: str, directory: str) -> dict:
    from meshtrain.measure.peaks import ResidentPeak

    def resident() -> int:
        return ResidentPeak._status()["RssAnon"] + ResidentPeak._status()["RssFile"]

    before = resident()
    torch.manual_seed(0)
    kw = {"offload_dir": directory} if offload == "disk" else {}
    trainer = mt.Trainer(wide(), mt.Plan(zero=zero, offload=offload, **kw), optimizer=eq.adamw,
                         loss_fn=eq.token_loss)
    x = torch.randint(0, 64, (4, 8))
    for _ in range(3):
        trainer.step(x, x)
    _trim_heap()   # both sides alike: what is resident is what is held, not the allocator's cache
    grown = resident() - before
    report = trainer.memory_report().to_dict()
    files = sorted(p.name for p in Path(directory).glob("meshtrain-offload-*"))
    trainer.close()
    left = sorted(p.name for p in Path(directory).glob("meshtrain-offload-*"))
    return {"grown": grown, "report": report, "files": files, "left": left}


@pytest.mark.parametrize("zero", [1, 3])
def test_disk_offload_takes_the_states_out_of_resident_memory(zero, tmp_path):
    kept = run_ranks(1, resident_after_steps, zero, "none", str(tmp_path / "a"))[0]
    disk = run_ranks(1, resident_after_steps, zero, "disk", str(tmp_path / "b"))[0]
    states = kept["report"]["optimizer_states"]
    assert states > 30e6 and disk["report"]["optimizer_states"] < 1e3   # AdamW's step counters
    accounted = disk["report"]["offloaded"] + disk["report"]["optimizer_states"]
    if zero == 1:
        assert accounted == states    # every byte of optimizer state, now on disk
    else:                             # ZeRO-3 keeps its parameter shards on disk too
        assert accounted > states
    # measured by the OS: the process grew by at least 80% of the states less with disk
    assert kept["grown"] - disk["grown"] > 0.8 * states, (kept["grown"], disk["grown"])
    assert len(disk["files"]) == 1 and disk["left"] == []     # one private folder, removed


def test_two_runs_never_share_offload_files(tmp_path):
    trainers = [mt.Trainer(eq.gpt(), mt.Plan(zero=2, offload="disk", offload_dir=tmp_path),
                           optimizer=eq.adamw) for _ in range(2)]
    folders = [t.data_parallel.offload.store.dir for t in trainers]
    assert folders[0] != folders[1] and all(f.parent == tmp_path for f in folders)
    for t in trainers:
        t.close()
    assert list(tmp_path.iterdir()) == []


# ---- notices and bad input -----------------------------------------------------------------------
def test_cpu_offload_on_a_cpu_only_machine_says_it_moves_nothing():
    with pytest.warns(OffloadNotice, match="nothing moves"):
        mt.Trainer(eq.gpt(), mt.Plan(zero=1, offload="cpu"), optimizer=eq.sgd)


def test_offload_without_zero_is_refused():
    with pytest.raises(mt.PlanError, match="Plan.offload='disk' needs ZeRO"):
        mt.Plan(offload="disk")


def test_an_unwritable_offload_folder_is_refused(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(mt.PlanError, match=r"offload='disk' cannot write to .*a-file"):
        mt.Trainer(eq.gpt(), mt.Plan(zero=1, offload="disk", offload_dir=blocker / "sub"),
                   optimizer=eq.sgd)


def test_a_full_offload_disk_is_refused(tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1000))
    with pytest.raises(mt.PlanError, match=r"offload='disk' needs .* MiB in .* but 0.0 MiB are free"):
        mt.Trainer(eq.gpt(), mt.Plan(zero=1, offload="disk", offload_dir=tmp_path),
                   optimizer=eq.sgd)
    assert list(tmp_path.iterdir()) == []   # nothing left behind


def test_an_offload_folder_without_disk_offload_is_refused(tmp_path):
    with pytest.raises(mt.PlanError, match=r"offload_dir \(--offload-dir\) is where "
                                           "offload='disk' writes"):
        mt.Trainer(eq.gpt(), mt.Plan(zero=1, offload_dir=tmp_path), optimizer=eq.sgd)
