"""The collective watchdog: a rank that skips a collective, or stops (no heartbeat, no more
calls), makes every other rank fail within the timeout with a message naming the culprit
and the call; the check of the first step's sequences names the first difference."""
import re
import time

import torch
import torch.distributed as dist

import meshtrain as mt
from meshtrain.core.watchdog import CollectiveFailure, CollectiveLog, compare, first_difference
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.testing import run_ranks

TIMEOUT = 4.0   # the process group's collective timeout in these tests


def _trainer():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, d_model=32, n_head=2))
    return mt.Trainer(model, mt.Plan(dp=3), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))


def _batch():
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(0, 64, (2, 16), generator=g)
    return x, x.roll(1, dims=1)


def misbehave(how: str):
    trainer = _trainer()
    trainer.step(*_batch())   # a good step: every rank logs the same calls
    store = trainer.watchdog.store
    if how == "skip":   # a newer Trainer beside it: the one that fails is still named
        _trainer()
    if dist.get_rank() == 2:
        if how == "skip":   # rank 2 skips its next all-reduce and goes on
            real = trainer.comm.all_reduce
            skipped = []

            def all_reduce(tensor, axis, *args, **kwargs):
                if not skipped:   # not logged either: as if the call were not in the code
                    skipped.append(tensor.shape)
                    return _done(kwargs)
                return real(tensor, axis, *args, **kwargs)
            trainer.comm.all_reduce = all_reduce
        else:               # rank 2 stops: no heartbeat, no more collectives
            _published(trainer)   # its calls so far are on the store: then it stops beating
            trainer.watchdog.close()
            store.wait(["failed/0", "failed/1"])   # until both others have diagnosed it
            return "stopped"
    try:
        trainer.step(*_batch())
        trainer.step(*_batch())
    except CollectiveFailure as exc:
        store.set(f"failed/{dist.get_rank()}", "1")
        return str(exc)
    return "no failure"


def _published(trainer) -> None:
    """Wait until the watchdog's thread has put this rank's latest call count on the store."""
    import json

    watchdog, want = trainer.watchdog, trainer.comm.log.count["dp"]
    key = watchdog.KEY + str(dist.get_rank())
    # the thread may have published before the first call on dp: that record has no "dp"
    while json.loads(watchdog.store.get(key))["axes"].get("dp", {}).get("count") != want:
        time.sleep(0.01)


def _done(kwargs):
    from meshtrain.core.handles import Done
    return Done() if kwargs.get("async_op") else None


def _first_step():
    """What the first good step leaves on dp, derived from the model: one broadcast per
    parameter tensor as the Trainer starts (rank 0's copy to all), then the step's one
    all-reduce of the gradient bucket, which carries DDP's payload of 1 + one element per
    tensor (the loss rides in it, no padding under DDP)."""
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, d_model=32, n_head=2))
    params = list(model.parameters())
    bucket = sum(p.numel() for p in params) + 1 + len(params)
    return len(params) + 1, f"`all_reduce dp[grad] float32[{bucket}]`"


def test_a_skipped_collective_names_the_rank_and_the_call():
    """(A rank calling a different collective is named "diverged": see the compare test.)"""
    calls, bucket = _first_step()
    results = run_ranks(3, misbehave, "skip", timeout=60, collective_timeout=TIMEOUT)
    for message in results[:2]:
        # rank 2's next step's call completed the others' next call (#calls + 1), and it ran
        # out of steps one call short, so the others wait at #calls + 2 for a rank that has
        # finished (gone if it has exited by the time the others look, behind if not yet)
        assert re.search(rf"rank 2 is (gone|behind): its last call on dp was #{calls + 1} "
                         rf"\({re.escape(bucket)}\), the others reached #{calls + 2}",
                         message), message
    assert results[2] == "no failure"


def test_a_stopped_peer_is_named_gone_by_every_other_rank():
    calls, bucket = _first_step()
    results = run_ranks(3, misbehave, "stop", timeout=60, collective_timeout=TIMEOUT)
    assert results[2] == "stopped"
    for message in results[:2]:
        assert "rank 2 is gone" in message, message
        assert (f"its last call on dp was #{calls} ({bucket}), the others reached "
                f"#{calls + 1}") in message


def test_compare_finds_divergence_behind_and_agreement():
    def tail(*sigs):
        return {"count": len(sigs), "recent": [[i + 1, s] for i, s in enumerate(sigs)]}
    a, b = "all_reduce dp float32[8]", "all_reduce dp float32[4]"
    assert compare("dp", {0: tail(a, b), 1: tail(a, b), 2: tail(b)}, set()) == [
        f"rank 2 diverged at call #1 on dp: it called `{b}` where the others called `{a}`"]
    assert compare("dp", {0: tail(a, b), 1: tail(a, b), 2: tail(a)}, {2}) == [
        f"rank 2 is gone: its last call on dp was #1 (`{a}`), the others reached #2"]
    assert compare("dp", {0: tail(a), 1: tail(a)}, set()) == []
    # sends and receives are not compared (their order differs by design)
    assert compare("pp", {0: tail("send pp float32[2]"), 1: tail("recv pp float32[2]")},
                   set()) == []


def test_first_difference_of_recorded_steps():
    log = CollectiveLog()
    log.record_all = True
    log.enter("all_reduce", "dp", "grads", torch.zeros(4))
    other = [(1, "all_reduce dp[grads] float32[5]")]
    assert first_difference([log.all_calls, log.all_calls]) is None
    assert first_difference([log.all_calls, other]) == (
        "call 1 of the step differs: rank 0 `all_reduce dp[grads] float32[4]`, "
        "rank 1 `all_reduce dp[grads] float32[5]`")


def first_step_checked(tamper: bool):
    from meshtrain.core.watchdog import CollectiveMismatch
    from meshtrain.train.run import check_same_collectives

    trainer = _trainer()
    trainer.comm.log.record_all = True
    trainer.step(*_batch())
    if tamper and dist.get_rank() == 1:   # as if rank 1 had reduced one more tensor
        trainer.comm.log.all_calls.insert(1, (99, "all_reduce dp[grad] float32[7]"))
    try:
        check_same_collectives(trainer)
    except CollectiveMismatch as exc:
        return str(exc)
    return "same"


def test_check_collectives_names_the_first_difference():
    assert run_ranks(3, first_step_checked, False) == ["same"] * 3
    messages = run_ranks(3, first_step_checked, True)
    assert len(set(messages)) == 1   # every rank stops with the same message
    # one call per step here (the loss rides in the gradient bucket): rank 1 has a second
    assert messages[0] == (
        "--check-collectives: the ranks [0, 1, 2] made different collective calls in the "
        "first step: call 2 of the step differs: rank 0 `(no call)`, rank 1 `all_reduce "
        "dp[grad] float32[7]`, rank 2 `(no call)`")
