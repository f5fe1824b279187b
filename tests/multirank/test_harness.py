"""The test harness (`run_ranks`) and the elastic launcher (`meshtrain.launch`): results in
rank order, and every failure (raise, crash, hang) named by rank, never a hang of the suite."""
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import meshtrain as mt
from meshtrain.testing import RankError, run_ranks


def who_am_i(tag: str):
    """Rank, world, a tag, and the sum of ranks over an all_reduce (proves the group works)."""
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), tag, t.item()


def raise_on(bad_rank: int):
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom from rank {bad_rank}: 6 * 7 != 41")
    return dist.get_rank()


def kill_self(bad_rank: int, then_collective: bool):
    """`bad_rank` dies by SIGKILL; the others either return or wait in a collective with it."""
    if dist.get_rank() == bad_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    if then_collective:
        dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def hang_on(bad_rank: int):
    """`bad_rank` sleeps for 120 s, then returns: a harness that waited for it would hand
    back results instead of raising."""
    if dist.get_rank() == bad_rank:
        time.sleep(120)
    return dist.get_rank()


def test_results_come_back_in_rank_order():
    start = time.perf_counter()
    results = run_ranks(2, who_am_i, "hello")
    print(f"\nworld-2 run_ranks start+collective+teardown: {time.perf_counter() - start:.2f} s")
    assert results == [(0, 2, "hello", 1.0), (1, 2, "hello", 1.0)]
    assert run_ranks(3, who_am_i, tag="kw") == [(r, 3, "kw", 3.0) for r in range(3)]


def test_a_raising_rank_is_named_with_its_exception():
    with pytest.raises(RankError) as info:
        run_ranks(2, raise_on, 1)
    message = str(info.value)
    assert "rank 1 of 2 failed in raise_on" in message
    assert "ValueError: boom from rank 1: 6 * 7 != 41" in message


@pytest.mark.parametrize("then_collective", [False, True])
def test_a_killed_rank_is_named_with_its_signal(then_collective):
    with pytest.raises(RankError) as info:
        run_ranks(2, kill_self, 1, then_collective, timeout=20)
    message = str(info.value)
    assert "rank 1 died with signal SIGKILL" in message, message


def test_a_hang_is_reported_within_the_timeout():
    with pytest.raises(RankError) as info:   # returned results would mean it waited
        run_ranks(2, hang_on, 1, timeout=3)
    message = str(info.value)
    assert "hang_on timed out after 3 s on 2 ranks" in message
    assert "rank(s) [1] never returned" in message


def test_a_local_function_is_refused():
    def local():
        return 0
    with pytest.raises(ValueError, match="cannot run on other ranks: pass a top-level function"):
        run_ranks(2, local)


def test_launch_returns_per_rank_values():
    start = time.perf_counter()
    results = mt.launch(who_am_i, nproc=2, args=("elastic",))
    elapsed = time.perf_counter() - start
    print(f"\nlaunch nproc=2: {elapsed:.2f} s")
    assert results == [(0, 2, "elastic", 1.0), (1, 2, "elastic", 1.0)]


def device_seen():
    """What a rank was told (MESHTRAIN_DEVICE), its group's backend, and its mesh's device."""
    from meshtrain.core.device import DEVICE_ENV
    from meshtrain.core.mesh import Mesh

    mesh = Mesh.build(mt.Plan(dp=dist.get_world_size()))
    return os.environ[DEVICE_ENV], dist.get_backend(), str(mesh.device)


def test_the_device_chosen_reaches_every_rank(monkeypatch):
    monkeypatch.setenv("MESHTRAIN_DEVICE", "cuda")   # an argument wins over the environment
    assert mt.launch(device_seen, nproc=2, device="cpu") == [("cpu", "gloo", "cpu")] * 2
    assert run_ranks(2, device_seen, device="cpu") == [("cpu", "gloo", "cpu")] * 2
    with pytest.raises(ValueError, match="run_ranks.device='tpu'.: choose cpu or cuda"):
        run_ranks(2, device_seen, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cuda: no CUDA GPU"):
            run_ranks(1, device_seen, device="cuda")


def test_launch_reports_a_failing_rank():
    """Rank 0 returns and waits in teardown's barrier; rank 1 raises. Rank 0's "connection
    closed" echo can end first: the report must still carry rank 1's own exception."""
    with pytest.raises(mt.LaunchError) as info:
        mt.launch(raise_on, nproc=2, args=(1,))
    message = str(info.value)
    assert message.startswith("rank 1 failed"), message[:300]
    assert "ValueError: boom from rank 1: 6 * 7 != 41" in message


class NotAnException(BaseException):
    """As DCP's CheckpointException (a failed checkpoint save): no Exception subclass."""


def raise_base_exception():
    raise NotAnException("the save failed: No space left on device")


def test_a_rank_raising_a_base_exception_is_reported_not_printed(capfd):
    """torch's worker wrapper catches Exception only: a BaseException went on to
    multiprocessing, which printed the rank's whole traceback on the console."""
    with pytest.raises(mt.LaunchError) as info:
        mt.launch(raise_base_exception, nproc=1)
    assert info.value.first_raised()["type"] == "NotAnException"
    assert "No space left on device" in info.value.first_raised()["traceback"]
    assert "Traceback" not in capfd.readouterr().err


def test_bench_harness_times_each_world(tmp_path, capsys):
    """`meshtrain bench harness`: every call's all_reduce of ones sums to the world (checked
    inside the bench), one time per repetition and world, the same numbers in its JSON."""
    import json

    from meshtrain.cli.main import main

    out = tmp_path / "harness.json"
    assert main(["bench", "harness", "--world", "2", "3", "--reps", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert sorted(result["worlds"]) == ["2", "3"]
    assert all(len(times) == 2 and min(times) > 0 for times in result["worlds"].values())
    assert "world 3: median" in capsys.readouterr().out
