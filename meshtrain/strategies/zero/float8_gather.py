"""ZeRO-3 all-gathers the float8 linears' weights in float8 (`Plan.float8_gather`: zero=3,
precision="fp8", tensorwise scaling; strategies/float8.py).

torchao's tensorwise Float8Linear casts its bf16 weight to e4m3 with one scale, from the
amax of the whole weight, in forward, and uses that cast again in backward. Here the cast
happens before the all-gather instead, on the shards, exactly as one process makes it:

    scales   each weight's amax over its pieces in this rank's flat shards, one all-reduce
             (max) over the ZeRO-3 group for every float8 weight of the model, once after
             each optimizer step (torchtitan's `precompute_float8_dynamic_scale_for_fsdp`);
             the scale from it by torchao's own `amax_to_scale`
    gather   each piece cast to e4m3 with its weight's scale (torchao's own cast), the
             unit's float8 part all-gathered as 1 byte an element (bf16's half)
    compute  the linear gets its weight already cast (a Float8TrainingTensor over the
             gathered bytes) and casts nothing; the gradient reaches the parameter as bf16's

A max is exact and the cast is elementwise, so the gathered bytes and scale are one
process's bit for bit, and so is the training. The float8 weights of a unit form a bucket
of their own (a second part of the unit, beside its bf16 one: biases, norms, and the
linears kept in bf16), gathered and freed with it; their gradients are reduced as before.
While gathered, such a parameter points at a zero-sized stand-in of its shape (autograd
checks its gradient's shape against it), not at bf16 values: nothing but its linear reads it.
Rowwise scaling casts the weight along each dim apart (torchao has no float8 all-gather for
it): its weights stay bf16 on the wire.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from meshtrain.core.comm import Comm
from meshtrain.core.plan import Plan
from meshtrain.strategies.shared.buckets import Bucket
from meshtrain.strategies.shared.flat import FlatLayout


def float8_weights(model: nn.Module, plan: Plan) -> dict[int, nn.Module]:
    """id(weight) -> its torchao Float8Linear, for the weights gathered in float8 under
    `plan`: each such linear's own trainable weight (one a module shares, as a tied one, is
    read by the others in bf16 and stays so)."""
    if not plan.float8_gather:
        return {}
    from torchao.float8.float8_linear import Float8Linear

    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    linears = [m for m in model.modules() if isinstance(m, Float8Linear)
               and m.weight.requires_grad and owners[id(m.weight)] == 1]
    for m in linears:   # the same module, its forward taking the weight ZeRO-3 cast
        m.__class__ = _gathered_class(type(m))
    return {id(m.weight): m for m in linears}


def split_float8(params: list[nn.Parameter], weights: dict[int, nn.Module]
                 ) -> list[list[nn.Parameter]]:
    """`params` of one unit as the parts gathered apart: float8 weights, then the rest."""
    float8 = [p for p in params if id(p) in weights]
    rest = [p for p in params if id(p) not in weights]
    return [part for part in (float8, rest) if part]


def float8_part(bucket: Bucket, shard: torch.Tensor, layout: FlatLayout,
                weights: dict[int, nn.Module], scales: "Float8Scales") -> "Float8Part | None":
    """The Float8Part of ZeRO-3's `bucket` (its shard `shard`), if it holds float8 weights."""
    if not bucket.params or id(bucket.params[0]) not in weights:
        return None
    return Float8Part(bucket, layout, weights, scales, lambda: shard.to(bucket.device))


class Float8Scales:
    """Every float8 weight's scale, found from the shards once after each step."""

    def __init__(self, comm: Comm, axis: str) -> None:
        self.comm, self.axis = comm, axis
        self.parts: list[Float8Part] = []
        self.scales: torch.Tensor | None = None

    def add(self, part: "Float8Part") -> int:
        """Register `part`; the index of its first weight's scale."""
        self.parts.append(part)
        return sum(len(p.modules) for p in self.parts[:-1])

    def changed(self) -> None:
        """The shards changed (a step, a load): the next gather finds the scales again."""
        self.scales = None

    @torch.no_grad()
    def current(self) -> torch.Tensor:
        if self.scales is None:
            from torchao.float8.float8_utils import amax_to_scale

            amax = torch.cat([part.amaxes() for part in self.parts])
            self.comm.all_reduce(amax, self.axis, op="max", tag="float8-amax")
            config = self.parts[0].modules[0].config
            self.scales = amax_to_scale(amax, config.cast_config_weight.target_dtype,
                                        config.round_scales_to_power_of_2)
        return self.scales


class Float8Part:
    """The float8 part of a ZeRO-3 unit: a bucket of float8 linears' weights, cast to e4m3
    on this rank's shard before the all-gather and handed to the linears after it."""

    def __init__(self, bucket: Bucket, layout: FlatLayout, weights: dict[int, nn.Module],
                 scales: Float8Scales, shard) -> None:
        self.bucket, self.shard = bucket, shard   # `shard()`: this rank's, on the device
        self.modules = [weights[id(p)] for p in bucket.params]
        pieces = [p for p in layout.pieces if p.bucket == bucket.index]
        self.owned = [layout.owned(piece) for piece in pieces]   # (lo, hi) in the shard
        self.scales, self.first = scales, scales.add(self)
        self.cast_with: torch.Tensor | None = None   # the scales of the bytes gathered
        device = bucket.device
        self.stand_in = torch.zeros(1, dtype=torch.bfloat16, device=device)

    def amaxes(self) -> torch.Tensor:
        """Each weight's amax over its piece of this rank's shard (0 for none), in fp32."""
        shard = self.shard()
        return torch.stack([shard[lo:hi].abs().max().float() if hi > lo
                            else shard.new_zeros((), dtype=torch.float32)
                            for lo, hi in self.owned])

    @torch.no_grad()
    def cast(self, shard: torch.Tensor) -> torch.Tensor:
        """This rank's shard as e4m3 bytes: each weight's piece cast with its scale."""
        from torchao.float8.float8_training_tensor import (GemmInputRole,
                                                           hp_tensor_and_scale_to_float8)

        out = torch.zeros(shard.numel(), dtype=torch.uint8, device=shard.device)
        scales = self.cast_with = self.scales.current()
        for j, (module, (lo, hi)) in enumerate(zip(self.modules, self.owned)):
            if hi > lo:
                cast = hp_tensor_and_scale_to_float8(
                    shard[lo:hi], scales[self.first + j],
                    module.config.cast_config_weight.target_dtype, module.linear_mm_config,
                    GemmInputRole.WEIGHT)
                out[lo:hi] = cast._data.view(torch.uint8)
        return out

    def point_at(self, whole: torch.Tensor | None) -> None:
        """Hand each linear its gathered weight (`whole`: the unit's e4m3 bytes), or take
        it back (None)."""
        scales = self.cast_with
        for j, (module, offset, shape, p) in enumerate(zip(
                self.modules, self.bucket.offsets, self.bucket.shapes, self.bucket.params)):
            if whole is None:
                module.float8_weight = None
                p.data = self.stand_in[:0]
                continue
            dtype = module.config.cast_config_weight.target_dtype
            data = whole[offset:offset + shape.numel()].view(dtype).view(shape)
            module.float8_weight = (data, scales[self.first + j])
            p.data = self.stand_in.expand(shape)


class _CastWeight(torch.autograd.Function):
    """The weight as the linear uses it: already cast (`data`, `scale`); its gradient goes
    to the parameter unchanged."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                mm_config) -> torch.Tensor:
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

        return Float8TrainingTensor(data, scale, weight.dtype, mm_config, GemmInputRole.WEIGHT)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None, None


@functools.cache
def _gathered_class(base: type) -> type:
    """`base` (torchao's Float8Linear) whose forward takes the weight ZeRO-3 gathered in
    float8 (`float8_weight`, set while its unit is gathered)."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.float8_weight is None:
            return base.forward(self, input)
        weight = _CastWeight.apply(self.weight, *self.float8_weight, self.linear_mm_config)
        output = matmul_with_hp_or_float8_args.apply(input, weight.t(), self.linear_mm_config,
                                                     self.config)
        return output if self.bias is None else output + self.bias.to(output.dtype)

    return type(base.__name__, (base,), {"forward": forward, "float8_weight": None,
                                         "__module__": __name__, "__doc__": base.__doc__})
