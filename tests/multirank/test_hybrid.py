"""Issue 13: every composition of dp, pp and tp in {1, 2} on one mesh reproduces one-process
training of the GPT (SGD with momentum, 6 steps, 1e-5 on losses, parameters and optimizer
states), clipping by the one-process global norm (asserted in every cell). Six steps, not the
10 of each strategy's own test (test_zero, test_pipeline, test_tensor_parallel): 63 cells are
the suite's largest run, and a step's sync, clipping and momentum are all exercised by then.

The matrix: each (dp, pp, tp) with dp*pp*tp <= 8 x schedule {gpipe, 1f1b, interleaved V=2,
zb-h1} where pp > 1 x zero {0, 1, 2} where dp > 1 (and 3 where pp = 1) x sequence parallel
{off, on} where tp > 1: 63 cells.
The cp column (issue 45), pairwise rather than as a product: on 4 and 8 ranks, context
parallel (cp = 2) meets dp, pp and tp, each ZeRO stage, each schedule, sequence parallel and
both styles at least once (`CP_CELLS`); its own suite (test_context_parallel) covers the rest.
Each world size starts once and runs all its cells (a start costs more than a cell).
ZeRO-3 with pp > 1 has its own suite (test_zero3_pipeline), outside this matrix.
"""
import itertools

import pytest
import torch
import torch.distributed as dist

import meshtrain as mt
from meshtrain.testing import run_ranks
from tests.multirank import equivalence as eq

# 2 blocks, d_model 32, 2 heads, seq 16: embed + 2 blocks + head = 4 layers, enough for
# pp=2 x 2 virtual stages
MODEL = "gpt"
CLIP = 0.25     # the one-process norms are 0.31-0.35: the clip acts on every step
STEPS = 6


def cells(world: int) -> list[dict]:
    """Every plan of the matrix on `world` ranks."""
    out = []
    for dp, pp, tp in itertools.product((1, 2), repeat=3):
        if dp * pp * tp != world:
            continue
        pipes = ([dict(schedule="gpipe"), dict(schedule="1f1b"),
                  dict(schedule="interleaved", virtual_stages=2), dict(schedule="zb-h1")]
                 if pp > 1 else [{}])
        zeros = ((0, 1, 2, 3) if pp == 1 else (0, 1, 2)) if dp > 1 else (0,)
        for pipe, zero, sp in itertools.product(pipes, zeros,
                                                (False, True) if tp > 1 else (False,)):
            out.append(dict(dp=dp, pp=pp, tp=tp, zero=zero, sequence_parallel=sp,
                            microbatches=4 if pp > 1 else 1, **pipe))
    return out


A2A = dict(cp_style="all-to-all")
CP_CELLS = {4: [dict(dp=2, cp=2, zero=1, **A2A), dict(cp=2, tp=2, sequence_parallel=True),
                dict(pp=2, cp=2, microbatches=4, schedule="1f1b", **A2A)],
            8: [dict(dp=2, pp=2, cp=2, zero=2, microbatches=4, schedule="zb-h1"),
                dict(dp=2, cp=2, tp=2, zero=3, sequence_parallel=True),
                dict(pp=2, cp=2, tp=2, microbatches=4, schedule="interleaved",
                     virtual_stages=2),
                dict(dp=2, pp=2, cp=2, microbatches=4, schedule="gpipe", **A2A)]}


@pytest.fixture(scope="module")
def reference():
    return eq.reference(MODEL, max_grad_norm=CLIP, steps=STEPS)


def test_the_matrix_covers_every_cell():
    """Every choice of each axis's options is a cell, once: a schedule where pp > 1, a ZeRO
    stage where dp > 1 (ZeRO-3 with stages: test_zero3_pipeline's pairwise cases), sequence
    parallel where tp > 1."""
    schedules = [dict(schedule="gpipe"), dict(schedule="1f1b"),
                 dict(schedule="interleaved", virtual_stages=2), dict(schedule="zb-h1")]
    accepted = []
    for dp, pp, tp in itertools.product((1, 2), repeat=3):
        for pipe, zero, sp in itertools.product(schedules if pp > 1 else [{}],
                                                range(4) if dp > 1 else [0],
                                                (False, True) if tp > 1 else (False,)):
            plan = dict(dp=dp, pp=pp, tp=tp, zero=zero, sequence_parallel=sp,
                        microbatches=4 if pp > 1 else 1, **pipe)
            if zero == 3 and pp > 1:   # pairwise in test_zero3_pipeline, not a product here
                continue
            mt.Plan(**plan)   # every other cell is accepted
            accepted.append(plan)
    key = lambda plan: sorted(plan.items())
    every = [plan for world in (1, 2, 4, 8) for plan in cells(world)]
    assert sorted(map(key, every)) == sorted(map(key, accepted))
    assert len(every) == 63   # the docstring's count


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_every_cell_matches_one_process(reference, world):
    cases = [(plan, MODEL, CLIP) for plan in cells(world) + CP_CELLS.get(world, [])]
    per_rank = ((eq.train_many(cases, STEPS),) if world == 1
                else run_ranks(world, eq.train_many, cases, STEPS, timeout=170))
    for rank, results in enumerate(per_rank):
        for i, ((plan, _, _), result) in enumerate(zip(cases, results)):
            what = f"rank {rank} {mt.Plan(**plan).describe()}"
            eq.assert_equivalent(result, reference, what=what)   # norms asserted there too
            assert len(result["norms"]) == STEPS, what
            # the loss every rank returns is the same, bit for bit
            assert result["losses"] == per_rank[0][i]["losses"], what


def test_bench_hybrid_runs_every_8_rank_plan_of_the_small_gpt():
    from meshtrain.bench.hybrid import name, plans
    from meshtrain.models.gpt import gpt_config

    cfg = gpt_config("small")   # 4 blocks (6 layers), 4 heads: pp <= 4, tp <= 4
    layers = cfg.n_layer + 2
    # every split of 8 ranks into dp x pp x tp with no more stages than layers and tp
    # dividing the heads, then the classic 3D + ZeRO-1
    expected = {f"dp{8 // (pp * tp)} pp{pp} tp{tp}" for pp in (1, 2, 4, 8) for tp in (1, 2, 4, 8)
                if pp * tp <= 8 and pp <= layers and cfg.n_head % tp == 0} | {"dp2 pp2 tp2 z1"}
    got = [name(p) for p in plans(layers, cfg.n_head)]
    assert len(got) == len(set(got)) and set(got) == expected
    assert len(expected) == 9   # (1, 8, 1) has more stages than layers, (1, 1, 8) than heads


# ---- per-axis communication of a 2x2x2 plan: the sum of each strategy's theory --------------
M = 4
B, S, H = eq.GLOBAL_BATCH // (2 * M), eq.CONFIG.seq_len, eq.CONFIG.d_model   # a micro-batch
F32 = 4


def one_step_counters() -> list[dict]:
    """Per ZeRO stage 0, 1, 2 of the 2x2x2 plan: this rank's counters of one step."""
    out = []
    for zero in (0, 1, 2):
        torch.manual_seed(0)
        trainer = mt.Trainer(eq.gpt(), mt.Plan(dp=2, pp=2, tp=2, zero=zero, microbatches=M,
                                               max_grad_norm=CLIP), optimizer=eq.sgd)
        first, second = eq.batches(MODEL, 2, trainer.dp_rank, trainer.dp_size)
        trainer.step(*first)                      # the first step also sends shapes
        trainer.comm.stats.reset()
        trainer.step(*second)
        held = dict(trainer.stages.named_parameters())
        out.append({"counters": {k: (c.calls, c.sent, c.received)
                                 for k, c in trainer.comm.stats.counters.items()},
                    "pp_rank": trainer.mesh.axis_rank("pp"), "params": len(held),
                    "numel": sum(p.numel() for p in held.values())})
    return out


def theory(zero: int, pp_rank: int, params: int, numel: int) -> dict:
    """(axis, op, tag) -> (calls, bytes sent, bytes received) of one step on this rank, each
    axis from its own strategy's theory, for N = 2 on every axis (a ring all-reduce of S
    bytes over 2 ranks sends and receives S)."""
    bsh = F32 * B * S * H
    first, last = pp_rank == 0, pp_rank == 1
    out = {}
    # tp (Megatron): per micro-batch, 2 all-reduces of b*s*h forward and 2 backward per block,
    # the vocab-parallel embedding's forward, the head's backward, the loss's 2 reductions
    for region in (f"blocks.{pp_rank}.attn", f"blocks.{pp_rank}.mlp"):   # one block a stage
        for d in ("forward", "backward"):
            out[("tp", "all_reduce", f"{region}:{d}")] = (M, M * bsh, M * bsh)
    if first:
        out[("tp", "all_reduce", "embed.tok:forward")] = (M, M * bsh, M * bsh)
    if last:
        out[("tp", "all_reduce", "head.lm_head:backward")] = (M, M * bsh, M * bsh)
        loss = F32 * B * S * 3    # the row maxima, then the sum of exp and the target logit
        out[("tp", "all_reduce", "loss:forward")] = (2 * M, M * loss, M * loss)
    # pp: each micro-batch's b*s*h activation forward and its gradient back, per boundary;
    # the last stage broadcasts the loss
    out[("pp", "send" if first else "recv", "act")] = (M, M * bsh * first, M * bsh * last)
    out[("pp", "recv" if first else "send", "grad")] = (M, M * bsh * last, M * bsh * first)
    out[("pp", "broadcast", "loss")] = (1, 8 * last, 8 * first)
    # dp over this stage's Psi_stage: DDP one ring all-reduce, 2(N-1)/N * Psi_stage, carrying
    # the step's statistics (the loss, one "used" flag per parameter); ZeRO-1 the same bytes
    # as a reduce-scatter of the gradients and an all-gather of the updated parameters, the
    # statistics on their own; ZeRO-2 reduce-scatters every micro-batch's gradients
    stats, half = F32 * (1 + params), F32 * numel // 2
    if zero == 0:
        out[("dp", "all_reduce", "grad")] = (1, 2 * half + stats, 2 * half + stats)
    else:
        scatters = M if zero == 2 else 1
        out[("dp", "reduce_scatter", "grad")] = (scatters, scatters * half, scatters * half)
        out[("dp", "all_gather", "param")] = (1, half, half)
        out[("dp", "all_reduce", "step")] = (1, stats, stats)
    # the global norm: one float64 square sum over each axis
    for axis in ("tp", "pp", "dp"):
        out[(axis, "all_reduce", "grad-norm")] = (1, 8, 8)
    return out


def test_per_axis_communication_of_a_2x2x2_plan_equals_theory():
    for rank, per_zero in enumerate(run_ranks(8, one_step_counters)):
        for zero, r in enumerate(per_zero):
            expected = theory(zero, r["pp_rank"], r["params"], r["numel"])
            assert r["counters"] == expected, f"rank {rank} zero={zero}"


# ---- checkpoints across plans -----------------------------------------------------------------
# Eight cells (one process among them), each saving after 2 steps; every checkpoint loads under
# every cell with the consolidated model and optimizer states equal to what was saved, exactly.
CKPT_CELLS = {1: [dict()],
              2: [dict(dp=2, zero=2)],
              4: [dict(dp=2, tp=2, zero=3),
                  dict(pp=2, tp=2, sequence_parallel=True, schedule="interleaved",
                       virtual_stages=2, microbatches=4),
                  dict(dp=2, tp=2, zero=1),
                  dict(dp=2, pp=2, zero=2, schedule="gpipe", microbatches=4)],
              8: [dict(dp=2, pp=2, tp=2, zero=1, microbatches=4),
                  dict(dp=2, pp=2, tp=2, zero=2, sequence_parallel=True, schedule="interleaved",
                       virtual_stages=2, microbatches=4)]}


def ckpt_name(plan: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in sorted(plan.items())) or "one"


def consolidated(trainer) -> tuple:
    return trainer.full_state_dict(), trainer.full_optimizer_state()


def save_cells(root: str) -> dict:
    """Train each of this world's cells 2 steps and save it; its consolidated state."""
    out = {}
    for plan in CKPT_CELLS[world_of()]:
        torch.manual_seed(0)
        trainer = mt.Trainer(eq.gpt(), mt.Plan(**plan), optimizer=eq.sgd)
        for x, y in eq.batches(MODEL, 2, trainer.dp_rank, trainer.dp_size):
            trainer.step(x, y)
        trainer.save(f"{root}/{ckpt_name(plan)}")
        out[ckpt_name(plan)] = consolidated(trainer)
    return out


def load_every_checkpoint(root: str, saved: dict) -> list[str]:
    """Load every checkpoint under each of this world's cells; what differs from the save."""
    from tests.multirank.test_pipeline import assert_same_state

    failures = []
    for plan in CKPT_CELLS[world_of()]:
        torch.manual_seed(1)   # other weights: everything must come from the checkpoint
        trainer = mt.Trainer(eq.gpt(), mt.Plan(**plan), optimizer=eq.sgd)
        for name, state in saved.items():
            trainer.load(f"{root}/{name}")
            try:
                assert_same_state(state, consolidated(trainer), f"{name} -> {ckpt_name(plan)}")
            except AssertionError as exc:
                failures.append(str(exc))
    return failures


def world_of() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def on_world(world: int, fn, *args):
    """fn's per-rank results: in this process for world 1, else on `world` gloo ranks."""
    return [fn(*args)] if world == 1 else run_ranks(world, fn, *args, timeout=120)


def test_checkpoints_saved_under_each_cell_load_under_every_other(tmp_path):
    root = str(tmp_path)
    saved = {}
    for world in CKPT_CELLS:
        per_rank = on_world(world, save_cells, root)
        saved.update(per_rank[0])
    assert len(saved) == 8
    for world in CKPT_CELLS:
        for rank, failures in enumerate(on_world(world, load_every_checkpoint, root, saved)):
            assert not failures, f"world {world} rank {rank}: " + "\n".join(failures)
