"""What crosses a pipeline stage boundary (strategies/pipeline/boundary.py), without
processes: the shape header round trip for a tensor and for a tuple of mixed dtypes, the
gradients sent back shaped as the input, and the outputs refused by name."""
from __future__ import annotations

import pytest
import torch

from meshtrain.strategies.pipeline import boundary


@pytest.mark.parametrize("value", [
    torch.zeros(2, 3, 4),
    (torch.zeros(2, 16, 8, dtype=torch.bfloat16), torch.zeros(9)),   # hidden + routing sums
])
def test_the_header_gives_the_receiver_every_shape_and_dtype(value):
    received = boundary.read_header(boundary.header(value, torch.device("cpu")).clone())
    assert received == boundary.shapes_of(value)
    buffer = boundary.empty(received, torch.device("cpu"))
    assert type(buffer) is type(value)
    assert boundary.shapes_of(buffer) == boundary.shapes_of(value)


def test_each_input_tensor_gets_its_gradient_and_zeros_where_none_reached_it():
    hidden, routing = torch.ones(2, 3), torch.ones(5)
    received = boundary.detached((hidden, routing))
    boundary.mark_inputs(received)
    output = (received[0] * 3, received[1][:2] * 2)
    boundary.backward(output, (torch.ones(2, 3), torch.ones(2)))
    grad_hidden, grad_routing = boundary.input_gradients(received)
    assert grad_hidden.tolist() == [[3.0] * 3] * 2
    assert grad_routing.tolist() == [2.0, 2.0, 0.0, 0.0, 0.0]
    unused = boundary.detached((hidden, routing))
    boundary.mark_inputs(unused)
    assert boundary.input_gradients(unused)[1].tolist() == [0.0] * 5   # never used: zeros


@pytest.mark.parametrize("value, words", [
    ([torch.zeros(2)], "returns a list"),
    (tuple(torch.zeros(1) for _ in range(boundary.MAX_TENSORS + 1)), "a tuple of 2 to"),
    (torch.zeros([1] * 7), "outputs a 7-dim"),
    (torch.zeros(2, dtype=torch.bool), "torch.bool tensor"),
])
def test_what_cannot_cross_a_boundary_is_named(value, words):
    assert words in boundary.problem(value, 1)
    assert boundary.problem(torch.zeros(2, 3), 1) is None
