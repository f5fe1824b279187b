"""The training setup a plan is judged under, and a Candidate: a Plan plus what Plan lacks.

`meshtrain.Plan` says how ranks are laid out (dp, pp, tp, ZeRO, schedule, micro-batches).
The planner also decides the micro-batch size and activation recomputation, and assumes
sequence parallelism beside tensor parallelism (Korthikanti et al. 2022: same communication
volume as tensor parallel alone, activations divided by t); those live in `Candidate`.
"""
from __future__ import annotations

import dataclasses

from dataclasses import dataclass

from meshtrain.core.plan import Plan

RECOMPUTE = ("none", "selective", "attention", "full")
OPTIMIZERS = ("adam", "sgd")


def element_bytes(precision: str | None) -> int:
    """Bytes of one compute-precision element: 2 in bf16 (and fp8, whose linears take bf16
    inputs and keep them for backward), else 4."""
    return 2 if precision in ("bf16", "fp8") else 4


class SetupError(ValueError):
    """A training setup that cannot be planned: the message names the value and the fix."""


@dataclass(frozen=True)
class Setup:
    global_batch: int = 8
    """Sequences per optimizer step, over all data-parallel replicas."""
    micro_batch: int = 0
    """Sequences per micro-batch per replica; 0 lets the planner choose."""
    precision: str = "bf16"
    """"bf16" (mixed precision: 16-bit weights, gradients, activations; fp32 master), "fp8"
    (bf16's, with the block linears' matmuls in float8: torchao's float8 training) or "fp32"."""
    optimizer: str = "adam"
    """"adam" (two fp32 moments) or "sgd" (momentum: one)."""
    recompute: str = ""
    """"none" | "selective" | "attention" | "full"; "" lets the planner choose the cheapest
    that fits."""
    sequence_parallel: bool = True
    """Shard LayerNorm/dropout activations along the sequence beside tensor parallelism."""
    expert_imbalance: float = 1.0
    """A mixture of experts: the busiest expert-parallel rank's routed tokens against the
    mean (1.0: routed evenly; planner/experts.py)."""

    def __post_init__(self) -> None:
        if not isinstance(self.global_batch, int) or self.global_batch < 1:
            raise SetupError(f"--global-batch {self.global_batch!r}: must be a whole number >= 1")
        if not isinstance(self.micro_batch, int) or self.micro_batch < 0:
            raise SetupError(f"--micro-batch {self.micro_batch!r}: must be a whole number >= 1 "
                             f"(or leave it out to let the planner choose)")
        if self.micro_batch and self.global_batch % self.micro_batch:
            raise SetupError(f"--global-batch {self.global_batch} is not a multiple of "
                             f"--micro-batch {self.micro_batch}; make it one")
        if self.precision not in ("bf16", "fp8", "fp32"):
            raise SetupError(f"--precision {self.precision!r}: choose 'bf16', 'fp8' or 'fp32'")
        if self.optimizer not in OPTIMIZERS:
            raise SetupError(f"--optimizer {self.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
        if self.recompute and self.recompute not in RECOMPUTE:
            raise SetupError(f"--recompute {self.recompute!r}: choose one of {', '.join(RECOMPUTE)}")
        if not isinstance(self.expert_imbalance, (int, float)) or self.expert_imbalance < 1:
            raise SetupError(f"--expert-imbalance {self.expert_imbalance!r}: the busiest rank's "
                             f"routed tokens over the mean, a number >= 1 (1: even routing)")

    # Bytes per parameter (ZeRO, Rajbhandari et al. 2020, §3.1 and Table 1): mixed-precision
    # Adam keeps 2-byte weights, 2-byte gradients and K = 12 bytes of optimizer state (fp32
    # master weights, momentum, variance). In fp32 the weights are the master copy: 4 + 4 + 8.
    @property
    def param_bytes(self) -> int:
        return element_bytes(self.precision)

    @property
    def grad_bytes(self) -> int:
        return self.param_bytes

    @property
    def optim_bytes(self) -> int:
        """K: optimizer-state bytes per parameter."""
        moments = 8 if self.optimizer == "adam" else 4
        return moments + (4 if self.precision != "fp32" else 0)

    @property
    def act_bytes(self) -> int:
        return self.param_bytes


@dataclass(frozen=True)
class Candidate:
    """One plan the advisor weighs: the Plan plus micro-batch size and recomputation."""
    plan: Plan
    micro_batch: int
    recompute: str = "none"
    sequence_parallel: bool = True

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.plan.tp > 1

    def full_plan(self) -> Plan:
        """The Plan that runs it: recomputation and sequence parallel set on it."""
        return dataclasses.replace(self.plan, recompute=self.recompute, sequence_parallel=self.sp)

    def label(self) -> str:
        p = self.plan
        parts = [f"dp{p.dp}"]
        if p.pp > 1:
            sched = p.schedule + (f"x{p.virtual_stages}" if p.virtual_stages > 1 else "")
            parts.append(f"pp{p.pp}:{sched}" + (":by-params" if p.stage_balance == "parameters"
                                                 and not p.stage_cuts else ""))
        if p.tp > 1:
            parts.append(f"tp{p.tp}" + ("+sp" if self.sp else ""))
        if p.cp > 1:
            parts.append(f"cp{p.cp}" + (":a2a" if p.cp_style == "all-to-all" else ""))
        if p.ep > 1:
            parts.append(f"ep{p.ep}")
        if p.zero:
            parts.append(f"zero{p.zero}" + (":regather" if p.zero3_regather else ""))
        if p.offload != "none":
            parts.append(f"off:{p.offload}")
        parts.append(f"m{p.microbatches}xb{self.micro_batch}")
        if self.recompute != "none":
            parts.append(f"rc:{self.recompute}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        return {"plan": self.plan.to_dict(), "micro_batch": self.micro_batch,
                "recompute": self.recompute, "sequence_parallel": self.sp,
                "label": self.label()}
