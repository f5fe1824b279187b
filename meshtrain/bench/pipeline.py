"""Pipeline schedules measured on local ranks: a model whose layers take a fixed time
(models/spin.py, one layer per stage or chunk) trained a few steps under each schedule;
each step's trace (report/trace.py) gives the measured bubble beside theory's.

`measure_rank` runs on every rank of a pp-rank world; `measure` launches it."""
from __future__ import annotations

import torch
import torch.distributed as dist

WIDTH = 8


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def measure_rank(cases: list[tuple[str, int, int]], seconds: float, steps: int,
                 input_s: float | None = None, weight_s: float | None = None) -> list:
    """Per (schedule, M, V): each step's trace record of this rank (report/trace.py). A
    stage costs `seconds` forward, `input_s` + `weight_s` backward (models/spin.py)."""
    from meshtrain.bench.device import bench_device
    from meshtrain.core.plan import Plan
    from meshtrain.train.trainer import Trainer
    from meshtrain.models.spin import spin_pipe
    from meshtrain.report.trace import rank_record

    pp, out = dist.get_world_size(), []
    for schedule, m, v in cases:
        torch.manual_seed(0)
        trainer = Trainer(spin_pipe(pp * v, seconds, input_s, weight_s),
                          Plan(pp=pp, schedule=schedule, microbatches=m, virtual_stages=v),
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3), loss_fn=_mse)
        # the input requires grad so that stage 0 pays an input gradient as every other
        # stage does: equal stage costs, as theory assumes
        x = torch.randn(2 * m, WIDTH, device=bench_device(), requires_grad=True)
        y = torch.randn(2 * m, WIDTH, device=bench_device())
        records = []
        for _ in range(steps):
            trainer.step(x, y)
            records.append(rank_record(trainer.driver.trace, trainer.driver.rank))
        out.append(records)
        trainer.close()
    return out


def documents(results: list[list], cases: list[tuple[str, int, int]]) -> list[list[dict]]:
    """Per case, each step's trace document, from every rank's `measure_rank` result."""
    from meshtrain.report.trace import trace_document

    return [[trace_document([rank[i][step] for rank in results], schedule, m, v, step + 1)
             for step in range(len(results[0][i]))]
            for i, (schedule, m, v) in enumerate(cases)]


def median_step(docs: list[dict]) -> dict:
    """The step whose measured bubble is the median (the first steps warm up)."""
    ranked = sorted(docs[1:] or docs, key=lambda d: d["measured"]["bubble"])
    return ranked[len(ranked) // 2]


def measure(pp: int, cases: list[tuple[str, int, int]], seconds: float = 0.015,
            steps: int = 4, input_s: float | None = None,
            weight_s: float | None = None) -> list[dict]:
    """Launch `pp` local ranks; per case, the median step's trace document."""
    from meshtrain.launch import launch

    results = launch(measure_rank, pp, (cases, seconds, steps, input_s, weight_s))
    return [median_step(d) for d in documents(results, cases)]


# ---- meshtrain bench pp: our schedules against torch.distributed.pipelining ----------------
N_LAYER = 8   # blocks: with embedding and head, enough layers for pp=4 x 2 chunks
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                   "interleaved": "ScheduleInterleaved1F1B",
                   "zb-h1": "ScheduleInterleavedZeroBubble"}


def _gpt_batch(model_name: str, batch: int):
    from meshtrain.bench.device import bench_device, gpt_batch

    return gpt_batch(model_name, batch, bench_device(), n_layer=N_LAYER)


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _torch_pipeline(model_name: str, plan, device: torch.device):
    """torch.distributed.pipelining's schedule over the same GPT, cut where ours is; its
    step (one optimizer step) as a function of (x, y)."""
    import torch.distributed.pipelining as tpp

    from meshtrain.models.gpt import GPT, gpt_config
    from meshtrain.strategies.pipeline.partition import model_layers, stage_bounds
    from meshtrain.strategies.pipeline.schedules import stage_of

    pp, rank, v, m = plan.pp, dist.get_rank(), plan.virtual_stages, plan.microbatches
    torch.manual_seed(0)
    model = GPT(gpt_config(model_name, n_layer=N_LAYER)).to(device)
    layers, bounds = model_layers(model), stage_bounds(model, plan)
    stages = [tpp.PipelineStage(torch.nn.Sequential(*layers[bounds[s]:bounds[s + 1]]),
                                s, pp * v, device)
              for s in (stage_of(rank, c, pp) for c in range(v))]
    optimizer = torch.optim.SGD([p for st in stages for p in st.submod.parameters()], lr=1e-4)
    cls = getattr(tpp, TORCH_SCHEDULES[plan.schedule])
    theirs = (cls(stages, m, loss_fn=_token_loss) if cls.__name__.startswith("ScheduleInter")
              else cls(stages[0], m, loss_fn=_token_loss))
    last = stage_of(rank, v - 1, pp) == pp * v - 1

    def step(x, y):
        optimizer.zero_grad()
        if rank == 0:
            theirs.step(x)
        elif last:
            theirs.step(target=y, losses=[])
        else:
            theirs.step()
        optimizer.step()
    return step


def bench_rank(model_name: str, batch: int, cases: list[tuple[str, int, int]], steps: int,
               reps: int, warmup: int, ours_first: bool = True) -> dict:
    """Per (schedule, M, V): our step and torch pipelining's on the same GPT, the same
    stage split (ours, Plan.stage_balance's) and batch, alternating; seconds of each
    timed step, and our measured bubble of the last step. `ours_first`: which side is
    built first (the model built first runs slower: docs/history.md)."""
    from meshtrain.core.plan import Plan
    from meshtrain.train.trainer import Trainer
    from meshtrain.bench.device import fence, flops_basis
    from meshtrain.bench.timing import alternate
    from meshtrain.models.gpt import GPT, gpt_config

    pp = dist.get_world_size()
    x, y = _gpt_batch(model_name, batch)
    out = {}
    for schedule, m, v in cases:
        plan = Plan(pp=pp, schedule=schedule, microbatches=m, virtual_stages=v)

        def build_ours():
            torch.manual_seed(0)
            return Trainer(GPT(gpt_config(model_name, n_layer=N_LAYER)), plan,
                           loss_fn=_token_loss,
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-4))
        if ours_first:
            ours = build_ours()
            torch_step = _torch_pipeline(model_name, plan, x.device)
        else:
            torch_step = _torch_pipeline(model_name, plan, x.device)
            ours = build_ours()
        times = alternate({"meshtrain": lambda: ours.step(x, y),
                           "torch": lambda: torch_step(x, y)}, steps, reps, warmup,
                          fence(x.device))
        out[f"{schedule} M={m} V={v}"] = {"times": times,
                                          "bubble": ours.driver.trace.bubble,
                                          "peak_held": ours.driver.peak_held}
        ours.close()
    out["basis"] = flops_basis(model_name, x.device, n_layer=N_LAYER)
    return out


def bench(worlds=(2, 4), model_name: str = "tiny", batch: int = 16, microbatches=(4, 8),
          schedules=("gpipe", "1f1b", "interleaved", "zb-h1"), steps: int = 3, reps: int = 6,
          warmup: int = 2, progress=print) -> dict:
    """Every (schedule, M) at each pp, ours against torch's; medians and ratios. Each side
    is built first in one of two launches of half the repetitions, the steps pooled (as
    bench/ddp.py does)."""
    from meshtrain.bench.device import throughput
    from meshtrain.bench.timing import median
    from meshtrain.launch import launch
    from meshtrain.models.gpt import gpt_config

    result = {"model": model_name, "batch": batch, "steps": steps, "reps": reps, "worlds": {}}
    for pp in worlds:
        cases = [(s, m, 2 if s == "interleaved" else 1) for s in schedules for m in microbatches
                 if s != "interleaved" or m % pp == 0]
        progress(f"pp={pp}: {len(cases)} cases, meshtrain vs torch pipelining, alternating, "
                 "each built first in one of two launches ...")
        launches = [launch(bench_rank, pp, (model_name, batch, cases, steps, (reps + 1) // 2,
                                             warmup, ours_first))
                    for ours_first in (True, False)]
        ranks = launches[0]
        rows, basis = {}, ranks[0].pop("basis")
        result["basis"] = basis
        tokens = batch * gpt_config(model_name).seq_len
        for name, r in ranks[0].items():
            pooled = {side: [t for runs in launches for t in runs[0][name]["times"][side]]
                      for side in ("meshtrain", "torch")}
            ours, theirs = median(pooled["meshtrain"]), median(pooled["torch"])
            rows[name] = {"meshtrain_s": ours, "torch_s": theirs, "ratio": ours / theirs,
                          "meshtrain": throughput(ours, tokens, basis, pp),
                          "torch": throughput(theirs, tokens, basis, pp),
                          "torch_schedule": TORCH_SCHEDULES[name.split()[0]],
                          "peak_held_per_stage": [rk[name]["peak_held"] for rk in ranks],
                          "idle_per_stage": [rk[name]["bubble"] for rk in ranks]}
        result["worlds"][pp] = rows
        progress(format_bench({**result, "worlds": {pp: rows}}))
    return result


def format_bench(result: dict) -> str:
    lines = [f"{result['model']} GPT ({N_LAYER} blocks), batch {result['batch']}, median step "
             f"of {result['reps']} alternating repetitions x {result['steps']} steps",
             f"{'pp':>3} {'schedule':<22} {'meshtrain ms':>12} {'torch ms':>9} {'ratio':>6}  "
             f"{'tokens/s ours':>13} {'torch':>7} {'MFU ours':>8} {'torch':>6}  "
             f"{'torch class':<30} held/stage  idle/stage"]
    for pp, rows in result["worlds"].items():
        for name, r in rows.items():
            lines.append(f"{pp:>3} {name:<22} {r['meshtrain_s'] * 1e3:>12.1f} "
                         f"{r['torch_s'] * 1e3:>9.1f} {r['ratio']:>6.3f} "
                         f"{r['meshtrain']['tokens_per_s']:>13,.0f} "
                         f"{r['torch']['tokens_per_s']:>7,.0f} "
                         f"{r['meshtrain']['mfu']:>8.2%} {r['torch']['mfu']:>6.2%}  "
                         f"{r['torch_schedule']:<30} {r['peak_held_per_stage']}  "
                         + " ".join(f"{b:.2f}" for b in r["idle_per_stage"]))
    if "basis" in result:
        from meshtrain.bench.device import basis_line
        lines.append(basis_line(result["basis"]))
    return "\n".join(lines)


# ---- stages balanced by compute against by parameters (Plan.stage_balance) -----------------
def balance_rank(config, batch: int, seq: int, m: int, steps: int, reps: int, warmup: int,
                 order: tuple[str, ...]) -> dict:
    """The same Llama trained under each stage balance (built in `order`), alternating;
    seconds of each timed step and each balance's stage bounds."""
    from transformers import LlamaForCausalLM

    from meshtrain.bench.device import bench_device, fence
    from meshtrain.bench.timing import alternate
    from meshtrain.core.plan import Plan
    from meshtrain.strategies.pipeline.partition import stage_bounds
    from meshtrain.train.trainer import Trainer

    device = bench_device()
    g = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=g, device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    trainers, bounds = {}, {}
    for balance in order:
        torch.manual_seed(0)
        model, plan = LlamaForCausalLM(config), Plan(pp=dist.get_world_size(), microbatches=m,
                                                     stage_balance=balance)
        bounds[balance] = stage_bounds(model, plan)
        trainers[balance] = Trainer(model, plan, optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-4))
    times = alternate({b: (lambda t=t: t.step(x, y)) for b, t in trainers.items()}, steps,
                      reps, warmup, fence(device))
    idle = {b: t.driver.trace.bubble for b, t in trainers.items()}   # of the last step
    for t in trainers.values():
        t.close()
    return {"times": times, "bounds": bounds, "idle": idle}


def bench_balance(pp: int = 2, batch: int = 8, seq: int = 128, m: int = 4, steps: int = 3,
                  reps: int = 6, warmup: int = 2, size: str = "wide-vocab") -> dict:
    """Plan.stage_balance "compute" against "parameters" on a Llama of `size` (bench/
    recipe.py's; "wide-vocab": 32k tokens, untied) at `pp`: two launches, each balance
    built first in one, the steps pooled; medians and ratio."""
    from meshtrain.bench.recipe import llama_config
    from meshtrain.bench.timing import median
    from meshtrain.launch import launch

    config = llama_config(size, seq)
    runs = [launch(balance_rank, pp, (config, batch, seq, m, steps, (reps + 1) // 2, warmup,
                                      order))
            for order in (("compute", "parameters"), ("parameters", "compute"))]
    pooled = {b: [t for r in runs for t in r[0]["times"][b]] for b in ("compute", "parameters")}
    out = {b: {"median_s": median(ts), "bounds": runs[0][0]["bounds"][b], "steps": len(ts),
               "idle_per_stage": [round(rank["idle"][b], 3) for rank in runs[0]]}
           for b, ts in pooled.items()}
    out["ratio"] = out["compute"]["median_s"] / out["parameters"]["median_s"]
    return out
