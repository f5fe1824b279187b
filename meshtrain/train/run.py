"""One training run on the reference GPT: the job behind `meshtrain train`.

`train_rank(config)` runs on every rank (started by `meshtrain.launch` or by torchrun). A run
folder holds everything needed to understand and continue it:

    config.json       the RunConfig (resume reads it back), with the MFU peak the run used
    metrics.jsonl     one JSON object per step (loss, lr, tokens/s, bytes per mesh axis; with
                      --link the seconds the emulated link slept, link_s; on CUDA rank 0's
                      device_allocated and device_peak bytes) and per evaluation
    summary.json      the run's summary (what `meshtrain train` prints), written at its end
    checkpoints/      step_XXXXXXXX/ folders (atomic, see checkpoint.py) and `latest`
    trace.json        with --trace (pipeline): the last step's measured timeline per rank,
                      its bubble and theory's (report/trace.py); trace.chrome.json the same
                      for Perfetto; trace.png measured drawn under theory

The batch of step s depends only on (seed, s) and the learning rate only on s, so resuming
from the checkpoint of step s gives exactly the numbers an uninterrupted run gives.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from meshtrain.core.device import DeviceClock, device_memory, pin_host_batches
from meshtrain.core.flops import mfu, model_flops_per_token, run_peak
from meshtrain.core.link import LinkModel
from meshtrain.core.plan import Plan
from meshtrain.core.processes import process_start_time
from meshtrain.train.config import RunConfig, latest_checkpoint, learning_rate, write_latest
from meshtrain.data.sampler import BatchSampler, eval_batches
from meshtrain.data.source import check_fits, load_data
from meshtrain.models.experts import active_parameters
from meshtrain.models.pretrained import SafetensorsFolder, attach
from meshtrain.models.registry import build_model, token_cross_entropy
from meshtrain.strategies.compile import limit_compile_workers
from meshtrain.strategies.expert_parallel import ExpertParallel
from meshtrain.train import faults
from meshtrain.train.optimizers import run_optimizer
from meshtrain.train.trainer import Trainer


def train_rank(config: RunConfig) -> dict:
    """Train per `config` on this rank; returns the run summary (same on every rank)."""
    from meshtrain.launch import init_distributed

    if "RANK" in os.environ and not dist.is_initialized():
        init_distributed(config.collective_timeout, config.device)
    plan = Plan.from_dict(config.plan)
    if plan.compile_backend == "inductor":
        limit_compile_workers()   # after init_distributed set this rank's threads
    torch.manual_seed(config.seed)
    built = build_model(config.model, config.model_overrides, config.seq_len, on_meta=True)
    if config.init_from and not config.resume:   # each rank reads only what it keeps
        attach(built.module, SafetensorsFolder(config.init_from))
    seq_len = built.seq_len
    flops_tok = model_flops_per_token(built.module, seq_len,   # before any sharding
                                      n_params=active_parameters(built.module))
    corpus = load_data(config.data, getattr(getattr(built.module, "config", None),
                                            "vocab_size", None))   # ids it cannot embed: refused
    check_fits(corpus, seq_len)
    trainer, emulated = _build_trainer(config, plan, built)
    pin = pin_host_batches(trainer.mesh.device)   # batches a GPU copies without blocking
    sampler = BatchSampler(corpus.train, config.batch_size, seq_len, config.seed,
                           trainer.dp_rank, trainer.dp_size, pin_memory=pin,
                           weights=corpus.weights)
    val = eval_batches(corpus.val, max(1, config.batch_size // 2), seq_len, config.eval_batches,
                       pin_memory=pin)
    is_main = trainer.mesh.rank == 0
    metrics = _Metrics(Path(config.run_dir) / "metrics.jsonl", enabled=is_main,
                       tensorboard=config.tensorboard)

    peak = run_peak(trainer.mesh.device, plan.precision)
    config.peak_flops, config.peak_source = peak.flops, peak.source   # saved by _start_point
    start, first = _start_point(trainer, config, metrics, val)

    tokens_per_step = config.batch_size * seq_len

    def util(tok_s: float) -> float:   # MFU over every rank's device
        return mfu(tok_s, flops_tok, peak.flops, trainer.mesh.world_size)

    t_start = time.perf_counter()
    loss, step_times, step_bytes, first_step_s, load = _train_steps(
        trainer, config, sampler, val, metrics, start, first, util, emulated, corpus.fingerprint)
    if config.trace and plan.pp > 1:
        _save_trace(trainer, plan, config)

    final_val = trainer.evaluate(val)
    memory = trainer.comm.gather_objects(trainer.memory_report().to_dict(), tag="report")
    # each rank's peaks (building, training) beside what it accounts for
    metrics.write({"step": config.steps, "val_loss": final_val, "memory_per_rank": memory})
    metrics.close(memory, config.steps)
    trainer.close()   # offload's files go with the run
    median = _median_step(step_times)
    summary = {
        "run_dir": str(Path(config.run_dir).resolve()), "plan": plan.describe(),
        "steps": config.steps, "resumed_from": start, "restarts": faults.attempt(),
        "data": corpus.source,
        "train_loss_start": first.get("train_loss"), "train_loss_end": loss,
        "train_loss_parts_end": trainer.last_loss_parts,   # a mixture of experts' router loss
        "expert_load_end": load or None,   # its tokens per expert (ep), choices dropped
        "val_loss_start": first["val_loss"], "val_loss_end": final_val,
        "median_step_s": median, "tokens_per_s": tokens_per_step / median,
        "mfu": util(tokens_per_step / median), "flops_per_token": flops_tok,
        "peak_flops": peak.flops, "peak_source": peak.source,
        "first_step_after_s": first_step_s,
        "bytes_sent_per_step": sum(step_bytes) / max(1, len(step_bytes)), "memory_per_rank": memory,
        "wall_s": time.perf_counter() - t_start,
        "checkpoint": str(latest_checkpoint(Path(config.run_dir).resolve())),
        "link_emulation": emulated,
    }
    if is_main:
        (Path(config.run_dir) / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _train_steps(trainer: Trainer, config: RunConfig, sampler: BatchSampler, val, metrics,
                 start: int, first: dict, util: Callable[[float], float], emulated: str | None,
                 data_id: str):
    """Steps `start`..config.steps, each recorded in metrics.jsonl, with the run's evaluations
    and checkpoints; returns the last loss, each step's seconds and bytes sent, how long
    after the command started the first step was done, and the last step's expert load."""
    bar = _progress(start, config.steps, enabled=trainer.mesh.rank == 0 and config.progress)
    loss, first_step_s, load = float("nan"), float("nan"), {}
    tokens_per_step = config.batch_size * sampler.seq_len
    clock = DeviceClock(trainer.mesh.device)   # times the device's work, not its launches
    step_times, step_bytes = [], []
    for step in range(start, config.steps):
        faults.maybe_kill(trainer.mesh.rank, step, "step")
        lr = learning_rate(config, step)
        for group in trainer.optimizer.param_groups:
            group["lr"] = lr
        before, slept = _sent_by_axis(trainer), _link_seconds(trainer)
        t0 = clock.now()
        if config.straggler and trainer.mesh.rank == config.straggler[0]:
            trainer.pause(config.straggler[1])   # inside the step's time: a slow device
        trainer.comm.log.record_all = config.check_collectives and step == start
        loss = trainer.step(*sampler.batch(step))
        dt = clock.now() - t0
        if trainer.comm.log.record_all:   # outside the step's time: a check, not training
            check_same_collectives(trainer)
        step_times.append(dt)
        by_axis = {a: n - before.get(a, 0) for a, n in _sent_by_axis(trainer).items()}
        sent = sum(by_axis.values())
        step_bytes.append(sent)
        first.setdefault("train_loss", loss)
        load = expert_load(trainer)   # a mixture of experts under expert parallel
        record = {"step": step + 1, "loss": loss, **(trainer.last_loss_parts or {}), **load,
                  "lr": lr, "step_s": dt,
                  "tokens_per_s": tokens_per_step / dt, "mfu": util(tokens_per_step / dt),
                  "bytes_sent": sent, "bytes_by_axis": by_axis,
                  **({"windows": sampler.window_hash(step)} if metrics.enabled else {}),
                  **(device_memory(trainer.mesh.device) or {}),
                  **({"link_emulation": emulated,
                      "link_s": _link_seconds(trainer) - slept} if emulated else {})}
        if step == start:   # how long the user waited for training to start
            first_step_s = time.time() - (config.started_at or process_start_time())
            record["since_start_s"] = first_step_s
        metrics.write(record)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}")
        done = step + 1
        if done % config.eval_every == 0 and done < config.steps:
            metrics.write({"step": done, "val_loss": trainer.evaluate(val)})
        if done % config.ckpt_every == 0 or done == config.steps:
            _checkpoint(trainer, config, done, {"first": first, "data": dict(
                sampler.position(done), fingerprint=data_id)})
    bar.close()
    return loss, step_times, step_bytes, first_step_s, load


def expert_load(trainer: Trainer) -> dict:
    """The step's tokens per expert and their imbalance where experts are split
    (strategies/expert_parallel: the choices kept), and the choices dropped where a capacity
    factor limits them (models/experts.py); {} for neither."""
    load = (trainer.sharding.expert_load() if isinstance(trainer.sharding, ExpertParallel)
            else {})
    if trainer.capacity is not None:
        def over_replicas_and_stages(t: torch.Tensor) -> None:   # zeros: others' layers
            trainer.comm.all_reduce(t, "dp", tag="expert-drops")
            trainer.comm.all_reduce(t, "pp", tag="expert-drops")
        load |= trainer.capacity.drops(over_replicas_and_stages, trainer.mesh.device)
    return load


def _build_trainer(config: RunConfig, plan: Plan, built) -> tuple[Trainer, str | None]:
    """The run's Trainer (its optimizer at the run's learning rate), and the emulated link's label
    where the run emulates one."""
    if plan.offload == "disk" and plan.offload_dir is None:   # the run folder's, wherever it is
        plan = dataclasses.replace(plan, offload_dir=str(Path(config.run_dir) / "offload"))
    trainer = Trainer(built.module, plan, optimizer=lambda ps: run_optimizer(
        ps, config.optimizer, config.lr, config.weight_decay, config.momentum),
        loss_fn=token_cross_entropy if config.loss == "cross-entropy" else built.loss)
    if not config.link:
        return trainer, None
    # sleeps the modelled time of each accounted call: emulation, labelled in every output
    trainer.comm.link = LinkModel.from_spec(config.link)
    return trainer, trainer.comm.link.describe()


def _start_point(trainer: Trainer, config: RunConfig, metrics, val) -> tuple[int, dict]:
    """The step to start from and the run's first figures: a checkpoint's when resuming or
    restarted after a failure, else step 0 with the untrained validation loss."""
    start, first = 0, {}
    restarted = faults.attempt() > 0   # the elastic agent restarted the group after a failure
    ckpt = latest_checkpoint(config.run_dir) if config.resume or restarted else None
    if ckpt is not None:
        extra = trainer.load(ckpt)
        start, first = trainer.steps_done, extra.get("first", {})
    if ckpt is not None or restarted or config.resume:   # steps past the checkpoint redone
        metrics.truncate_after(start if ckpt is not None else -1)
    if trainer.mesh.rank == 0:   # only now: a refused checkpoint leaves the run folder as it was
        config.save()
    if not first:
        first = {"val_loss": trainer.evaluate(val)}
        metrics.write({"step": 0, "val_loss": first["val_loss"]})
    return start, first


def _median_step(step_times: list[float]) -> float:
    timed = step_times[min(3, len(step_times) // 2):]  # skip warm-up steps
    return sorted(timed)[len(timed) // 2] if timed else float("nan")


def _save_trace(trainer: Trainer, plan: Plan, config: RunConfig) -> None:
    """The last step's trace of the pipeline holding rank 0 (report/trace.py), written by
    rank 0 into the run folder. Collective: every rank sends its record."""
    import socket

    from meshtrain.report.trace import rank_record, save_trace, trace_document

    record = rank_record(trainer.driver.trace, trainer.driver.rank, socket.gethostname())
    records = trainer.comm.gather_objects(record, tag="trace")
    if trainer.mesh.rank == 0:
        pipeline = [records[trainer.mesh.global_rank("pp", r)] for r in range(plan.pp)]
        doc = trace_document(pipeline, plan.schedule, plan.microbatches, plan.virtual_stages,
                             step=trainer.steps_done)
        paths = save_trace(doc, config.run_dir)
        print(f"meshtrain train: trace of step {trainer.steps_done}: measured bubble "
              f"{doc['measured']['bubble']:.4f}, theory {doc['theory']['bubble']:.4f} "
              f"({doc['theory']['formula']} = {doc['theory']['formula_bubble']:.4f}); "
              f"{paths['png']}, {paths['chrome']}", file=sys.stderr)


def check_same_collectives(trainer: Trainer) -> None:
    """--check-collectives: the ranks of each pipeline stage made the same collective calls
    in the first step (op, axis, shape, dtype); raise naming the first difference."""
    from meshtrain.core.watchdog import CollectiveMismatch, first_difference

    log = trainer.comm.log
    log.record_all = False
    calls = trainer.comm.gather_objects({"pp": trainer.mesh.axis_rank("pp"),
                                         "calls": log.all_calls}, tag="check")
    log.all_calls = []
    for stage in sorted({c["pp"] for c in calls}):
        ranks = [r for r, c in enumerate(calls) if c["pp"] == stage]
        difference = first_difference([calls[r]["calls"] for r in ranks], ranks)
        if difference:
            raise CollectiveMismatch(f"--check-collectives: the ranks {ranks} made different "
                                     f"collective calls in the first step: {difference}")


def _sent_by_axis(trainer: Trainer) -> dict[str, int]:
    """Bytes this rank has sent so far, per axis the counters know (mesh axes, "world")."""
    stats = trainer.comm.stats
    return {axis: stats.total(axis=axis).sent for axis in sorted({a for a, _, _ in stats.counters})}


def _link_seconds(trainer: Trainer) -> float:
    """Seconds the emulated link has slept on this rank so far, every axis (0 without one)."""
    link = trainer.comm.link
    return sum(link.charged.values()) if link is not None else 0.0


def _checkpoint(trainer: Trainer, config: RunConfig, step: int, extra: dict) -> None:
    name = f"step_{step:08d}"
    trainer.save(Path(config.run_dir) / "checkpoints" / name, extra=extra)
    if trainer.mesh.rank == 0:
        write_latest(config.run_dir, name)
        folders = sorted((Path(config.run_dir) / "checkpoints").glob("step_*"))
        complete = [f for f in folders if re.fullmatch(r"step_\d{8}", f.name)]
        for old in complete[:-2] + [f for f in folders if f not in complete]:
            shutil.rmtree(old, ignore_errors=True)  # keep the last two; drop what a kill left


class _Metrics:
    """metrics.jsonl (rank 0), and the same records as TensorBoard events if asked."""

    def __init__(self, path: Path, enabled: bool, tensorboard: bool = False) -> None:
        self.path, self.enabled = path, enabled
        self.tensorboard = None
        if enabled and tensorboard:
            from meshtrain.train.tensorboard import TensorBoardLog
            self.tensorboard = TensorBoardLog(path.parent)

    def truncate_after(self, step: int) -> None:
        if self.enabled and self.path.exists():
            keep = [line for line in self.path.read_text().splitlines()
                    if _record_step(line) <= step]
            self.path.write_text("".join(line + "\n" for line in keep))

    def write(self, record: dict) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            self.tensorboard.write(record)

    def close(self, memory_per_rank: list[dict], step: int) -> None:
        if self.tensorboard is not None:
            self.tensorboard.write_memory(memory_per_rank, step)
            self.tensorboard.close()


def _record_step(line: str) -> float:
    """The step of one metrics line; infinity for a line a killed rank left half-written."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


def _progress(start: int, total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step", disable=not enabled,
                file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
