"""strategies/compile.py: which modules are compiled, and that names and hooks stay put."""
import torch
from torch import nn

import meshtrain as mt
from meshtrain.models.gpt import GPT
from meshtrain.strategies.compile import apply_compile, blocks_of
from tests.multirank import equivalence as eq


def test_the_gpts_blocks_are_compiled_in_place_names_kept():
    torch.manual_seed(0)
    model = GPT(eq.CONFIG)
    keys = list(model.state_dict())
    trainer = mt.Trainer(model, mt.Plan(compile="aot_eager", recompute="full"),
                         optimizer=eq.sgd)
    assert trainer.compiled == ["blocks.0", "blocks.1"]
    assert list(model.state_dict()) == keys and not any("_orig_mod" in k for k in keys)
    assert list(model.blocks) == blocks_of(model)
    assert mt.Trainer(GPT(eq.CONFIG), mt.Plan(), optimizer=eq.sgd).compiled == []


def test_transformers_decoder_layers_and_odd_models():
    hf = eq.hf_gpt2()
    assert blocks_of(hf) == list(hf.transformer.h)
    tied = eq.tied_sequential()   # no repeated class with parameters but Linear
    assert blocks_of(tied) == [m for m in tied if type(m) is nn.Linear]
    single = nn.Sequential(nn.Linear(2, 3), nn.GELU(), nn.LayerNorm(3))
    assert blocks_of(single) == [single[0], single[2]]   # nothing repeats: every unit


def test_a_pre_hook_swapping_parameters_is_seen_by_the_compiled_forward():
    """ZeRO-3's gather points parameters at new storage in a pre-hook, outside the compiled
    region: the compiled graph must read them as inputs at every call, not as constants."""
    from torch._dynamo.utils import counters

    block = nn.Linear(4, 4, bias=False)
    fills = [1.0, 2.0, 3.0]

    def gather(module, args):
        module.weight.data = torch.full((4, 4), fills.pop(0))
    block.register_forward_pre_hook(gather)
    before = counters["stats"]["unique_graphs"]
    apply_compile(nn.Sequential(block, nn.Linear(4, 4)), "aot_eager")
    outs = [block(torch.ones(1, 4)).sum().item() for _ in range(3)]
    assert outs == [16.0, 32.0, 48.0] and counters["stats"]["unique_graphs"] == before + 1
