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


def test_compile_workers_are_the_ranks_share_of_the_cores(monkeypatch):
    """`meshtrain train --compile`: inductor's worker pool takes the rank's thread count
    (launch set it to cores / ranks), not every core; the environment variable still wins."""
    from torch._inductor import config

    from meshtrain.strategies.compile import limit_compile_workers

    threads = torch.get_num_threads()
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    try:
        with config.patch(compile_threads=32):
            torch.set_num_threads(1)
            limit_compile_workers()
            assert config.compile_threads == 1
            monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "3")
            config.compile_threads = 32
            limit_compile_workers()
            assert config.compile_threads == 32
    finally:
        torch.set_num_threads(threads)


def test_the_token_loss_is_compiled_in_fp32_beside_the_blocks():
    """Plan(compile=...) compiles the token cross-entropy with its upcast (not under tp, nor
    where recomputation takes the lean loss); the compiled loss is the fp32 loss of the
    logits as given, and a float64 model's loss stays float64."""
    from torch._dynamo.utils import counters

    from meshtrain.strategies.compile import compiled_token_loss

    loss = compiled_token_loss("aot_eager")
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=gen)
    targets = torch.randint(0, 11, (2, 5), generator=gen)
    for given in (logits.bfloat16(), logits.double()):
        expected = nn.functional.cross_entropy(
            (given.float() if given.dtype == torch.bfloat16 else given).reshape(-1, 11),
            targets.reshape(-1))
        got = loss(given, targets)
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    before = counters["stats"]["unique_graphs"]
    trainer = mt.Trainer(GPT(eq.CONFIG), mt.Plan(compile="aot_eager"), optimizer=eq.sgd)
    x = torch.randint(0, eq.CONFIG.vocab_size, (2, eq.CONFIG.seq_len))
    trainer.step(x, x)
    assert counters["stats"]["unique_graphs"] - before == 2   # a block's graph, the loss's
    lean = mt.Trainer(GPT(eq.CONFIG), mt.Plan(compile="aot_eager", recompute="full"),
                      optimizer=eq.sgd)
    assert lean.loss_fn.__name__ == "_lean_token_loss"


def test_cuda_graphs_mark_a_new_step_before_each_micro_batchs_forward():
    """compile="cudagraphs": torch's step mark before every micro-batch's forward and every
    evaluation (CUDA graph trees' fast path); no mark under any other compile mode."""
    from meshtrain.strategies.compile import graph_step_marker

    def driver(compile):
        return mt.Trainer(GPT(eq.CONFIG), mt.Plan(compile=compile, microbatches=4),
                          optimizer=eq.sgd).driver   # compiled lazily: nothing runs here
    assert driver("cudagraphs").forward_begins is torch.compiler.cudagraph_mark_step_begin
    assert graph_step_marker("reduce-overhead") is torch.compiler.cudagraph_mark_step_begin
    assert graph_step_marker(None) is not torch.compiler.cudagraph_mark_step_begin
    torch.manual_seed(0)
    trainer = mt.Trainer(GPT(eq.CONFIG), mt.Plan(microbatches=4), optimizer=eq.sgd)
    marks = []
    trainer.driver.forward_begins = lambda: marks.append(len(marks))
    x, y = eq.batches("gpt", 1)[0]
    trainer.step(x, y)
    trainer.evaluate([(x, y)])
    assert marks == [0, 1, 2, 3, 4]
