"""ZeRO-3 under fp8's tensorwise scaling all-gathers the float8 linears' weights in e4m3
(strategies/zero/float8_gather.py): the bytes gathered are exactly torchao's cast of the
whole weight, with the scale from its amax, so training equals the bf16 all-gather's bit
for bit (eager and compiled); the all-gather carries 1 byte per float8 weight element,
the rest (embeddings, norms, biases, the output layer) 2 as before; the amaxes take one
small all-reduce a step. Refused by name with rowwise scaling."""
import pytest
import torch
import torch.distributed as dist

import meshtrain as mt
from meshtrain.core.admit import check_plan
from meshtrain.core.comm import ring_all_reduce_elements, ring_half_elements
from tests.multirank import equivalence as eq

pytest.importorskip("torchao")
FP8 = dict(precision="fp8", fp8_emulate=True)
STEPS = 3


def step_bytes(gather: bool | None) -> dict:
    """The second step's all-gather and amax bytes at dp = world, zero=3, fp8 (emulated);
    the float8 linears' names; and, after it, each gathered float8 weight against torchao's
    cast of the whole weight."""
    torch.manual_seed(0)
    trainer = mt.Trainer(eq.gpt(), mt.Plan(dp=dist.get_world_size(), zero=3,
                                           zero3_fp8_gather=gather, **FP8), optimizer=eq.sgd)
    steps = eq.batches("gpt", 2, trainer.dp_rank, trainer.dp_size)
    trainer.step(*steps[0])
    trainer.comm.stats.reset()
    trainer.step(*steps[1])
    stats = trainer.comm.stats
    out = {"ag": vars(stats.total(op="all_gather", tag="param")),
           "amax": vars(stats.total(op="all_reduce", tag="float8-amax")),
           "float8": list(trainer.float8), "casts": casts_against_whole(trainer)}
    trainer.close()
    return out


def casts_against_whole(trainer) -> list[bool]:
    """For each float8 weight gathered in float8: its bytes and scale equal torchao's
    dynamic tensorwise cast of the whole bf16 weight (as one process's linear makes it)."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic

    whole = trainer.full_state_dict()
    names = {id(m): n for n, m in trainer.model.named_modules()}
    same = []
    for unit in trainer.data_parallel.units:
        if unit.float8 is None:
            continue
        unit.wait()
        for module in unit.float8.modules:
            data, scale = module.float8_weight
            weight = whole[names[id(module)] + ".weight"].to(torch.bfloat16)
            ref = hp_tensor_to_float8_dynamic(weight, torch.float8_e4m3fn,
                                              module.linear_mm_config)
            same.append(torch.equal(data.view(torch.uint8), ref._data.view(torch.uint8))
                        and torch.equal(scale, ref._scale))
        unit.free()
    return same


def two_ranks() -> dict:
    """The bf16 all-gather's training, the float8 one's compiled (the eager one is
    test_fp8's dp=2 ZeRO-3 case), and both's bytes: run in test_fp8's launch of two ranks."""
    plans = [mt.Plan(dp=2, zero=3, zero3_fp8_gather=False, **FP8),    # bf16 on the wire
             mt.Plan(dp=2, zero=3, compile="aot_eager", **FP8)]        # float8, compiled
    return {"trained": [eq.train(plan, "gpt", "sgd", steps=STEPS) for plan in plans],
            "bytes": {gather: step_bytes(gather) for gather in (False, None)}}


def expected_all_gather(float8: set[str], rank: int, n: int = 2) -> int:
    """Bytes rank `rank` sends in one step's all-gathers: each unit's parts padded to a
    multiple of n, the float8 weights' part 1 byte an element, the rest 2; every unit
    gathered for forward and again for backward but the last (the GPT's embed, blocks,
    head: no root)."""
    sizes = {n_: p.numel() for n_, p in eq.gpt().named_parameters()}
    units = ["embed", "blocks.0", "blocks.1", "head"]
    total = 0
    for u in units:
        mine = [k for k in sizes if k.startswith(u + ".")]
        parts = [(sum(sizes[k] for k in mine if k in float8), 1),
                 (sum(sizes[k] for k in mine if k not in float8), 2)]
        per_gather = sum(ring_half_elements(-(-k // n) * n, n, rank) * b for k, b in parts)
        total += per_gather * (1 if u == units[-1] else 2)
    return total


def check_float8_gather(r: dict, float8: dict, rank: int) -> None:
    """`r`: two_ranks() on `rank`; `float8`: the eager float8 all-gather's training."""
    bf16, compiled = r["trained"]
    for other in (float8, compiled):   # the same casts: bit for bit
        assert other["losses"] == bf16["losses"]
        for name, value in bf16["state"].items():
            assert torch.equal(other["state"][name], value), name
    by_bf16, by_float8 = r["bytes"][False], r["bytes"][None]
    weights = {f"{m}.weight" for m in by_float8["float8"]}
    assert len(weights) == 12   # q, k, v, proj, fc, proj of both blocks
    assert by_float8["casts"] == [True] * 12   # one process's cast of the whole weight
    assert by_float8["ag"]["sent"] == expected_all_gather(weights, rank)
    assert by_bf16["ag"]["sent"] == expected_all_gather(set(), rank)
    assert by_float8["ag"]["sent"] < 0.6 * by_bf16["ag"]["sent"]
    # the scales: one all-reduce of the 12 amaxes (fp32) a step; none in bf16
    assert by_float8["amax"]["calls"] == 1
    assert by_float8["amax"]["sent"] == ring_all_reduce_elements(12, 2, rank) * 4
    assert by_bf16["amax"]["calls"] == 0


def test_float8_gather_is_tensorwise_only_and_needs_zero3_and_fp8():
    assert mt.Plan(zero=3, **FP8).float8_gather
    assert not mt.Plan(zero=3, fp8_recipe="rowwise", **FP8).float8_gather   # bf16 there
    assert not mt.Plan(zero=3, zero3_fp8_gather=False, **FP8).float8_gather
    with pytest.raises(mt.PlanError, match="zero3_fp8_gather with fp8_recipe='rowwise': a "
                                           "float8 all-gather is built for tensorwise"):
        check_plan(mt.Plan(zero=3, fp8_recipe="rowwise", zero3_fp8_gather=True, **FP8))
    with pytest.raises(mt.PlanError, match="zero3_fp8_gather all-gathers ZeRO-3's float8 "
                                           "linears' weights in float8, but Plan.zero=2"):
        check_plan(mt.Plan(zero=2, zero3_fp8_gather=True, **FP8))
