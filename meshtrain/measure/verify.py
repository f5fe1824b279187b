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
  the timed steps, from the kernel's high-water mark (`peaks.ResidentPeak`): what the OS
  must provide. On a CUDA rank, whose memory is the GPU's, the growth of what the caching
  allocator reserves on it over the same window (`peaks.DevicePeak`), reported as the peak
  device memory. The planner predicts it as peak alloc plus the runtime memory calibrated
  on this machine.
The step time is the median of the timed steps after the warm-up, and one more step is
counted: the bytes each rank sends on each mesh axis (Comm's counters). Beside them: the
planner's predictions from the calibrated profile (`--calibrate`) of the same world size.
Where ranks differ (pipeline stages, a parameter server's servers and workers) each role
is compared on its own row under the plan's, which shows the busiest. Each strategy joins
`PLANS` as it lands: a plan (Plan's fields) and the per-rank batch. On GPU ranks the plans
train a GPT sized for the GPU, in bf16, with fused AdamW (measure/runs.py), and both peaks
are held to GPU_LIMITS.
"""
from __future__ import annotations

import statistics
import sys

from tqdm import tqdm

import torch
import torch.distributed as dist

from meshtrain.bench.timing import time_each_step
from meshtrain.core.admit import check_plan
from meshtrain.core.device import rank_device
from meshtrain.core.plan import LOCAL_STEP_MODES, Plan, PlanError
from meshtrain.launch import LaunchError, launch
from meshtrain.measure.peaks import allocated_peak, peak_meter
from meshtrain.measure.runs import VERIFY_GPTS, optimizer, run_plan
from meshtrain.measure.trained_model import TrainedModel, build, spec_of
from meshtrain.planner.advisor import evaluate
from meshtrain.planner.memory import rank_role, role_memories
from meshtrain.planner.profile import cluster_from_profile
from meshtrain.planner.setup import Candidate, Setup
from meshtrain.planner.traffic import axis_bytes
from meshtrain.train.trainer import Trainer

# (Plan fields, per-rank batch): DDP at several world sizes and batch sizes; ZeRO-1/2/3 with
# recomputation and disk offload; tensor parallel at tp 2 and 4 (every tp rank feeds the same
# batch), with sequence parallel at tp 2; pipeline stages under 1F1B, GPipe and interleaved
# 1F1B (every stage is fed the same batch; memory is the busiest stage's).
PLANS = (({"dp": 1}, 8), ({"dp": 1, "microbatches": 2}, 16),
         # one rank's other plans (on one GPU, what verify can run): batch, recomputation
         ({"dp": 1}, 4), ({"dp": 1}, 16), ({"dp": 1, "recompute": "full"}, 8),
         ({"dp": 1, "recompute": "selective"}, 8),
         ({"dp": 1, "recompute": "full", "recompute_every": 2}, 8),
         ({"dp": 1, "microbatches": 4}, 16), ({"dp": 2}, 8),
         ({"dp": 2, "microbatches": 2}, 16), ({"dp": 4}, 4), ({"dp": 4}, 8),
         ({"dp": 2, "zero": 1}, 8), ({"dp": 2, "zero": 2, "microbatches": 2}, 16),
         ({"dp": 4, "zero": 2}, 8), ({"dp": 2, "zero": 3}, 8),
         ({"dp": 2, "zero": 3, "recompute": "full"}, 8),
         ({"dp": 2, "zero": 2, "offload": "disk"}, 8),
         ({"tp": 2}, 8), ({"tp": 4}, 8), ({"tp": 2, "sequence_parallel": True}, 8),
         ({"pp": 2, "microbatches": 4}, 8), ({"pp": 2, "microbatches": 4, "schedule": "gpipe"}, 8),
         ({"pp": 2, "microbatches": 4, "schedule": "interleaved", "virtual_stages": 2}, 8),
         # 2D plans on this machine's 4 ranks (3D needs 8: calibrate with --nproc 8 first)
         ({"dp": 2, "tp": 2, "zero": 1}, 8), ({"dp": 2, "pp": 2, "microbatches": 4}, 8),
         # dp over interleaved stages: DDP launches a chunk's buckets once its last backward
         # ran, ZeRO-2 reduces the chunk each backward reached
         *(({"dp": 2, "pp": 2, "microbatches": 4, "schedule": "interleaved",
             "virtual_stages": 2, "zero": z}, 8) for z in (0, 2)),
         ({"pp": 2, "tp": 2, "microbatches": 4}, 8),
         # the data-parallel family: a parameter server with one root, with 2 shards over 4
         # ranks (servers and workers differ), and DP's one process with 2 replicas
         ({"dp": 2, "dp_mode": "ps-sync"}, 8), ({"dp": 4, "dp_mode": "ps-sync", "ps_shards": 2}, 4),
         ({"dp": 2, "dp_mode": "dp"}, 8),
         # over slow links: DiLoCo and local SGD (a round of 4 steps: timed, counted and
         # peaked whole), PowerSGD's rank-4 factors
         ({"dp": 2, "dp_mode": "diloco", "sync_every": 4}, 8),
         ({"dp": 2, "dp_mode": "local-sgd", "sync_every": 4}, 8),
         ({"dp": 2, "compression": "powersgd", "compression_rank": 4}, 8))
# context parallel, each style, and expert parallel alone and under stages (on a mixture of
# experts' --model, e.g. gpt-moe-tiny):
# verified as the plans above once check_plan accepts them (their strategies landed), until
# then named with its refusal (`waits_for_strategy`)
BUILDING = (({"cp": 2}, 8), ({"cp": 2, "cp_style": "all-to-all"}, 8), ({"dp": 2, "ep": 2}, 8),
            ({"dp": 2, "ep": 2, "pp": 2, "microbatches": 4}, 8))
AXES = ("dp", "tp", "pp", "cp", "ep")   # the mesh axes bytes are counted and predicted on


def world_of(plan: dict) -> int:
    return Plan(**plan).world_size


def label(plan: dict, batch: int) -> str:
    return f"{Plan(**plan).describe()[5:-1] or 'one process'}, batch {batch}/rank"
MODEL = VERIFY_GPTS["cpu"]   # "small"; a GPU's: VERIFY_GPTS["cuda"] (runs.py)
ROUNDS = 3      # runs of each plan, interleaved with the other plans'
STEPS, WARMUP = 5, 2   # timed steps of each run, after its warm-up steps
# the acceptance of issue 16 (model states 2%, resident peak 10%, step 15%); the allocated
# peak, a derived quantity it does not name, is held to 15%, the bytes sent (exact counters
# against ring theory; the statistics' few bytes left out) to 2%
LIMITS = {"model_states": 0.02, "peak_alloc": 0.15, "peak_rss": 0.10, "step": 0.15,
          "sent": 0.02}
# on a GPU both peaks are the caching allocator's own counts, with no shared heap's noise:
# held to 5% (the step to 15%, as on CPU ranks)
GPU_LIMITS = {**LIMITS, "peak_alloc": 0.05, "peak_rss": 0.05}


def verify_rank(model: dict | TrainedModel, plan: dict, batch: int, steps: int = STEPS,
                warmup: int = WARMUP, exact: bool = True) -> dict:
    """One rank of one verification run: train, then report measured memory and time, and
    with `exact` the quantities one round suffices for: the allocated peak and the bytes
    sent per axis, each from one more step (None without). `calibrate` runs it too, for
    the runtime memory and the strategies' costs, with exact=False."""
    torch.set_num_threads(1)
    meter = peak_meter(rank_device())   # the device the Trainer's mesh takes
    meter.start()
    torch.manual_seed(0)
    module, loss_fn, vocab, seq = build(model)
    trainer = Trainer(module, Plan(**plan, measure_activations=True),
                      optimizer=optimizer(rank_device().type), loss_fn=loss_fn)
    gen = torch.Generator().manual_seed(1 + trainer.dp_rank)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    device = trainer.mesh.device   # the batch's copy to the device is the caller's
    x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    sync = dist.barrier if dist.is_initialized() else (lambda: None)
    for _ in range(warmup):   # the first steps build gradients, optimizer states, heap
        sync()
        trainer.step(x, y)
    # DiLoCo and local SGD sync every H steps: any H consecutive steps hold one sync, so
    # the step is timed, counted and peaked over whole rounds of H (the planner amortises)
    every = trainer.plan.sync_every if trainer.plan.dp_mode in LOCAL_STEP_MODES else 1
    times = time_each_step(lambda: trainer.step(x, y), max(1, steps // every) * every, sync,
                           wait_for_all=False)
    rounds = [sum(times[i:i + every]) / every for i in range(0, len(times), every)]
    peak = meter.stop()

    def one_round():
        for _ in range(every):
            trainer.step(x, y)
    report = trainer.memory_report()
    peak_alloc = sent = None
    # after the peak's window: the profiler's own records would inflate the resident memory,
    # and on CUDA allocated_peak resets the peak statistics the window reads. DP's copies
    # never leave its process, and the profiler sees this thread's allocations only, not
    # its replicas' threads'
    if exact and plan.get("dp_mode") != "dp":
        trainer.comm.stats.reset()   # one more step (round), counted
        one_round()
        sent = {axis: trainer.comm.stats.total(axis=axis).sent / every for axis in AXES}
        # expert parallel's edp groups are subgroups of dp: their gradients count as dp's;
        # cp's gradients travel over the flattened dp x cp (core/mesh.py), which the planner
        # prices as the data-parallel axis of a cp rank's view
        sent["dp"] += sum(trainer.comm.stats.total(axis=axis).sent
                          for axis in ("edp", "dp_cp")) / every
        peak_alloc = report.model_states + allocated_peak(one_round, device)
    trainer.close()
    role = rank_role(Plan(**plan), dist.get_rank() if dist.is_initialized() else 0)
    return {"step": statistics.median(rounds), "peak_growth": peak,
            "peak_alloc": peak_alloc, "role": role, "sent": sent, **report.to_dict()}


def plan_inputs(plan: dict, batch: int, model: dict | TrainedModel = MODEL):
    """(spec, candidate, setup) the planner judges `plan` with, `batch` sequences per rank
    (DP's one process takes them all and splits them over its replicas)."""
    p = Plan(**plan)
    spec = spec_of(model)
    micro = batch // p.microbatches
    setup = Setup(global_batch=p.mesh_dp * batch, micro_batch=micro, precision=p.precision,
                  optimizer="adam", recompute=p.recompute,
                  sequence_parallel=p.sequence_parallel)
    return spec, Candidate(p, micro, p.recompute, p.sequence_parallel), setup


def profile_world(plan: dict) -> int:
    """The calibrated world size that prices `plan`: its ranks; DP's replicas run as threads
    of one process, one per core share, as that many ranks would."""
    p = Plan(**plan)
    return p.dp if p.dp_mode == "dp" else p.world_size


def predict_cluster(profile: dict, plan: dict):
    """The calibrated cluster of the plan's ranks (`profile_world`)."""
    return cluster_from_profile(profile, profile_world(plan))


def predict(profile: dict, plan: dict, batch: int, model: dict | TrainedModel = MODEL):
    return evaluate(*plan_inputs(plan, batch, model), predict_cluster(profile, plan))


def predict_roles(profile: dict, plan: dict, batch: int,
                  model: dict | TrainedModel = MODEL) -> dict:
    """The memory each role of `plan` (memory.rank_role) needs, predicted."""
    spec, cand, setup = plan_inputs(plan, batch, model)
    cluster = predict_cluster(profile, plan)
    return role_memories(spec, cand, setup, **cluster.memory_terms(cand.plan))


def _err(pred: float, meas: float | None) -> float | None:
    """Relative error; None where the run could not measure the quantity."""
    if meas is None:
        return None
    if not meas:   # nothing measured (bytes sent by one process): right only if none predicted
        return 0.0 if not pred else float("inf")
    return (pred - meas) / meas


def verify(profile: dict, plans=PLANS, steps: int = STEPS, out=sys.stdout,
           model: dict | TrainedModel = MODEL, warmup: int = WARMUP, rounds: int = ROUNDS,
           progress: bool = False, failed: list | None = None) -> list[dict]:
    """Run every plan `rounds` times, the rounds interleaved (all plans, then all again), so
    that a slow phase of the machine lands on one round of a plan, not on all of them; the
    step time and resident peak are medians over rounds (each round: the median step of
    the median rank, the peak of the highest rank). The exact quantities (model states,
    activations, allocated peak) come from the first round. A plan whose first run fails
    gets no row: it is printed, and added to `failed` as (plan, whether the Trainer refused
    it, the rank's error), and the other plans go on."""
    runs: list[list[list[dict]]] = [[] for _ in plans]
    with tqdm(total=rounds * len(plans), unit="run", desc="verifying", disable=not progress,
              file=sys.stderr) as bar:
        for r in range(rounds):
            for i, (plan, batch) in enumerate(plans):
                if r == 0 or runs[i]:   # a plan whose first run failed is not run again
                    runs[i] += _run(model, plan, batch, (steps, warmup, r == 0), failed, out)
                bar.update()
    rows = []
    for (plan, batch), results in ((pb, rs) for pb, rs in zip(plans, runs) if rs):
        ev = predict(profile, plan, batch, model)
        row = _compare(label(plan, batch), results, ev.mem, ev.time.total,
                       predict_sent(plan, batch, model))
        row["world"] = world_of(plan)
        roles = sorted({r["role"] for r in results[0]})
        if len(roles) > 1:   # ranks that differ are reported apart (pipeline stages, servers)
            predicted = predict_roles(profile, plan, batch, model)
            row["roles"] = [_compare(role, [[r for r in ranks if r["role"] == role]
                                            for ranks in results], predicted[role],
                                     ev.time.total, predict_sent(plan, batch, model, role))
                            for role in roles]
            # the plan's row: the most any role needs of each quantity. Measured, the row
            # already holds it over every rank (the resident peak per round, then the median
            # over rounds, as its `rounds` show; a max of the roles' medians could mix rounds)
            for key in ("model_states", "activations", "peak_alloc", "peak_rss"):
                row["predicted"][key] = _max_measured(sub["predicted"][key]
                                                      for sub in row["roles"])
                row["error"][key] = _err(row["predicted"][key], row["measured"][key])
        rows.append(row)
        print(_row(row), file=out, flush=True)
        for sub in row.get("roles", ()):
            print(_row({**sub, "plan": f"  - {sub['plan']}"}), file=out, flush=True)
    return rows


def _run(model, plan: dict, batch: int, how: tuple, failed: list | None, out) -> list:
    """[one run's ranks' results], or [] where a rank raised: a Trainer's refusal of the
    plan for this model (PlanError: a model without what the plan needs) or a failure."""
    try:
        return [launch(verify_rank, nproc=world_of(plan), args=(model, plan, batch, *how))]
    except LaunchError as err:
        first = err.first_raised() or {"type": "", "message": str(err).splitlines()[0]}
        refused = first["type"] == "PlanError"
        print(f"{label(plan, batch):<36} {'refused' if refused else 'FAILED'}: "
              f"{first['message'].splitlines()[0]}", file=out, flush=True)
        if failed is not None:
            failed.append((label(plan, batch), refused, first["message"]))
        return []


def _max_measured(values) -> float | None:
    values = list(values)
    return None if None in values else max(values)


def _compare(name: str, results: list[list[dict]], mem, step: float,
             sent: dict[str, float] | None) -> dict:
    """One row: these ranks' measurements (`results`: per round, the ranks) against the
    predicted memory and step. Exact quantities from the first round; the step time and the
    resident peak the median over rounds of the median rank's and the highest rank's."""
    first = results[0]
    step_rounds = [statistics.median(rank["step"] for rank in ranks) for ranks in results]
    rss_rounds = [max(rank["peak_growth"] for rank in ranks) for ranks in results]
    measured = {"model_states": max(r["model_states"] for r in first),
                "activations": _max_measured(r["activations"] for r in first),
                "peak_alloc": _max_measured(r["peak_alloc"] for r in first),
                "peak_rss": statistics.median(rss_rounds),
                "step": statistics.median(step_rounds)}
    predicted = {"model_states": mem.model_states, "activations": mem.activations,
                 "peak_alloc": mem.allocated, "peak_rss": mem.total, "step": step}
    # bytes sent per step, per axis: the busiest rank's on each (exact counters, one round)
    by_axis = None if sent is None or first[0]["sent"] is None else {
        axis: max(r["sent"][axis] for r in first) for axis in AXES}
    predicted["sent"] = None if by_axis is None else sum(sent.values())
    measured["sent"] = None if by_axis is None else sum(by_axis.values())
    errors = {k: (None if predicted[k] is None else _err(predicted[k], measured[k]))
              for k in predicted}
    return {"plan": name, "predicted": predicted, "measured": measured,
            "sent_by_axis": {"predicted": sent, "measured": by_axis},
            "rounds": {"step": step_rounds, "peak_rss": rss_rounds}, "error": errors}


def predict_sent(plan: dict, batch: int, model: dict | TrainedModel = MODEL,
                 role: str | None = None) -> dict[str, float] | None:
    """Bytes per axis a rank of `role` (None: the busiest) sends per step, predicted; None
    for DP, whose copies never leave its one process."""
    spec, cand, setup = plan_inputs(plan, batch, model)
    if cand.plan.dp_mode == "dp":
        return None
    stage = None
    if role and role.startswith("stage "):
        stage = int(role.split(",")[0].split()[1])
    return {axis: axis_bytes(spec, cand, setup, stage, server=not (role or "").endswith("worker")
                             ).get(axis, 0.0) for axis in AXES}


COLUMNS = (("model_states", "model states MB", 1e6), ("activations", "activations MB", 1e6),
           ("peak_alloc", "peak alloc MB", 1e6), ("peak_rss", "peak RSS MB", 1e6),
           ("step", "step ms", 1e-3), ("sent", "sent MB/step", 1e6))


def header(device: str = "cpu") -> str:
    """The table's two header lines; on CUDA the resident peak is the GPU's, titled so (the
    rows' key stays "peak_rss")."""
    titles = ["peak device MB" if key == "peak_rss" and device == "cuda" else title
              for key, title, _ in COLUMNS]
    return (f"{'plan':<36}" + "".join(f" {title:>22}" for title in titles)
            + f"\n{'':<36}" + f" {'pred / meas (err)':>22}" * len(COLUMNS))


HEADER = header()
# what the memory columns measure, by device
LEGEND = {"cpu": "peak alloc = live tensor bytes at the step's peak (model states + the profiler's "
                 "allocator events), exact; peak RSS = growth of each rank's anonymous resident "
                 "memory from just before the model is built to the end of the timed steps (the "
                 "kernel's high-water mark)",
          "cuda": "peak alloc = live tensor bytes at the step's peak (model states + the caching "
                  "allocator's peak allocated), exact; peak device = growth of the GPU memory each "
                  "rank's caching allocator reserves from just before the model is built to the "
                  "end of the timed steps (its peak reserved; the CUDA context and NCCL's own "
                  "buffers are outside it)"}


def _row(row: dict) -> str:
    cells = []
    for key, _, scale in COLUMNS:
        p, m, e = row["predicted"][key], row["measured"][key], row["error"][key]
        if p is None:   # DP: nothing leaves its one process
            cells.append("- / -".rjust(22))
        elif m is None:   # e.g. DP's replicas run in threads the activation count cannot see
            cells.append(f"{p / scale:7.2f} /      - (   )".rjust(22))
        else:
            cells.append(f"{p / scale:7.2f} /{m / scale:7.2f} ({e:+.0%})".rjust(22))
    return f"{row['plan']:<36} " + " ".join(cells)


def summary(rows: list[dict], limits: dict = LIMITS) -> tuple[bool, str]:
    """Each quantity's worst error over every plan and every role of a plan, against
    `limits` (GPU_LIMITS on GPU ranks)."""
    lines, ok = [], True
    every = [r for row in rows for r in (row, *row.get("roles", ()))]
    for key, limit in limits.items():
        worst = max(abs(r["error"][key]) for r in every if r["error"][key] is not None)
        passed = worst <= limit
        ok &= passed
        lines.append(f"  {key}: worst error {worst:.1%} (limit {limit:.0%}) "
                     f"{'PASS' if passed else 'FAIL'}")
    return ok, "\n".join(lines)


def needs_experts(plan: dict, model: dict | TrainedModel) -> bool:
    """An ep plan for a model without experts: nothing for expert parallel to split (the
    Trainer refuses it); verify runs it on a mixture of experts' --model only."""
    return Plan(**plan).ep > 1 and not spec_of(model).experts


def waits_for_strategy(plan: dict) -> str | None:
    """Why one of verify's cp or ep plans cannot run yet (check_plan's refusal); None for
    the others, and for these once their strategies are built: then they run as the rest."""
    p = Plan(**plan)
    if p.cp == 1 and p.ep == 1:
        return None
    try:
        check_plan(p)
    except PlanError as exc:
        return str(exc)
    return None


def runs_in_its_precision(plan: dict) -> bool:
    """Whether `plan` runs as `run_plan` made it: in bf16 on a GPU, the data-parallel family
    but DDP (DP, parameter servers, DiLoCo, local SGD, PowerSGD) is refused (fp32 only)."""
    try:
        check_plan(Plan(**plan))
    except PlanError:
        return False
    return True
