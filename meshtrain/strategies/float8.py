"""Float8 training (`Plan(precision="fp8")`): the linear layers' matmuls in float8 through
torchao's float8 training (torchtitan's recipe), bf16 everywhere else, fp32 master weights
as under bf16 (strategies/shared/precision.py).

Each converted `nn.Linear` casts its input and weight to e4m3 and its output's gradient to
e5m2 with a scale per tensor ("tensorwise") or per row ("rowwise"), dynamic (from this
step's amax), then multiplies in float8. The scales come from the tensors this rank holds:
under data parallelism from its shard of the batch, so a dp plan equals one process to
within float8's rounding, not bit for bit. Left in bf16: the output layer (and what follows
the last decoder layer), and every linear whose dims are not multiples of 16 (torchao's
`_scaled_mm` needs them). `Plan.fp8_emulate` runs the same casts with the matmul emulated
in high precision: on a CPU, or a GPU without float8 matmuls, for tests only.

Under ZeRO-3 (strategies/zero/zero3.py) a Float8Linear reads its weight as ZeRO-3 gathered
it, each forward and again in backward, so its scale is one process's; the all-gather moves
the bf16 weights. torchao's float8 all-gather is FSDP2's (`fully_shard`'s pre/post
all-gather extensions on a weight subclass): here it would take a weight's amax over its
pieces of the flat shards (an all-reduce max per unit), the shards cast to e4m3 before the
gather (half the bytes) and the gathered float8 weight handed to torchao already cast.
"""
from __future__ import annotations

import importlib.util

from torch import nn

from meshtrain.core.plan import PlanError
from meshtrain.models import hf
from meshtrain.models.structure import units_of

TORCHAO = "torchao==0.18.0"   # the release pyproject's `fp8` extra pins


def check_fp8(precision: str, emulate: bool, device: str, capability: tuple | None = None,
              card: str = "") -> None:
    """Refuse fp8 where it cannot run: torchao missing, or a device without float8 matmuls
    (a CPU; a GPU below compute capability 8.9) unless emulation was asked for."""
    if precision != "fp8":
        return
    if importlib.util.find_spec("torchao") is None:
        raise PlanError(f"precision='fp8' trains through torchao's float8, which is not "
                        f"installed; pip install 'meshtrain[fp8]' (or '{TORCHAO}')")
    if emulate:
        return
    if device == "cpu":
        raise PlanError("precision='fp8' on the CPU: a CPU has no float8 matmuls; emulate "
                        "them with fp8_emulate=True (--precision fp8-emulated; slow, for "
                        "tests) or use precision='bf16'")
    if capability is not None and tuple(capability) < (8, 9):
        raise PlanError(f"precision='fp8' on {card or 'this GPU'} (compute capability "
                        f"{capability[0]}.{capability[1]}): float8 matmuls need 8.9 or newer "
                        "(Ada, Hopper); use precision='bf16', or fp8_emulate=True for tests")


def convert_to_fp8(model: nn.Module, recipe: str, emulate: bool) -> list[str]:
    """Swap the model's eligible nn.Linear modules for torchao's Float8Linear, in place
    (parameters and their names unchanged); returns the names converted."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    kept = _bf16_modules(model)

    def eligible(module: nn.Module, name: str) -> bool:
        return (isinstance(module, nn.Linear) and id(module) not in kept
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    names = [n for n, m in model.named_modules() if eligible(m, n)]
    if recipe == "tensorwise":
        config = Float8LinearConfig(emulate=emulate)
    else:
        config = Float8LinearConfig.from_recipe_name(recipe)
        config = Float8LinearConfig(**{**vars(config), "emulate": emulate})
    convert_to_float8_training(model, config=config, module_filter_fn=eligible)
    return names


def _bf16_modules(model: nn.Module) -> set[int]:
    """The output layer and what follows the last decoder layer: kept in bf16."""
    head = model.get_output_embeddings() if hf.is_causal_lm(model) else None
    tail = [head] if head is not None else units_of(model)[-1:]
    return {id(m) for module in tail for m in module.modules()}
