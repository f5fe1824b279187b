"""`meshtrain plan --verify`: run plans the Trainer supports for real, compare with the model.

Each plan trains meshtrain's GPT on local ranks for a few steps; every rank reports the
Trainer's exact model-state bytes (parameters, gradients, optimizer states from tensor
storages), the bytes autograd saved for backward, its step time, and two peaks:
- peak alloc: the most bytes of live tensors during a step, exact: the model states at the
  step's start plus the highest running sum of the CPU allocator's allocations and frees
  over one more step recorded by torch.profiler (profile_memory); it checks the derived
  part of the memory model (states, activations, backward's transients);
- peak RSS: the growth of the rank's anonymous resident memory (heap, arenas, thread
  stacks; library code pages left out) from just before the model is built to the end of
  the timed steps, from the kernel's high-water mark (`ResidentPeak`): what the OS must
  provide. The planner predicts it as peak alloc plus the runtime memory calibrated on
  this machine.
The step time is the median of the timed steps after the warm-up. Beside them: the
planner's predictions from the calibrated profile (`--calibrate`) of the same world size.
Each strategy joins `PLANS` as it lands: a plan (Plan's fields) and the per-rank batch.
"""
from __future__ import annotations

import io
import os
import statistics
import sys
import tempfile
from contextlib import contextmanager

# (Plan fields, per-rank batch): DDP at several world sizes and batch sizes; ZeRO-1/2/3 with
# recomputation and disk offload; tensor parallel at tp 2 and 4 (every tp rank feeds the same
# batch); pipeline stages under 1F1B, GPipe and interleaved 1F1B (every stage is fed the same
# batch; memory is the busiest stage's). Sequence parallel is left out: the planner's activations for it (Korthikanti's 34/t)
# assume the column layers keep only their input's sequence slice and all-gather it again in
# backward, which meshtrain does not do.
PLANS = (({"dp": 1}, 8), ({"dp": 1, "microbatches": 2}, 16), ({"dp": 2}, 8),
         ({"dp": 2, "microbatches": 2}, 16), ({"dp": 4}, 4), ({"dp": 4}, 8),
         ({"dp": 2, "zero": 1}, 8), ({"dp": 2, "zero": 2, "microbatches": 2}, 16),
         ({"dp": 4, "zero": 2}, 8), ({"dp": 2, "zero": 3}, 8),
         ({"dp": 2, "zero": 3, "recompute": "full"}, 8),
         ({"dp": 2, "zero": 2, "offload": "disk"}, 8),
         ({"tp": 2}, 8), ({"tp": 4}, 8),
         ({"pp": 2, "microbatches": 4}, 8), ({"pp": 2, "microbatches": 4, "schedule": "gpipe"}, 8),
         ({"pp": 2, "microbatches": 4, "schedule": "interleaved", "virtual_stages": 2}, 8),
         # 2D plans on this machine's 4 ranks (3D needs 8: calibrate with --nproc 8 first)
         ({"dp": 2, "tp": 2, "zero": 1}, 8), ({"dp": 2, "pp": 2, "microbatches": 4}, 8),
         ({"pp": 2, "tp": 2, "microbatches": 4}, 8))


def world_of(plan: dict) -> int:
    from meshtrain.core.plan import Plan
    return Plan(**plan).world_size


def label(plan: dict, batch: int) -> str:
    from meshtrain.core.plan import Plan
    return f"{Plan(**plan).describe()[5:-1] or 'one process'}, batch {batch}/rank"
MODEL = dict(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=256)   # "small"
ROUNDS = 3      # runs of each plan, interleaved with the other plans'
LIMITS = {"model_states": 0.05, "peak_alloc": 0.15, "peak_rss": 0.15, "step": 0.30}  # the issue's


def verify_rank(model: dict, plan: dict, batch: int, steps: int = 5, warmup: int = 2,
                alloc: bool = True) -> dict:
    """One rank of one verification run: train, then report measured memory and time.
    (`calibrate` runs it too, to measure the runtime memory, with alloc=False.)"""
    import torch
    import torch.distributed as dist

    from meshtrain.bench.timing import time_each_step
    from meshtrain.core.plan import Plan
    from meshtrain.models.gpt import GPT, GPTConfig
    from meshtrain.train.trainer import Trainer

    torch.set_num_threads(1)
    meter = ResidentPeak()
    meter.start()
    torch.manual_seed(0)
    config = GPTConfig(**model)
    trainer = Trainer(GPT(config), Plan(**plan),
                      optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                      measure_activations=True)
    gen = torch.Generator().manual_seed(1 + trainer.dp_rank)
    tokens = torch.randint(0, config.vocab_size, (batch, config.seq_len + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    sync = dist.barrier if dist.is_initialized() else (lambda: None)
    for _ in range(warmup):   # the first steps build gradients, optimizer states, heap
        sync()
        trainer.step(x, y)
    times = time_each_step(lambda: trainer.step(x, y), steps, sync, wait_for_all=False)
    peak = meter.stop()
    report = trainer.memory_report()
    # after the RSS window: the profiler's own records would inflate the resident memory
    peak_alloc = report.model_states + allocated_peak(lambda: trainer.step(x, y)) if alloc else 0
    trainer.close()
    return {"step": statistics.median(times), "peak_growth": peak,
            "peak_alloc": peak_alloc, **report.to_dict()}


def allocated_peak(fn) -> int:
    """Highest bytes of tensors allocated and not yet freed while `fn()` runs, above what was
    live before it: the running sum of the CPU allocator's [memory] events (torch.profiler
    with profile_memory), which see every tensor and kernel workspace the allocator serves."""
    from torch.profiler import ProfilerActivity, profile

    with _without_profiler_banner(), profile(activities=[ProfilerActivity.CPU],
                                             profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


@contextmanager
def _without_profiler_banner():
    """The profiler (kineto) writes "USDT: ... profiler_start/stop" lines on the process's C
    stderr each time it runs; drop those, pass anything else through."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            for line in captured.read().decode(errors="replace").splitlines(keepends=True):
                if not line.startswith(("USDT:", "STAGE:")):
                    sys.stderr.write(line)


class ResidentPeak:
    """Peak growth of this process's anonymous resident memory (heap: tensors and the
    allocator's arenas) over a window, from the kernel's own high-water mark, which sees
    every page however briefly it was resident (a poller sampling /proc misses short peaks,
    and on oversubscribed cores its thread slows the step it watches).

    Linux: writing 5 to /proc/self/clear_refs resets VmHWM (the peak resident set) to the
    current resident set. At the end, the peak resident set less the file-backed and shared
    pages resident then (library code the first steps touched, which stays) is the peak of
    the anonymous part."""

    def start(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError as exc:
            raise OSError(f"cannot reset this process's peak resident memory through "
                          f"/proc/self/clear_refs ({exc}): --verify measures peak memory on "
                          f"Linux only") from None
        self.base = self._status()["RssAnon"]

    def stop(self) -> int:
        s = self._status()
        return max(0, s["VmHWM"] - s["RssFile"] - s.get("RssShmem", 0) - self.base)

    @staticmethod
    def _status() -> dict[str, int]:
        fields = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    fields[key] = int(value.split()[0]) * 1024
        return fields


def predict(profile: dict, plan: dict, batch: int, model: dict = MODEL):
    from meshtrain.core.plan import Plan
    from meshtrain.models.gpt import GPTConfig
    from meshtrain.planner.advisor import evaluate
    from meshtrain.planner.model_spec import from_gpt_config
    from meshtrain.planner.profile import cluster_from_profile
    from meshtrain.planner.setup import Candidate, Setup

    p = Plan(**plan)
    spec = from_gpt_config(GPTConfig(**model), "gpt")
    micro = batch // p.microbatches
    setup = Setup(global_batch=p.dp * batch, micro_batch=micro, precision=p.precision,
                  optimizer="adam", recompute=p.recompute,
                  sequence_parallel=p.sequence_parallel)
    cand = Candidate(p, micro, p.recompute, p.sequence_parallel)
    return evaluate(spec, cand, setup, cluster_from_profile(profile, p.world_size))


def _err(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas else float("inf")


def verify(profile: dict, plans=PLANS, steps: int = 5, out=sys.stdout, model: dict = MODEL,
           warmup: int = 2, rounds: int = ROUNDS, progress: bool = False) -> list[dict]:
    """Run every plan `rounds` times, the rounds interleaved (all plans, then all again), so
    that a slow phase of the machine lands on one round of a plan, not on all of them; the
    step time and resident peak are medians over rounds (each round: the median step of
    the median rank, the peak of the highest rank). The exact quantities (model states,
    activations, allocated peak) come from the first round."""
    from tqdm import tqdm

    from meshtrain.launch import launch

    runs: list[list[list[dict]]] = [[] for _ in plans]
    with tqdm(total=rounds * len(plans), unit="run", desc="verifying", disable=not progress,
              file=sys.stderr) as bar:
        for r in range(rounds):
            for i, (plan, batch) in enumerate(plans):
                runs[i].append(launch(verify_rank, nproc=world_of(plan),
                                      args=(model, plan, batch, steps, warmup, r == 0)))
                bar.update()
    rows = []
    for (plan, batch), results in zip(plans, runs):
        first = results[0]
        step_rounds = [statistics.median(rank["step"] for rank in ranks) for ranks in results]
        rss_rounds = [max(rank["peak_growth"] for rank in ranks) for ranks in results]
        measured = {"model_states": max(r["model_states"] for r in first),
                    "activations": max(r["activations"] for r in first),
                    "peak_alloc": max(r["peak_alloc"] for r in first),
                    "peak_rss": statistics.median(rss_rounds),
                    "step": statistics.median(step_rounds)}
        ev = predict(profile, plan, batch, model)
        predicted = {"model_states": ev.mem.model_states, "activations": ev.mem.activations,
                     "peak_alloc": ev.mem.allocated, "peak_rss": ev.mem.total,
                     "step": ev.time.total}
        rows.append({"plan": label(plan, batch), "world": world_of(plan),
                     "predicted": predicted, "measured": measured,
                     "rounds": {"step": step_rounds, "peak_rss": rss_rounds},
                     "error": {k: _err(predicted[k], measured[k]) for k in predicted}})
        print(_row(rows[-1]), file=out, flush=True)
    return rows


COLUMNS = (("model_states", "model states MB", 1e6), ("activations", "activations MB", 1e6),
           ("peak_alloc", "peak alloc MB", 1e6), ("peak_rss", "peak RSS MB", 1e6),
           ("step", "step ms", 1e-3))
HEADER = (f"{'plan':<36}" + "".join(f" {title:>22}" for _, title, _ in COLUMNS)
          + f"\n{'':<36}" + f" {'pred / meas (err)':>22}" * len(COLUMNS))


def _row(row: dict) -> str:
    cells = []
    for key, _, scale in COLUMNS:
        p, m, e = row["predicted"][key], row["measured"][key], row["error"][key]
        cells.append(f"{p / scale:7.2f} /{m / scale:7.2f} ({e:+.0%})".rjust(22))
    return f"{row['plan']:<36} " + " ".join(cells)


def summary(rows: list[dict]) -> tuple[bool, str]:
    lines, ok = [], True
    for key, limit in LIMITS.items():
        worst = max(abs(r["error"][key]) for r in rows)
        passed = worst <= limit
        ok &= passed
        lines.append(f"  {key}: worst error {worst:.1%} (limit {limit:.0%}) "
                     f"{'PASS' if passed else 'FAIL'}")
    return ok, "\n".join(lines)


def verify_command(args) -> int:
    from meshtrain.planner.hardware import HardwareError
    from meshtrain.planner.profile import load_profile, profile_path
    profile = load_profile(args.profile)
    missing = sorted({world_of(p) for p, _ in PLANS} - {int(w) for w in profile["worlds"]})
    if missing:
        raise HardwareError(f"the profile {profile_path(args.profile)} has no measurements at "
                            f"{missing} ranks, which --verify runs; calibrate them with "
                            f"`meshtrain plan --calibrate --nproc {max(missing)}`")
    print(f"verifying {len(PLANS)} plans of meshtrain's GPT {MODEL} (AdamW), "
          f"{ROUNDS} rounds, against the profile of {profile['created']}", file=sys.stderr)
    table = io.StringIO()
    rows = verify(profile, out=table, progress=True)
    print(HEADER)
    print(table.getvalue(), end="")
    ok, text = summary(rows)
    print("\n" + text)
    print("peak alloc = live tensor bytes at the step's peak (model states + the profiler's allocator "
          "events), exact; peak RSS = growth of each rank's anonymous resident memory from just "
          "before the model is built to the end of the timed steps (the kernel's high-water mark); "
          "step = median of the timed steps after the warm-up.")
    if args.json:
        import json
        print(json.dumps(rows, indent=2))
    return 0 if ok else 1
