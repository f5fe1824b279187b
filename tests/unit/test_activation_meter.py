"""The ActivationMeter counts what autograd saves for backward, parameters excluded, without
looking every parameter's storage up again for each saved tensor."""
import torch
from torch import nn

from meshtrain.core.memory import ActivationMeter
from meshtrain.models.gpt import GPT, GPTConfig


def _linear_meter():
    torch.manual_seed(0)
    layer = nn.Linear(8, 8, bias=False)
    return layer, ActivationMeter(layer.parameters())


def test_a_linear_layer_counts_its_input_and_not_its_weight():
    layer, meter = _linear_meter()
    x = torch.randn(4, 8, requires_grad=True)
    with meter.measure():
        layer(x).sum().backward()
    assert meter.last_bytes == x.untyped_storage().nbytes()


def test_an_alias_of_a_parameter_is_not_counted():
    """A detached alias shares the weight's storage without being it or its view."""
    layer, meter = _linear_meter()
    x = torch.randn(4, 8, requires_grad=True)
    with meter.measure():
        (x @ layer.weight.detach().t()).sum().backward()   # saves the alias, not x's grad path
    assert meter.last_bytes == 0


def test_a_parameter_moved_into_a_new_buffer_while_measuring_is_not_counted():
    """ZeRO-3 points its parameters at a freshly gathered buffer inside forward."""
    layer, meter = _linear_meter()
    x = torch.randn(4, 8, requires_grad=True)
    with meter.measure():
        layer.weight.data = torch.randn(8, 8)   # the gathered buffer
        layer(x).sum().backward()
    assert meter.last_bytes == x.untyped_storage().nbytes()


def test_a_buffer_a_parameter_left_while_measuring_counts_as_an_activation():
    """The storages read when the measurement began may since belong to something else."""
    layer, meter = _linear_meter()
    x = torch.randn(4, 8, requires_grad=True)
    old = layer.weight.data
    with meter.measure():
        layer.weight.data = torch.randn(8, 8)
        (x @ old.t()).sum().backward()   # `old` is no parameter's now: x saves it
    assert meter.last_bytes == old.untyped_storage().nbytes()


def test_a_gpt_forward_reads_the_parameters_storages_once(monkeypatch):
    """Each saved tensor is matched against what the measurement read at its start; every
    parameter's storage is read again only where a saved tensor shares one."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, n_layer=3, n_head=2, d_model=16))
    meter = ActivationMeter(model.parameters())
    reads = []
    original = ActivationMeter._param_storages
    monkeypatch.setattr(ActivationMeter, "_param_storages",
                        lambda self: reads.append(1) or original(self))
    x = torch.randint(0, 32, (2, 8))
    with meter.measure():
        model(x).sum().backward()
    assert meter.last_bytes > 0 and len(reads) == 1
