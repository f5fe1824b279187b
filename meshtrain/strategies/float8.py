"""Float8 training (`Plan(precision="fp8")`): the linear layers' matmuls in float8 through
torchao's float8 training (torchtitan's recipe), bf16 everywhere else, fp32 master weights
as under bf16 (strategies/shared/precision.py).

Each converted `nn.Linear` casts its input and weight to e4m3 and its output's gradient to
e5m2 with a scale per tensor ("tensorwise") or per row ("rowwise"), dynamic (from this
step's amax), then multiplies in float8. The scales come from the tensors this rank holds:
under data parallelism from its shard of the batch (under cp from its chunks of the
sequences, in a pipeline from the micro-batch), so such a plan equals one process to
within float8's rounding, not bit for bit. Left in bf16: the output layer (and what follows
the last decoder layer), and every linear whose dims are not multiples of 16 (torchao's
`_scaled_mm` needs them). `Plan.fp8_emulate` runs the same casts with the matmul emulated
in high precision: on a CPU, or a GPU without float8 matmuls, for tests only.

Under ZeRO-3 with tensorwise scaling (`Plan.float8_gather`, the default there) the weights
of the float8 linears cross the all-gather in e4m3, as FSDP2 with torchao's
`enable_fsdp_float8_all_gather` does (strategies/zero/float8_gather.py): each weight's scale
from its whole amax, a max all-reduced over the ZeRO-3 group from the shards' pieces once a
step, each piece cast by torchao before the gather (half bf16's bytes), the linear handed
its weight already cast. The cast is one process's bit for bit, so the training is the bf16
all-gather's (`zero3_fp8_gather=False`) exactly. Rowwise scaling casts the weight along
each dim apart and torchao has no float8 all-gather for it: its weights gather in bf16, and
each Float8Linear casts what ZeRO-3 gathered as one process does.

Compiled blocks (strategies/compile.py) trace the float8 linears inside each block:
aot_eager runs eager's numbers exactly; CUDA graphs are not checked with float8 (refused).

Under pipeline parallel the whole model is converted before it is cut into stages: each
stage keeps its own float8 linears, the last one its output layer in bf16.

Under tensor parallel the column- and row-parallel layers (strategies/tensor_parallel)
hold slices of their weights and are not nn.Linear: each eligible one gets a `SplitFloat8`
product, whose scales (tensorwise or rowwise) are the whole tensors' (an amax across the
split all-reduced over tp), so each rank casts exactly as one process does (the whole
layer's dims and the slice's must be multiples of 16). Under sequence parallel a float8
column layer saves its slice of the input, as a bf16 one does (tensor_parallel/sequence.py).
"""
from __future__ import annotations

import importlib.util

import torch
from torch import nn

from meshtrain.core.comm import Comm
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


def convert_to_fp8(model: nn.Module, recipe: str, emulate: bool, comm: Comm) -> list[str]:
    """Swap the model's eligible nn.Linear modules for torchao's Float8Linear, in place
    (parameters and their names unchanged), and give each eligible tensor-parallel linear
    (a module with `float8_split`) its `SplitFloat8` matmul over `comm`'s tp axis; returns
    the names converted."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    kept = _bf16_modules(model)

    def eligible(module: nn.Module, name: str) -> bool:
        return (isinstance(module, nn.Linear) and id(module) not in kept
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    def eligible_split(module: nn.Module) -> bool:
        # what one process converts (an nn.Linear's layout, not transformers' Conv1D), by
        # the whole layer's dims; the slice's must suit torchao too
        dims = ("in_features", "out_features", "full_in", "full_out")
        return (getattr(module, "float8_split", None) is not None and id(module) not in kept
                and not module.conv1d and all(getattr(module, d) % 16 == 0 for d in dims))

    names = [n for n, m in model.named_modules() if eligible(m, n) or eligible_split(m)]
    _warn_split_in_bf16(model, kept)
    if recipe == "tensorwise":
        config = Float8LinearConfig(emulate=emulate)
    else:
        config = Float8LinearConfig.from_recipe_name(recipe)
        config = Float8LinearConfig(**{**vars(config), "emulate": emulate})
    convert_to_float8_training(model, config=config, module_filter_fn=eligible)
    for module in model.modules():
        if eligible_split(module):
            module.float8 = SplitFloat8(config, comm, module.float8_split)
    return names


def _warn_split_in_bf16(model: nn.Module, kept: set[int]) -> None:
    """Say which tensor-parallel linears one process would run in float8 (the whole layer's
    dims are multiples of 16) but whose slice here is not, so they stay in bf16."""
    import warnings

    whole = ("full_in", "full_out")
    left = [n for n, m in model.named_modules()
            if getattr(m, "float8_split", None) is not None and id(m) not in kept
            and not m.conv1d and all(getattr(m, d) % 16 == 0 for d in whole)
            and (m.in_features % 16 or m.out_features % 16)]
    if left:
        warnings.warn(f"precision='fp8' with tp: {', '.join(left[:4])}"
                      f"{' ...' if len(left) > 4 else ''} stay in bf16: their slices are not "
                      "multiples of 16 (torchao's float8 matmul needs them), though the whole "
                      "layers' are, so these differ from one process's float8; use a tp that "
                      "keeps each slice a multiple of 16", stacklevel=3)


class SplitFloat8:
    """Y = X·Wᵀ in float8 for a tensor-parallel linear holding a slice of W.

    torchao casts each operand of each of its three products with a scale from the
    operand's amax: over the whole tensor (tensorwise), or along one dim (rowwise: one per
    row or column). An amax taken across a dim that tp splits is not the whole tensor's, so
    here it is all-reduced (max) over tp first, and each rank casts exactly as one process
    casts the whole. Split over tp: Wᵀ (in, out) always, by columns in a column-parallel
    layer (`split="output"`) and by rows in a row-parallel one (`split="input"`); X
    (tokens, in) by columns in a row layer; dY (tokens, out) by columns in a column layer.
    (torchao's DTensor path reaches the same through its amax of a sharded DTensor.)
    """

    def __init__(self, config, comm: Comm, split: str) -> None:
        from torchao.float8.float8_linear import Float8Linear

        self.config, self.comm, self.split = config, comm, split
        self.split_dims = {"x": 1 if split == "input" else None,     # X (tokens, in)
                           "w": 0 if split == "input" else 1,        # Wᵀ (in, out)
                           "g": 1 if split == "output" else None}    # dY (tokens, out)
        # torchao's per-gemm settings (emulation, fast accumulation), as its linear builds them
        with torch.device("meta"):
            self.mm_config = Float8Linear(16, 16, bias=False, config=config).linear_mm_config

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`x` (..., in) times `weight` (out, in)ᵀ, this rank's slices."""
        return _SplitFloat8Matmul.apply(x, weight, self)

    # torchao's three products (matmul_with_hp_or_float8_args), on flat (tokens, features)
    # tensors, each operand cast for its product; sequence parallel's column matmul
    # (tensor_parallel/sequence.py) runs them too. `scales` carries what forward found to
    # backward: as torchao, X and W are kept in bf16, not as float8 copies, and cast again.
    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Y = X·Wᵀ, and the scales found."""
        from torchao.float8.float8_training_tensor import GemmInputRole as Role

        c, scales = self.config, {}
        x8 = self.cast(x, "x", c.cast_config_input, -1, Role.INPUT, scales)
        w8 = self.cast(weight.t(), "w", c.cast_config_weight, 0, Role.WEIGHT, scales)
        return torch.mm(x8, w8), scales

    def grad_input(self, grad: torch.Tensor, weight: torch.Tensor, scales: dict):
        """dX = dY·W."""
        from torchao.float8.float8_training_tensor import GemmInputRole as Role

        c = self.config
        g8 = self.cast(grad, "g", c.cast_config_grad_output, -1, Role.GRAD_OUTPUT, scales)
        w8 = self.cast(weight.t(), "w", c.cast_config_weight_for_grad_input, -1, Role.WEIGHT,
                       scales)
        return torch.mm(g8, w8.t())

    def grad_weight(self, grad: torch.Tensor, x: torch.Tensor, scales: dict):
        """dW = dYᵀ·X, (out, in)."""
        from torchao.float8.float8_training_tensor import GemmInputRole as Role

        c = self.config
        g8 = self.cast(grad, "g", c.cast_config_grad_output_for_grad_weight, 0,
                       Role.GRAD_OUTPUT, scales)
        x8 = self.cast(x, "x", c.cast_config_input_for_grad_weight, 0, Role.INPUT, scales)
        return torch.mm(g8.t(), x8)

    def cast(self, t: torch.Tensor, name: str, config, dim: int, role, scales: dict):
        """Operand `name` as torchao casts it for one product (`config`; rowwise: its amax
        along `dim`), scaled from the whole tensor's amax. A scale found for the same
        operand and cast is reused (tensorwise: one all-reduce for W, not one a product)."""
        from torchao.float8.config import ScalingGranularity, ScalingType
        from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8

        if config.scaling_type is ScalingType.DISABLED:   # this product in high precision
            return t
        axis = dim if config.scaling_granularity is ScalingGranularity.AXISWISE else None
        key = (name, config, axis)
        if key not in scales:
            scales[key] = self.scale(t, config.target_dtype, axis, self.split_dims[name])
        return hp_tensor_and_scale_to_float8(t, scales[key], config.target_dtype,
                                             self.mm_config, role, axis)

    @torch.no_grad()
    def scale(self, t: torch.Tensor, dtype: torch.dtype, axis: int | None,
              split: int | None) -> torch.Tensor:
        """torchao's scale of `t` (tensorwise, or along `axis`), from the whole tensor's
        amax where tp splits `t` along the dims the amax reduces (`split`)."""
        from torchao.float8.float8_utils import amax_to_scale

        if axis is None:
            amax = t.abs().max().float().reshape(1)   # exact: a bf16 value
        else:
            amax = torch.amax(t.abs(), dim=axis, keepdim=True).float()
        if split is not None and (axis is None or axis % t.dim() == split):
            self.comm.all_reduce(amax, "tp", op="max", tag="float8-amax")
        scale = amax_to_scale(amax, dtype, self.config.round_scales_to_power_of_2)
        return scale[0] if axis is None else scale

    def __repr__(self) -> str:
        granularity = self.config.cast_config_weight.scaling_granularity.value
        return f"float8 ({granularity}; amaxes across tp's split taken over tp)"


class _SplitFloat8Matmul(torch.autograd.Function):
    """torchao's float8 matmul (`matmul_with_hp_or_float8_args`) with the scales of
    `SplitFloat8`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, f8: SplitFloat8) -> torch.Tensor:
        x2 = x.reshape(-1, x.size(-1))                                  # (tokens, in)
        y, ctx.scales = f8.forward(x2, weight)
        ctx.save_for_backward(x2, weight)
        ctx.f8 = f8
        return y.view(*x.shape[:-1], y.size(-1))                       # (..., out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x2, weight = ctx.saved_tensors
        f8, scales = ctx.f8, ctx.scales
        g = grad.reshape(-1, grad.size(-1))                             # (tokens, out)
        grad_x = f8.grad_input(g, weight, scales).view(*grad.shape[:-1], x2.size(-1))
        return grad_x, f8.grad_weight(g, x2, scales), None


def _bf16_modules(model: nn.Module) -> set[int]:
    """The output layer and what follows the last decoder layer: kept in bf16."""
    head = model.get_output_embeddings() if hf.is_causal_lm(model) else None
    tail = [head] if head is not None else units_of(model)[-1:]
    return {id(m) for module in tail for m in module.modules()}
