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
    import meshtrain as mt
    from meshtrain.models.spin import spin_pipe
    from meshtrain.report.trace import rank_record

    pp, out = dist.get_world_size(), []
    for schedule, m, v in cases:
        torch.manual_seed(0)
        trainer = mt.Trainer(spin_pipe(pp * v, seconds, input_s, weight_s),
                             mt.Plan(pp=pp, schedule=schedule, microbatches=m,
                                     virtual_stages=v),
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3), loss_fn=_mse)
        # the input requires grad so that stage 0 pays an input gradient as every other
        # stage does: equal stage costs, as theory assumes
        x = torch.randn(2 * m, WIDTH, requires_grad=True)
        y = torch.randn(2 * m, WIDTH)
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
