"""The data-parallel family side by side (`meshtrain bench dp`): DP with a master device, DDP,
the parameter server synchronous (one shard, N shards) and asynchronous, on the same model
and global batch; then asynchrony against a straggler; then the three all-reduces.

Per strategy and world N: the median step time; the bytes through the busiest rank per step
(sent + received, from the Comm counters: for DP the master's copies to and from its
replicas) and its messages (calls) per step; the model states (parameters, gradients,
optimizer) held by rank 0 (the master, the server) against the largest other rank (for DP:
one replica's parameters and gradients).

Straggler: rank N-1 is delayed every step. ps-sync and ps-async (staleness s) each train the
tiny GPT on the standard-library corpus for the same number of steps per worker (the same
samples), then ps-async again for ps-sync's wall time (fast workers run on); each run's loss
is the validation loss of its final parameters.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from meshtrain.bench.ddp import _adamw, _batch
from meshtrain.bench.device import basis_line, fence, flops_basis, throughput
from meshtrain.core.memory import storage_bytes
from meshtrain.core.plan import Plan
from meshtrain.models.gpt import GPT, gpt_config
from meshtrain.train.trainer import Trainer


def _plans(world: int, staleness: int) -> dict[str, Plan]:
    return {"DDP": Plan(dp=world),
            "ps-sync 1 shard": Plan(dp=world, dp_mode="ps-sync"),
            f"ps-sync {world} shards": Plan(dp=world, dp_mode="ps-sync", ps_shards=world),
            f"ps-async s={staleness}": Plan(dp=world, dp_mode="ps-async", staleness=staleness)}


def _measure(trainer: Trainer, x, y, steps: int, reps: int, warmup: int, sync) -> dict:
    """Median seconds per step over `reps` blocks of `steps` steps (a block ends when every
    rank is done, in-flight pushes included), and this rank's traffic per step."""
    settle = trainer.data_parallel.settle
    for _ in range(warmup):
        trainer.step(x, y)
    settle()
    stats, blocks = trainer.comm.stats, []
    stats.reset()
    traffic = None
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer.step(x, y)
        if traffic is None:   # before settle: its closing messages are no step's
            traffic = stats.total()
        settle()
        sync()
        blocks.append((time.perf_counter() - t0) / steps)
    states = trainer.memory_report()
    return {"step_s": statistics.median(blocks), "bytes": (traffic.sent + traffic.received) / steps,
            "messages": traffic.calls / steps,
            "model_states": states.parameters + states.gradients + states.optimizer_states}


def strategies_rank(model_name: str, global_batch: int, steps: int, reps: int, warmup: int,
                    staleness: int) -> dict:
    """On each rank: every multi-process strategy in turn (each on its own fresh model)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    x, y = _batch(model_name, global_batch)
    per = global_batch // world
    x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    out = {}
    for name, plan in _plans(world, staleness).items():
        torch.manual_seed(0)
        trainer = Trainer(GPT(gpt_config(model_name)), plan, optimizer=_adamw)
        out[name] = _measure(trainer, x, y, steps, reps, warmup, fence(x.device))
        trainer.data_parallel.remove_hooks()
        del trainer   # one model at a time in memory
    return {"rows": out, "basis": flops_basis(model_name, x.device)}


def master_dp_rank(model_name: str, global_batch: int, steps: int, reps: int, warmup: int,
                   replicas: int) -> dict:
    """One process, `replicas` threads (dp_mode="dp")."""
    x, y = _batch(model_name, global_batch)
    torch.manual_seed(0)
    trainer = Trainer(GPT(gpt_config(model_name)), Plan(dp=replicas, dp_mode="dp"),
                      optimizer=_adamw)
    out = _measure(trainer, x, y, steps, reps, warmup, fence(x.device, barrier=False))
    sync = trainer.data_parallel
    replica = [p for p in sync.replicas[1].parameters()]
    out["replica_states"] = storage_bytes(replica + [p.grad for p in replica if p.grad is not None])
    master = list(sync.replicas[0].parameters())
    out["model_states"] = (storage_bytes(master + [p.grad for p in master])
                           + sync.memory()["optimizer_states"])
    return out


# ---- asynchrony against a straggler ---------------------------------------------------------
def straggler_rank(world: int, steps: int, delay_s: float, staleness: int,
                   global_batch: int) -> dict:
    """ps-sync and ps-async for `steps` steps each, then ps-async for ps-sync's wall time."""
    from meshtrain.data.corpus import load_corpus
    from meshtrain.data.sampler import BatchSampler, eval_batches

    rank = dist.get_rank()
    corpus = load_corpus(None, max_bytes=2**20)
    seq = gpt_config("tiny").seq_len
    val = eval_batches(corpus.val, 16, seq, 4)

    def train(plan: Plan, budget_s: float | None) -> dict:
        torch.manual_seed(0)
        trainer = Trainer(GPT(gpt_config("tiny")), plan,
                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3))
        sampler = BatchSampler(corpus.train, global_batch, seq, 0, trainer.dp_rank,
                               trainer.dp_size)
        dist.barrier()
        t0, done = time.perf_counter(), 0
        while (budget_s is None and done < steps) or (
                budget_s is not None and time.perf_counter() - t0 < budget_s):
            if rank == world - 1:
                trainer.pause(delay_s)
            trainer.step(*sampler.batch(done))
            done += 1
        trainer.data_parallel.settle()                               # every push applied
        wall = time.perf_counter() - t0                              # ... on every rank
        loss = trainer.evaluate(val)
        pushes = trainer.comm.gather_objects(done, tag="report")
        record = getattr(trainer.data_parallel, "staleness_record", lambda: [])()
        return {"wall_s": wall, "val_loss": loss, "pushes": pushes,
                "max_staleness": max((s for _, _, s in record), default=0),
                "updates": trainer.data_parallel.server.version if rank == 0 else None}

    sync = train(Plan(dp=world, dp_mode="ps-sync"), None)
    asynchronous = Plan(dp=world, dp_mode="ps-async", staleness=staleness)
    return {"sync": sync, "async_same_samples": train(asynchronous, None),
            "async_same_time": train(asynchronous, sync["wall_s"])}


# ---- the whole benchmark --------------------------------------------------------------------
def run(worlds=(2, 4), model_name: str = "small", global_batch: int = 16, steps: int = 3,
        reps: int = 3, warmup: int = 2, staleness: int = 2, straggler_steps: int = 40,
        straggler_delay_s: float = 0.05, allreduce_reps: int = 5, progress=print) -> dict:
    from meshtrain.bench import collectives
    from meshtrain.launch import launch

    result = {"model": model_name, "global_batch": global_batch, "steps": steps, "reps": reps,
              "staleness": staleness, "worlds": {}}
    for world in worlds:
        progress(f"world {world}: DP (one process, {world} threads) ...")
        rows = {f"DP ({world} threads)": launch(master_dp_rank, 1, (
            model_name, global_batch, steps, reps, warmup, world))[0]}
        progress(f"world {world}: DDP, ps-sync (1 and {world} shards), ps-async ...")
        launched = launch(strategies_rank, world, (model_name, global_batch, steps, reps,
                                                   warmup, staleness))
        ranks, basis = [r["rows"] for r in launched], launched[0]["basis"]
        result["basis"] = basis
        for name in ranks[0]:
            per_rank = [r[name] for r in ranks]
            rows[name] = {"step_s": max(r["step_s"] for r in per_rank),
                          "bytes": max(r["bytes"] for r in per_rank),
                          "messages": max(r["messages"] for r in per_rank),
                          "model_states": per_rank[0]["model_states"],
                          "others_states": max(r["model_states"] for r in per_rank[1:])}
        dp = rows[f"DP ({world} threads)"]
        dp["others_states"] = dp.pop("replica_states")
        tokens = global_batch * gpt_config(model_name).seq_len
        for r in rows.values():   # DP's threads drive `world` devices too
            r.update(throughput(r["step_s"], tokens, basis, world))
        result["worlds"][world] = rows
    world = max(worlds)
    progress(f"world {world}: ps-sync vs ps-async s={staleness}, rank {world - 1} delayed "
             f"{straggler_delay_s * 1e3:.0f} ms every step ...")
    result["straggler"] = {"world": world, "delay_s": straggler_delay_s,
                           "steps": straggler_steps,
                           **launch(straggler_rank, world, (world, straggler_steps,
                                                            straggler_delay_s, staleness, 16))[0]}
    progress("all-reduce: our ring, our parameter server, c10d, 4 KiB .. 64 MiB ...")
    allreduce = collectives.run(worlds=worlds, reps=allreduce_reps, ops=("all_reduce",),
                                progress=progress)
    result["all_reduce"] = allreduce
    return result


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def format_report(result: dict) -> str:
    from meshtrain.bench import collectives

    lines = [f"model {result['model']} GPT, global batch {result['global_batch']}; step time: "
             f"median of {result['reps']} blocks of {result['steps']} steps; bytes and messages "
             "per step through the busiest rank; model states in MiB",
             f"{'N':>2} {'strategy':<22} {'step ms':>8} {'MiB/step':>9} {'msgs/step':>9} "
             f"{'rank 0 states':>13} {'others':>7} {'tokens/s':>9} {'MFU':>6}"]
    for world, rows in result["worlds"].items():
        for name, r in rows.items():
            lines.append(f"{world:>2} {name:<22} {r['step_s'] * 1e3:>8.0f} {_mib(r['bytes']):>9} "
                         f"{r['messages']:>9.1f} {_mib(r['model_states']):>13} "
                         f"{_mib(r['others_states']):>7} {r['tokens_per_s']:>9,.0f} "
                         f"{r['mfu']:>6.2%}")
    if "basis" in result:
        lines.append(basis_line(result["basis"]))
    s = result["straggler"]
    lines.append(f"\nstraggler: world {s['world']}, rank {s['world'] - 1} delayed "
                 f"{s['delay_s'] * 1e3:.0f} ms every step, tiny GPT, validation loss")
    lines.append(f"{'run':<30} {'wall s':>7} {'val loss':>9} {'pushes per rank':>22} "
                 f"{'updates':>8} {'max stale':>9}")
    for name, label in (("sync", f"ps-sync, {s['steps']} steps"),
                        ("async_same_samples", f"ps-async s={result['staleness']}, {s['steps']} steps"),
                        ("async_same_time", f"ps-async s={result['staleness']}, ps-sync's time")):
        r = s[name]
        lines.append(f"{label:<30} {r['wall_s']:>7.2f} {r['val_loss']:>9.4f} "
                     f"{str(r['pushes']):>22} {r['updates']:>8} {r['max_staleness']:>9}")
    lines.append("")
    lines.append(collectives.format_report(result["all_reduce"]))
    return "\n".join(lines)
