"""Where ranks run (core/device.py), checked on CPU with a mocked GPU count: the choice, the
refusals before any rank starts, each rank's device from LOCAL_RANK, the backend, and the
device's figures in the summary. No GPU figure here is measured: the mocks test the plumbing."""
import argparse
import importlib
import os

import pytest
import torch

from meshtrain.cli import summary as summary_module
from meshtrain.cli import train_cmd
from meshtrain.core import device as dev
from meshtrain.core.mesh import device_for_backend
from meshtrain.core.plan import Plan
from meshtrain.train.trainer import Trainer


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has `n` visible GPUs (0: none, as on this CPU build)."""
    monkeypatch.delenv(dev.DEVICE_ENV, raising=False)

    def set_count(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return set_count


def test_auto_picks_cuda_only_where_a_gpu_is_visible(gpus, monkeypatch):
    gpus(0)
    assert dev.resolve_device("auto") == "cpu" and dev.resolve_device(None) == "cpu"
    assert dev.default_ranks("cpu") == 2
    gpus(3)
    assert dev.resolve_device("auto") == "cuda" and dev.resolve_device("cpu") == "cpu"
    assert dev.default_ranks("cuda") == 3
    monkeypatch.setenv(dev.DEVICE_ENV, "cpu")   # no choice given: the environment's
    assert dev.resolve_device(None) == "cpu"


def test_cuda_without_a_gpu_and_an_unknown_device_are_refused(gpus):
    gpus(0)
    with pytest.raises(dev.DeviceError, match=r"--device cuda: no CUDA GPU .*--device cpu"):
        dev.resolve_device("cuda")
    with pytest.raises(dev.DeviceError, match=r"--device 'tpu': choose one of auto, cpu, cuda"):
        dev.resolve_device("tpu")


def test_more_ranks_than_gpus_is_refused_naming_both_counts_and_the_ways_out(gpus):
    gpus(1)
    dev.check_ranks_fit("cuda", 1)
    dev.check_ranks_fit("cpu", 8)   # CPU ranks are not counted against GPUs
    with pytest.raises(dev.DeviceError) as err:
        dev.check_ranks_fit("cuda", 2)
    text = str(err.value)
    assert "2 ranks" in text and "1 visible GPU" in text
    assert "--nproc 1" in text and "--device cpu" in text


def test_each_rank_takes_the_gpu_of_its_local_rank(gpus, monkeypatch):
    gpus(2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert device_for_backend("cuda") == (torch.device("cuda", 1), "cpu:gloo,cuda:nccl")
    monkeypatch.setenv(dev.DEVICE_ENV, "cuda")   # what init_distributed / run_ranks leave
    assert dev.rank_device() == torch.device("cuda", 1)
    assert device_for_backend("cpu") == (torch.device("cpu"), "gloo")
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(dev.DeviceError, match=r"LOCAL_RANK 2 on CUDA, .* 2 visible GPU"):
        dev.rank_device()


def _train_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train_cmd.add_parser(parser.add_subparsers())
    return parser.parse_args(["train", *argv])


def test_the_command_defaults_to_one_rank_per_gpu(gpus, tmp_path):
    gpus(0)
    config = train_cmd.build_config(_train_args("--run-dir", str(tmp_path)))
    assert (config.device, config.plan["dp"]) == ("cpu", 2)   # today's default: DDP on 2
    gpus(4)
    config = train_cmd.build_config(_train_args("--run-dir", str(tmp_path)))
    assert (config.device, config.plan["dp"]) == ("cuda", 4)
    config = train_cmd.build_config(_train_args("--device", "cpu", "--run-dir", str(tmp_path)))
    assert (config.device, config.plan["dp"]) == ("cpu", 2)


@pytest.mark.parametrize("argv, expected", [
    (("--nproc", "2"), ["2 ranks on CUDA", "1 visible GPU", "--nproc 1", "--device cpu"]),
    (("--device", "cuda", "--pp", "2"), ["2 ranks on CUDA", "--nproc 1"]),
])
def test_the_command_refuses_more_ranks_than_gpus_before_any_rank_starts(
        gpus, monkeypatch, capsys, tmp_path, argv, expected):
    gpus(1)
    from meshtrain.core import processes

    launch_module = importlib.import_module("meshtrain.launch")   # the name is the function
    monkeypatch.setattr(processes, "start_forkserver", lambda **preload: None)
    monkeypatch.setattr(launch_module, "launch", lambda *a, **k: pytest.fail("a rank started"))
    run_dir = tmp_path / "run"
    assert train_cmd.run(_train_args(*argv, "--run-dir", str(run_dir))) == 2
    err = capsys.readouterr().err
    assert all(part in err for part in expected), err
    assert not run_dir.exists()


def test_the_command_refuses_cuda_on_a_machine_without_one(gpus, monkeypatch, capsys, tmp_path):
    gpus(0)
    from meshtrain.core import processes
    monkeypatch.setattr(processes, "start_forkserver", lambda **preload: None)
    assert train_cmd.run(_train_args("--device", "cuda", "--run-dir", str(tmp_path / "r"))) == 2
    assert "--device cuda: no CUDA GPU" in capsys.readouterr().err


def test_launch_refuses_before_starting_a_rank(gpus):
    from meshtrain.launch import launch
    gpus(1)
    with pytest.raises(dev.DeviceError, match="3 ranks on CUDA.*--nproc 1"):
        launch(os.getpid, nproc=3, device="cuda")


# ---- batches onto the device ---------------------------------------------------------------
class HostBatch:
    """Stands for a host tensor, pinned or not, and records how it is moved."""

    def __init__(self, pinned: bool) -> None:
        self.device, self.pinned, self.moves = torch.device("cpu"), pinned, []

    def is_pinned(self) -> bool:
        return self.pinned

    def to(self, device, non_blocking=False):
        self.moves.append((device, non_blocking))
        return self


def test_batches_are_pinned_and_copied_without_blocking_only_for_a_gpu():
    gpu, cpu = torch.device("cuda", 1), torch.device("cpu")
    assert dev.pin_host_batches(gpu) and not dev.pin_host_batches(cpu)
    for pinned, device, non_blocking in ((True, gpu, True), (False, gpu, False),
                                         (True, cpu, False)):
        batch = HostBatch(pinned)
        assert dev.to_device(batch, device) is batch
        assert batch.moves == [(device, non_blocking)], (pinned, device)
    tokens = torch.arange(6).view(2, 3)
    assert dev.to_device(tokens, cpu) is tokens   # on CPU: the batch itself, no copy


# ---- the device's figures ------------------------------------------------------------------
def test_on_cpu_the_device_adds_nothing_and_the_clock_is_the_host_clock():
    cpu = torch.device("cpu")
    assert dev.device_memory(cpu) is None
    clock = dev.DeviceClock(cpu)
    a, b = clock.now(), clock.now()
    assert 0 <= b - a < 1
    assert dev.pinned_bytes([torch.zeros(4)]) == 0   # pageable host memory is not pinned


def test_on_cuda_the_clock_waits_and_memory_comes_from_the_allocator(monkeypatch):
    gpu, calls = torch.device("cuda", 1), []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d: calls.append(("sync", d)))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 3 * 2**20)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 5 * 2**20)
    dev.DeviceClock(gpu).now()
    assert calls == [("sync", gpu)]
    assert dev.device_memory(gpu) == {"device_allocated": 3 * 2**20, "device_peak": 5 * 2**20}


@pytest.mark.filterwarnings("ignore::meshtrain.strategies.zero.offload.OffloadNotice")
@pytest.mark.parametrize("zero", [1, 3])
def test_host_pinned_is_every_buffer_the_offload_pins(zero):
    """Beside a GPU, offload='cpu' pins the fp32 masters, the optimizer's per-element states,
    ZeRO-3's bf16 shards and the gradients' host buffers; host_pinned is their bytes. Pinning
    needs a GPU: here the slot is marked as it is beside one, once the steps are done (the
    gradient buffers exist only where gradients come from a GPU: tests/gpu)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    loss = lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())
    trainer = Trainer(model, Plan(zero=zero, offload="cpu", precision="bf16"), loss_fn=loss,
                      optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    x = torch.randint(0, 16, (4, 5), device="cpu")
    for _ in range(2):
        trainer.step(x, x)
    sync = trainer.data_parallel
    assert trainer.memory_report().host_pinned == 0   # a CPU-only machine pins nothing
    sync.offload.pinned = True
    states = [v for s in trainer.optimizer.state.values() for v in s.values() if v.dim() > 0]
    held = sync.masters.masters + states + (sync.shards if zero == 3 else [])
    assert trainer.memory_report().host_pinned == sum(t.numel() * t.element_size()
                                                      for t in held)
    assert len(states) == 2 * len(sync.masters.masters) and sync.masters.grad_buffers() == []


def test_the_summary_shows_gpu_memory_when_there_is_some(capsys):
    memory = dict(parameters=2**20, gradients=2**20, optimizer_states=2**21, activations=None,
                  peak_process=2**30, device_allocated=3 * 2**20, device_peak=5 * 2**20,
                  host_pinned=2**21, optimizer_on_host=2**21)
    summary = dict(plan="DDP dp=1", steps=1, resumed_from=0, train_loss_start=2.0,
                   train_loss_end=1.0, val_loss_start=2.0, val_loss_end=1.0,
                   tokens_per_s=1.0, median_step_s=1.0, first_step_after_s=1.0,
                   mfu=0.5, flops_per_token=1e9, peak_flops=1e12, peak_source="table",
                   bytes_sent_per_step=0, memory_per_rank=[memory, dict(memory, device_peak=None)],
                   run_dir="r", checkpoint="c")
    summary_module.print_summary(summary)
    out = capsys.readouterr().out
    assert "GPU rank 0   allocated 3.0 MiB, peak allocated 5.0 MiB; host pinned 2.0 MiB" in out
    # offload='cpu': the optimizer's states are counted, and said to be off the GPU
    assert "optimizer 2.0 MiB (2.0 MiB of it in host memory), activations" in out
    assert "GPU rank 1" not in out   # a CPU rank's summary is today's


def test_the_stopwatch_reads_the_host_clock_on_cpu_and_cuda_events_on_cuda(monkeypatch):
    """CPU: marks are host seconds since the start. CUDA (events mocked): one
    synchronisation at the start, none per mark, and a mark reads as the event's elapsed
    milliseconds from the start event, in seconds, once its event is waited for."""
    watch = dev.Stopwatch(torch.device("cpu"))
    watch.start()
    a, b = watch.mark(), watch.mark()
    assert 0 <= a <= b < 1 and watch.seconds(b) == b

    calls, device_ms = [], iter([0.0, 12.5, 40.0])   # the device's clock at each record

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
        def record(self):
            self.at = next(device_ms)
            calls.append("record")
        def synchronize(self):
            calls.append("wait")
        def elapsed_time(self, other):
            return other.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d: calls.append("sync"))
    watch = dev.Stopwatch(torch.device("cuda", 0))
    watch.start()
    first, second = watch.mark(), watch.mark()
    assert calls == ["sync", "record", "record", "record"]   # marking never waits
    assert watch.seconds(first) == pytest.approx(0.0125)
    assert watch.seconds(second) == pytest.approx(0.040)
    assert calls[4:] == ["wait", "wait"]


def test_meshtrains_processes_prefer_expandable_segments_unless_the_user_chose(monkeypatch):
    """The command and launch's ranks: expandable segments by default; a user's allocator
    settings are kept as given."""
    monkeypatch.delenv(dev.ALLOCATOR_ENV, raising=False)
    dev.prefer_expandable_segments()
    assert os.environ[dev.ALLOCATOR_ENV] == "expandable_segments:True"
    monkeypatch.setenv(dev.ALLOCATOR_ENV, "max_split_size_mb:128")
    dev.prefer_expandable_segments()
    assert os.environ[dev.ALLOCATOR_ENV] == "max_split_size_mb:128"
