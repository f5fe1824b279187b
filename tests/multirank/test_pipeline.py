"""Pipeline parallel on P gloo ranks: every schedule reproduces one-process training (plain
PyTorch), on a tied nn.Sequential and on the GPT; the runtime's activation accounting;
the bytes each stage boundary carries, from the Comm counters; a failed stage does not
block its neighbour.

Each world starts once and runs all its cases (SGD with momentum, 1e-5 on losses, every
parameter and optimizer state; the schedule sweep, 22 cases a world, over 6 steps, the
compositions over 10). The tied model clips at 1.0 (as test_zero does): its
lr of 0.5 makes it chaotic enough that one thread against two already moves it 1.4e-5; the
clip also checks that a weight tied across stages is counted once in the global norm.
"""

import pytest
import torch
import torch.distributed as dist

import meshtrain as mt
from meshtrain.core.watchdog import CollectiveFailure
from meshtrain.strategies.pipeline import PipelineError
from meshtrain.strategies.pipeline.schedules import compute_order
from meshtrain.testing import run_ranks
from tests.multirank import equivalence as eq

MODELS = {"tied_pipe": 1.0, "gpt_pipe": None}   # model -> max_grad_norm
SWEEP_STEPS = 6


def schedules(p: int) -> list[tuple[str, int, int]]:
    """(schedule, microbatches, virtual_stages): M = 1, 4, 8; interleaved at M = P, 2P."""
    out = [(s, m, 1) for s in ("naive", "gpipe", "1f1b") for m in (1, 4, 8)]
    return out + [("interleaved", m, 2) for m in (p, 2 * p)]


def train_cases() -> dict:
    p = dist.get_world_size()
    return {(model, case): eq.train(mt.Plan(pp=p, schedule=case[0], microbatches=case[1],
                                            virtual_stages=case[2]), model,
                                    max_grad_norm=clip, steps=SWEEP_STEPS)
            for model, clip in MODELS.items() for case in schedules(p)}


@pytest.fixture(scope="module")
def references():
    return {model: eq.reference(model, max_grad_norm=clip, steps=SWEEP_STEPS)
            for model, clip in MODELS.items()}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_schedule_matches_one_process(references, world):
    results = run_ranks(world, train_cases, timeout=120)
    for rank, per_case in enumerate(results):
        assert len(per_case) == 2 * len(schedules(world))
        for (model, case), result in per_case.items():
            eq.assert_equivalent(result, references[model],
                                 what=f"pp={world} rank {rank} {model} {case}")
            # the loss every rank returns is the last stage's, bit for bit
            assert result["losses"] == results[-1][(model, case)]["losses"]


# ---- memory and bytes from the runtime's and the Comm's own accounting ----------------------
B, S, H = eq.GLOBAL_BATCH, eq.PIPE_CONFIG.seq_len, eq.PIPE_CONFIG.d_model


def accounting(cases: list[tuple[str, int, int]]) -> list[dict]:
    """Per case, on this rank: the peak of micro-batches held, and one step's pp traffic."""
    out = []
    for schedule, m, v in cases:
        torch.manual_seed(0)
        trainer = mt.Trainer(eq.gpt_pipe(), mt.Plan(pp=dist.get_world_size(), schedule=schedule,
                                                    microbatches=m, virtual_stages=v),
                             optimizer=eq.sgd)
        first, second = eq.batches("gpt_pipe", 2)
        trainer.step(*first)                    # the first step also sends shapes
        trainer.comm.stats.reset()
        trainer.step(*second)
        traffic = {(op, tag): vars(trainer.comm.stats.total("pp", op, tag))
                   for op in ("send", "recv") for tag in ("act", "grad", "shape")}
        trace = trainer.driver.trace
        out.append({"peak": trainer.driver.peak_held, "traffic": traffic,
                     "trace": [(b.kind.value, b.microbatch, b.chunk) for b in trace.blocks],
                     "ordered": all(a.end <= b.start for a, b in zip(trace.blocks,
                                                                     trace.blocks[1:])),
                     "idle": trace.bubble})
    return out


ACCOUNTING = [("gpipe", 1, 1), ("gpipe", 4, 1), ("gpipe", 8, 1), ("1f1b", 4, 1), ("1f1b", 8, 1),
              ("interleaved", 4, 2), ("interleaved", 8, 2)]


def test_activations_held_and_bytes_per_boundary():
    p = 4
    results = run_ranks(p, accounting, ACCOUNTING, timeout=120)
    peak = {case: [r[i]["peak"] for r in results] for i, case in enumerate(ACCOUNTING)}
    # GPipe: stage 0 holds every micro-batch at its peak; 1F1B at most P (rank r: P - r)
    assert [peak[("gpipe", m, 1)][0] for m in (1, 4, 8)] == [1, 4, 8]
    assert peak[("1f1b", 4, 1)] == [4, 3, 2, 1]
    assert peak[("1f1b", 8, 1)] == [4, 3, 2, 1]
    for i, (schedule, m, v) in enumerate(ACCOUNTING):
        element_bytes = (B // m) * S * H * 4            # b*s*h fp32 elements, b = B/M
        for rank, r in enumerate(results):
            t = r[i]["traffic"]
            # boundaries this rank's stages send activations across / receive them from
            starts = sum(1 for c in range(v) if c * p + rank < p * v - 1)
            ends = sum(1 for c in range(v) if c * p + rank > 0)
            case = f"{schedule} M={m} V={v} rank {rank}"
            assert t[("send", "act")] == {"calls": m * starts, "sent": m * starts * element_bytes,
                                          "received": 0}, case
            assert t[("recv", "act")] == {"calls": m * ends, "sent": 0,
                                          "received": m * ends * element_bytes}, case
            assert t[("send", "grad")] == {"calls": m * ends, "sent": m * ends * element_bytes,
                                           "received": 0}, case
            assert t[("recv", "grad")] == {"calls": m * starts, "sent": 0,
                                           "received": m * starts * element_bytes}, case
            assert t[("send", "shape")]["calls"] == 0, case   # shapes only in the first step
            # the measured trace: this rank's compute, in the schedule's order, timed
            order = compute_order(schedule, p, m, v)[rank]
            assert r[i]["trace"] == [(k.value, mb, c) for k, mb, c in order], case
            assert r[i]["ordered"] and 0 <= r[i]["idle"] < 1, case


def evaluate_and_state() -> dict:
    torch.manual_seed(0)
    trainer = mt.Trainer(eq.gpt_pipe(), mt.Plan(pp=dist.get_world_size(), schedule="interleaved",
                                                microbatches=4, virtual_stages=2),
                         optimizer=eq.sgd)
    batches = eq.batches("gpt_pipe", 3)
    return {"eval": trainer.evaluate(batches), "state": trainer.full_state_dict(),
            "params": [n for n, _ in trainer.stages.named_parameters()],
            "in_memory": [n for n, p in trainer.model.named_parameters() if not p.is_meta]}


def test_evaluate_and_state_dict_keep_the_model_names():
    torch.manual_seed(0)
    model = eq.gpt_pipe()
    with torch.no_grad():
        expected = sum(model.loss(model(x), y).item() for x, y in eq.batches("gpt_pipe", 3)) / 3
    results = run_ranks(2, evaluate_and_state)
    for r in results:
        assert r["eval"] == pytest.approx(expected, abs=1e-5)
        assert list(r["state"]) == list(model.state_dict())
        for name, value in model.state_dict().items():
            torch.testing.assert_close(r["state"][name], value, rtol=0, atol=0)
    # each rank holds only its stages: two chunks each, nothing held twice; the other stages'
    # parameters have no storage on this rank
    held = results[0]["params"] + results[1]["params"]
    assert sorted(held) == sorted(n for n, _ in model.named_parameters())
    for r in results:
        assert sorted(r["in_memory"]) == sorted(r["params"])


# ---- a failed stage ------------------------------------------------------------------------
def fail_on_stage_zero() -> str:
    torch.manual_seed(0)
    trainer = mt.Trainer(eq.tied_pipe(), mt.Plan(pp=2, microbatches=2), optimizer=eq.sgd,
                         loss_fn=eq.token_loss)
    trainer.driver.recv_timeout = 2.0
    batches = eq.batches("tied_pipe", 2)
    trainer.step(*batches[0])
    if dist.get_rank() == 0:
        def broken(module, args):
            raise RuntimeError("stage 0 broke")
        trainer.stages.chunks[0].register_forward_pre_hook(broken)
    try:
        trainer.step(*batches[1])
    except (PipelineError, CollectiveFailure) as exc:   # the watchdog's diagnosis wraps ours
        return f"{type(exc).__name__}: {exc}\n{exc.__cause__}"
    except RuntimeError as exc:
        return f"own failure: {exc}"
    return "no failure"


def test_a_failed_stage_does_not_block_its_neighbour_forever():
    with pytest.warns(RuntimeWarning):   # the timed-out pair closes: teardown aborts (kept)
        own, neighbour = run_ranks(2, fail_on_stage_zero, timeout=30)
    assert own == "own failure: stage 0 broke"
    assert "pp rank 1: recv_act of micro-batch 0 (chunk 0) from pp rank 0 failed" in neighbour
    # ended by the stage's own receive timeout (2 s), not the process group's (30 s)
    assert "Timed out waiting 2000ms for recv operation" in neighbour, neighbour


# ---- composed with the other axes: the schedule calls the gradient-sync protocol --------------
HYBRID = {4: [("tied_pipe", dict(dp=2, pp=2, microbatches=4), 1.0),
              ("gpt_pipe", dict(dp=2, pp=2, microbatches=4, schedule="interleaved",
                                virtual_stages=2), 0.2),
              ("tied_pipe", dict(dp=2, pp=2, microbatches=4, zero=1), 1.0),
              ("tied_pipe", dict(dp=2, pp=2, microbatches=4, zero=2, schedule="interleaved",
                                 virtual_stages=2), 1.0),
              ("gpt_pipe", dict(pp=2, tp=2, microbatches=2), 0.2),
              ("gpt_pipe", dict(pp=2, tp=2, microbatches=2, sequence_parallel=True), None),
              ("gpt_pipe", dict(pp=4, microbatches=4, recompute="full"), None),
              ("gpt_pipe", dict(pp=2, tp=2, microbatches=2, recompute="selective"), 0.2)],
          8: [("gpt_pipe", dict(dp=2, pp=2, tp=2, zero=1, microbatches=2), 0.2)]}


def train_hybrid() -> list[dict]:
    return [eq.train(mt.Plan(**plan), model, max_grad_norm=clip)
            for model, plan, clip in HYBRID[dist.get_world_size()]]


@pytest.mark.parametrize("world", [4, 8])
def test_pipeline_under_ddp_zero_and_tensor_parallel_matches_one_process(world):
    refs = {(model, clip): eq.reference(model, max_grad_norm=clip)
            for model, _, clip in HYBRID[world]}
    for rank, results in enumerate(run_ranks(world, train_hybrid, timeout=120)):
        for (model, plan, clip), result in zip(HYBRID[world], results):
            eq.assert_equivalent(result, refs[(model, clip)],
                                 what=f"rank {rank} {model} {plan}")


# ---- checkpoints do not depend on the plan ---------------------------------------------------
def resume_under_pp(one_process_ckpt: str, out: str) -> dict:
    import copy

    torch.manual_seed(1)   # other weights: everything must come from the checkpoint
    trainer = mt.Trainer(eq.tied_pipe(), mt.Plan(pp=2, schedule="interleaved", microbatches=4,
                                                 virtual_stages=2),
                         optimizer=eq.sgd, loss_fn=eq.token_loss)
    trainer.load(one_process_ckpt)
    loaded = trainer.full_state_dict(), copy.deepcopy(trainer.full_optimizer_state())
    for x, y in eq.batches("tied_pipe", 4)[2:]:
        trainer.step(x, y)
    trainer.save(out)
    return {"loaded": loaded, "final": (trainer.full_state_dict(),
                                        trainer.full_optimizer_state())}


def test_checkpoints_move_between_one_process_and_pipeline_stages(tmp_path):
    import copy

    one, pp_ckpt = str(tmp_path / "one"), str(tmp_path / "pp")
    torch.manual_seed(0)
    single = mt.Trainer(eq.tied_pipe(), mt.Plan(), optimizer=eq.sgd, loss_fn=eq.token_loss)
    for x, y in eq.batches("tied_pipe", 2):
        single.step(x, y)
    single.save(one)
    saved = single.full_state_dict(), copy.deepcopy(single.full_optimizer_state())
    ranks = run_ranks(2, resume_under_pp, one, pp_ckpt)
    for rank, result in enumerate(ranks):
        assert_same_state(saved, result["loaded"], f"one process -> pp rank {rank}")
    # the tied weight is one tensor under both its names, on every rank
    assert ranks[0]["final"][0]["0.weight"] is ranks[0]["final"][0]["7.weight"]
    back = mt.Trainer(eq.tied_pipe(), mt.Plan(), optimizer=eq.sgd, loss_fn=eq.token_loss)
    back.load(pp_ckpt)
    assert_same_state(ranks[0]["final"], (back.full_state_dict(), back.full_optimizer_state()),
                      "pp -> one process")
    for x, y in eq.batches("tied_pipe", 4)[2:]:
        single.step(x, y)
    # the continued runs differ only by micro-batching's round-off (M=4 against 1)
    assert_same_state((single.full_state_dict(), single.full_optimizer_state()),
                      (back.full_state_dict(), back.full_optimizer_state()),
                      "pp run vs one-process run", atol=1e-5)


def assert_same_state(a, b, what: str, atol: float = 0.0) -> None:
    """Model and optimizer states equal (exactly, by default) under the same names."""
    (model_a, optim_a), (model_b, optim_b) = a, b
    assert model_a.keys() == model_b.keys(), what
    for name in model_a:
        torch.testing.assert_close(model_a[name], model_b[name], rtol=0, atol=atol,
                                   msg=lambda m: f"{what} {name}: {m}")
    assert optim_a["state"].keys() == optim_b["state"].keys(), what
    for name, states in optim_a["state"].items():
        for key, value in states.items():
            torch.testing.assert_close(optim_b["state"][name][key], value, rtol=0, atol=atol,
                                       msg=lambda m: f"{what} {name}.{key}: {m}")


# ---- receives posted ahead of their place in the schedule (CPU) ------------------------------
AHEAD_CASES = [("1f1b", 4, 1), ("interleaved", 4, 2)]


def receive_ahead_or_not() -> list[dict]:
    """Per case, training with receives posted ahead and with each at its place in the
    schedule (as on CUDA): the values, and how many receives were posted ahead."""
    out = []
    for schedule, m, v in AHEAD_CASES:
        plan = mt.Plan(pp=dist.get_world_size(), schedule=schedule, microbatches=m,
                       virtual_stages=v)
        runs = {}
        for ahead in (True, False):
            torch.manual_seed(0)
            trainer = mt.Trainer(eq.gpt_pipe(), plan, optimizer=eq.sgd)
            trainer.driver.receive_ahead = ahead
            losses = [trainer.step(x, y) for x, y in eq.batches("gpt_pipe", 2)]
            runs[ahead] = {"losses": losses, "received_ahead": trainer.driver.received_ahead,
                           "state": {k: t.clone() for k, t in trainer.full_state_dict().items()}}
            trainer.close()
        actions = trainer.driver.actions
        first_run = next(i for i, a in enumerate(actions) if a.peer is not None)
        end = next((i for i in range(first_run, len(actions)) if actions[i].peer is None),
                   len(actions))
        receives = [a for a in actions if a.kind.value.startswith("recv")]
        runs["expected_ahead"] = len(receives) - sum(
            a.kind.value.startswith("recv") for a in actions[first_run:end])
        out.append(runs)
    return out


def test_receives_posted_ahead_change_no_value():
    """The same arithmetic either way: bit-identical losses and weights (the sweep above
    proves them equal to one process, with receives ahead as CPU runs them)."""
    for rank, per_case in enumerate(run_ranks(2, receive_ahead_or_not, timeout=120)):
        for case, runs in zip(AHEAD_CASES, per_case):
            ahead, inline = runs[True], runs[False]
            assert ahead["losses"] == inline["losses"], (rank, case)
            for name, value in ahead["state"].items():
                assert torch.equal(value, inline["state"][name]), (rank, case, name)
            # every receive but those of the step's first run is posted a run early
            assert ahead["received_ahead"] == runs["expected_ahead"] > 0, (rank, case)
            assert inline["received_ahead"] == 0
