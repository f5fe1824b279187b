"""The bucket machinery DDP and ZeRO share: launch order and how many collectives stay in
flight."""
import pytest
import torch
from torch import nn

from meshtrain.strategies.shared.buckets import build_buckets
from meshtrain.strategies.shared.gradient_buckets import GradientBuckets


class _Handle:
    def __init__(self, log: list, index: int) -> None:
        self.log, self.index = log, index

    def wait(self) -> None:
        self.log.append(("wait", self.index))


def _run_backward(in_flight, reach=None, layers=slice(None)):
    """Five layers, one bucket each (backward order), a backward through `layers` in a round
    limited to the buckets `reach`; returns the launch/wait sequence."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(5)])
    params = list(model.parameters())
    buckets = build_buckets([], float("inf"), groups=[[p] for p in reversed(params)])
    log: list = []

    def launch(bucket):
        log.append(("launch", bucket.index))
        return _Handle(log, bucket.index)

    grads = GradientBuckets(params, buckets, launch, scale=1.0, in_flight=in_flight)
    grads.start_step()
    grads.start_round(reach)
    x = torch.randn(2, 4)
    if layers.start:   # the layers before: no gradient reaches them
        x = model[:layers.start](x).detach()
    model[layers](x).sum().backward()
    grads.flush()
    grads.wait()
    return log


def test_in_flight_waits_for_the_oldest_bucket_before_launching_another():
    log = _run_backward(in_flight=2)
    assert log == [("launch", 0), ("launch", 1), ("wait", 0), ("launch", 2), ("wait", 1),
                   ("launch", 3), ("wait", 2), ("launch", 4), ("wait", 3), ("wait", 4)]
    # at no point more than two launched and not waited for
    outstanding = 0
    for what, _ in log:
        outstanding += 1 if what == "launch" else -1
        assert outstanding <= 2


def test_unbounded_launches_everything_before_waiting():
    log = _run_backward(in_flight=None)
    assert log == [("launch", i) for i in range(5)] + [("wait", i) for i in range(5)]


def test_a_round_limited_to_its_reach_launches_only_those_buckets():
    # a backward through the first two layers (buckets 3 and 4, backward order), as one chunk
    # of an interleaved stage: the other buckets are not sent as zeros
    log = _run_backward(in_flight=2, reach={3, 4}, layers=slice(0, 2))
    assert log == [("launch", 3), ("launch", 4), ("wait", 3), ("wait", 4)]


def test_a_gradient_outside_the_rounds_reach_is_an_error():
    with pytest.raises(RuntimeError, match="outside the round's reach"):
        _run_backward(in_flight=2, reach={0, 1})


def test_a_chunk_done_launches_its_buckets_before_the_steps_end():
    # a step-long round (DDP's): the first two layers' backward is over early (buckets 3, 4,
    # as an interleaved stage's chunk whose last backward ran), the others are still to come
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(5)])
    params = list(model.parameters())
    buckets = build_buckets([], float("inf"), groups=[[p] for p in reversed(params)])
    log: list = []
    grads = GradientBuckets(params, buckets, lambda b: log.append(b.index), scale=1.0)
    grads.start_step()
    with grads.paused():
        model(torch.randn(2, 4)).sum().backward()
    grads.launch_done(grads.holding(params[3:]))   # layers 3, 4: buckets 1, 0
    assert log == [0, 1]
    grads.launch_done(grads.holding(params[:1]))   # bucket 4: waits for 2 and 3, in order
    assert log == [0, 1]
    grads.flush()
    assert log == [0, 1, 2, 3, 4]
