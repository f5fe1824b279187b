"""Which tensor-parallel linears float8 converts (strategies/float8.py): a slice torchao's
float8 matmul cannot take stays in bf16, and the conversion says so by name."""
import warnings

import pytest
import torch
from torch import nn

from meshtrain.strategies.float8 import convert_to_fp8
from meshtrain.strategies.tensor_parallel.layers import ColumnParallelLinear

pytest.importorskip("torchao")


def _model(size: int) -> nn.Module:
    """Rank 0's column slice of a (32, 32) weight split `size` ways, then two nn.Linear (the
    last one, the output layer, stays bf16)."""
    layer = ColumnParallelLinear(torch.zeros(32 // size, 32), None, conv1d=False, full_in=32,
                                 full_out=32, rank=0, size=size, enter=None)
    return nn.Sequential(layer, nn.Linear(32, 32), nn.Linear(32, 32))


def test_a_tp_slice_left_in_bf16_is_said():
    """32 columns (float8 in one process) split 4 ways: 8 a rank, left in bf16 and named;
    split 2 ways: 16 a rank, converted, nothing said."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert convert_to_fp8(_model(4), "tensorwise", True, comm=None) == ["1"]
    said = [str(w.message) for w in caught]
    assert any("0 stay in bf16" in m for m in said), said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert convert_to_fp8(_model(2), "tensorwise", True, comm=None) == ["0", "1"]
