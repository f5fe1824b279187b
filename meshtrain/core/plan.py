"""The Plan: one frozen, validated description of how a model is parallelised.

A Plan says nothing about which machine it runs on; `check_world_size` ties it to one.
Every field is validated in `__post_init__` with a message that names the offending value
and how to fix it, so a bad plan fails before any process group exists.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields

DP_MODES = ("ddp", "dp", "ps-sync", "ps-async", "diloco", "local-sgd")
LOCAL_STEP_MODES = ("diloco", "local-sgd")   # workers step alone, sync every `sync_every`
OFFLOADS = ("none", "cpu", "disk")
SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1")
PRECISIONS = ("fp32", "bf16", "fp8")
FP8_RECIPES = ("tensorwise", "rowwise")
RECOMPUTES = ("none", "full", "selective", "attention")
COMPRESSIONS = ("none", "powersgd")
COMPILE_BACKENDS = ("inductor", "aot_eager", "cudagraphs")   # compile=True is "inductor"
CP_STYLES = ("ring", "all-to-all")
STAGE_BALANCES = ("compute", "parameters")
DDP_FIRST_BUCKET_MB = 1.0   # DDP's first bucket, as torch DDP's (strategies/data_parallel/ddp.py)


class PlanError(ValueError):
    """A Plan that cannot be built: the message says what is wrong and how to fix it."""


@dataclass(frozen=True)
class Plan:
    dp: int = 1
    """Data-parallel replicas (or ZeRO shards): each feeds its own shard of the global batch."""
    pp: int = 1
    """Pipeline stages: the model's layers split into this many consecutive groups."""
    tp: int = 1
    """Tensor-parallel width: each layer's matrices split across this many ranks (one node)."""
    cp: int = 1
    """Context-parallel width: every sequence split over this many ranks (2*cp chunks, rank i
    holding chunks i and 2cp-1-i so that causal attention's work is balanced)."""
    cp_style: str = "ring"
    """cp > 1: how attention crosses the cp axis: "ring" (K/V blocks passed round the ring,
    partial results merged by log-sum-exp) | "all-to-all" (heads scattered, the sequence
    gathered, as DeepSpeed Ulysses)."""
    ep: int = 1
    """Expert-parallel width: each MoE layer's experts split over this many ranks, taken from
    the data-parallel ranks (ep divides dp; each expert is data-parallel over dp / ep)."""
    capacity_factor: float | None = None
    """A mixture of experts: None routes every top-k choice (dropless); C > 0 lets each
    expert of each MoE layer take at most ceil(C x S x top_k / experts) choices of each
    sequence of S tokens, dropping the rest (models/experts.py, [Note: capacity per sequence])."""
    dp_mode: str = "ddp"
    """How data-parallel gradients are combined: "ddp" | "dp" | "ps-sync" | "ps-async" |
    "diloco" | "local-sgd" (workers step alone; see sync_every)."""
    staleness: int = 0
    """ps-async only: how many steps a worker's parameters may lag the server's."""
    ps_shards: int = 1
    """ps-sync / ps-async: servers the flat parameters are split over (contiguous shards;
    shard k on dp rank k), so that no single root carries every byte."""
    zero: int = 0
    """ZeRO stage: 0 none, 1 optimizer states, 2 + gradients, 3 + parameters sharded over dp."""
    offload: str = "none"
    """Where ZeRO keeps what it offloads: "none" | "cpu" | "disk"."""
    microbatches: int = 1
    """Micro-batches per step: gradient accumulation under DP, pipeline depth under PP."""
    schedule: str = "1f1b"
    """Pipeline schedule: "naive" | "gpipe" | "1f1b" | "interleaved" | "zb-h1" (used when
    pp > 1; zb-h1 is zero bubble, Qi et al. 2023)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank; > 1 only with the interleaved schedule."""
    bucket_mb: float = 25.0
    """Gradient bucket size in MiB: the unit of overlapped communication. 25 as torch DDP's
    cap: on CPU, gloo's reductions compete with backward for the same cores, so a few large
    buckets beat many small ones (measured: 1 MiB buckets cost 13% per step at world 2)."""
    precision: str = "fp32"
    """Compute precision: "fp32" | "bf16" | "fp8" (the linear layers' matmuls in float8
    through torchao, bf16 elsewhere; strategies/float8.py)."""
    fp8_recipe: str = "tensorwise"
    """precision="fp8": one scale per tensor ("tensorwise") or per row ("rowwise")."""
    fp8_emulate: bool = False
    """precision="fp8": emulate the float8 matmuls (a CPU, a GPU without them; tests only)."""
    recompute: str = "none"
    """Activation recomputation: "none" | "full" (keep each layer's input, recompute the
    layer in backward) | "selective" (per op: keep each layer's matmul and attention outputs,
    recompute its elementwise ops) | "attention" (recompute only the attention core)."""
    recompute_every: int = 1
    """recompute="full" only: recompute every k-th decoder layer (layers k-1, 2k-1, ...;
    torchtitan's frequency), the others keep everything: memory between none and full."""
    sync_every: int = 1
    """diloco / local-sgd only: inner steps each worker takes alone between two syncs (H):
    the dp axis carries one parameter-sized all-reduce per H steps."""
    outer_lr: float = 0.7
    """diloco only: the outer SGD's learning rate on the averaged pseudo-gradient
    (Douillard et al. 2023 use 0.7; local-sgd is outer lr 1 without momentum)."""
    outer_momentum: float = 0.9
    """diloco only: the outer SGD's Nesterov momentum, in [0, 1) (0.9 in the paper)."""
    sequence_parallel: bool = False
    """With tp > 1: split the LayerNorm and residual regions along the sequence over the tp
    ranks (Korthikanti et al. 2022), each all-reduce becoming a reduce-scatter plus an
    all-gather; their activation memory falls by tp."""
    compression: str = "none"
    """DDP's gradient sync: "none" | "powersgd" (each large gradient sent as rank
    `compression_rank` factors, with error feedback; Vogels et al. 2019)."""
    compression_rank: int = 4
    """powersgd only: the factors' rank r (min(M, N) where r is larger: exact)."""
    compression_min_rate: float = 2.0
    """powersgd only: an M x N gradient is compressed where MN / ((M+N) r) exceeds this."""
    compile: bool | str = False
    """torch.compile each transformer block (True: the "inductor" backend; "cudagraphs":
    inductor whose graphs are replayed as CUDA graphs, torch.compile's mode="reduce-overhead",
    which takes the host's launch work out of a step on a GPU (inductor alone on a CPU);
    "aot_eager" traces and partitions the same graphs without generating code, for
    debugging). Module hooks, gradient hooks and collectives stay outside the compiled
    regions."""
    sync_warmup_steps: int = 0
    """diloco / local-sgd / powersgd: the first K steps all-reduce whole gradients every
    step, as DDP does; the slow-link method starts at step K (DiLoCo's anchor is the
    parameters there). Early training is the most sensitive to inexact updates: Douillard et
    al. 2023 start DiLoCo from a DDP-trained model, torch's PowerSGD hook runs plain
    all-reduce for its first `start_powerSGD_iter` steps. 0: the method from the first step
    (a good K depends on the run's length, so none is assumed)."""
    # ---- knobs that shape a run beyond the mesh (checked by core/admit.check_plan) ------
    max_grad_norm: float | None = None
    """Clip gradients to this global norm over every axis (None: no clipping)."""
    offload_dir: str | None = None
    """Where offload="disk" writes (None: a temporary folder; `meshtrain train`: the run
    folder's offload/)."""
    zero3_units: tuple[str, ...] | None = None
    """zero=3: module names gathered and freed as one unit (None: the model's layers)."""
    zero3_regather: bool = False
    """zero=3 under pp > 1: gather each unit for every micro-batch's forward and again for its
    backward, reduce-scatter its gradients every micro-batch (a unit or two gathered at a
    time, 2M gathers a step). False: torchtitan's policy, each unit gathered once a step and
    kept, with its whole gradients, to the stage's last backward (one gather a step)."""
    zero3_fp8_gather: bool | None = None
    """zero=3, precision="fp8": all-gather the float8 linears' weights in e4m3, cast with
    their whole weights' scales (half bf16's bytes, the same numbers;
    strategies/zero/float8_gather.py). None: where it is built (fp8_recipe="tensorwise");
    False: in bf16, as the other parameters."""
    stage_cuts: tuple[int, ...] | None = None
    """pp > 1: index of the first layer of stages 1..S-1 (None: balanced by stage_balance)."""
    stage_balance: str = "compute"
    """pp > 1 without stage_cuts: what the stages are balanced by: "compute" (each layer's
    training FLOPs per token: the embedding ~0, the head's matmul and the loss) |
    "parameters" (each layer's parameter count: memory)."""
    tp_plan: tuple[tuple[str, str], ...] | None = None
    """tp > 1: (module-name pattern, "column" | "row" | "vocab") pairs, given as a dict or
    pairs (None: the model's own, for the GPT and transformers models)."""
    measure_activations: bool = False
    """Count the activation bytes each step keeps for backward (memory_report)."""

    def __post_init__(self) -> None:
        _freeze_knobs(self)
        for name in ("dp", "pp", "tp", "cp", "ep", "microbatches", "virtual_stages",
                     "ps_shards"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"Plan.{name}={value!r}: must be a whole number >= 1")
        _choose("dp_mode", self.dp_mode, DP_MODES)
        _check_cp_ep(self)
        _choose("offload", self.offload, OFFLOADS)
        _choose("schedule", self.schedule, SCHEDULES)
        _choose("precision", self.precision, PRECISIONS)
        _choose("recompute", self.recompute, RECOMPUTES)
        _choose("stage_balance", self.stage_balance, STAGE_BALANCES)
        _check_recompute_every(self)
        _check_fp8(self)
        if not isinstance(self.zero, int) or self.zero not in (0, 1, 2, 3):
            raise PlanError(f"Plan.zero={self.zero!r}: must be 0, 1, 2 or 3")
        if not isinstance(self.staleness, int) or self.staleness < 0:
            raise PlanError(f"Plan.staleness={self.staleness!r}: must be a whole number >= 0")
        if self.staleness and self.dp_mode != "ps-async":
            raise PlanError(f"Plan.staleness={self.staleness} only applies to dp_mode='ps-async' "
                            f"(got dp_mode={self.dp_mode!r}); drop staleness or use ps-async")
        if self.ps_shards > 1 and not self.dp_mode.startswith("ps-"):
            raise PlanError(f"Plan.ps_shards={self.ps_shards} shards a parameter server and "
                            f"needs dp_mode='ps-sync' or 'ps-async' (got {self.dp_mode!r})")
        if self.ps_shards > self.dp:
            raise PlanError(f"Plan.ps_shards={self.ps_shards} is more server shards than the "
                            f"dp={self.dp} ranks that host them (shard k lives on dp rank k); "
                            f"use ps_shards <= {self.dp}")
        if not (isinstance(self.bucket_mb, (int, float)) and self.bucket_mb > 0):
            raise PlanError(f"Plan.bucket_mb={self.bucket_mb!r}: must be a positive size in MiB")
        if self.offload != "none" and self.zero == 0:
            raise PlanError(f"Plan.offload={self.offload!r} needs ZeRO (zero >= 1): "
                            "offload moves sharded states; set zero=1, 2 or 3")
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise PlanError(f"Plan.virtual_stages={self.virtual_stages} needs "
                            f"schedule='interleaved' (got {self.schedule!r})")
        if self.schedule == "interleaved" and self.pp > 1 and self.microbatches % self.pp:
            raise PlanError(f"Plan.schedule='interleaved' sends micro-batches round the "
                            f"{self.pp} stages in groups of pp: microbatches="
                            f"{self.microbatches} must be a multiple of pp={self.pp} (e.g. "
                            f"microbatches={self.pp * max(1, round(self.microbatches / self.pp))})")
        if not isinstance(self.sequence_parallel, bool):
            raise PlanError(f"Plan.sequence_parallel={self.sequence_parallel!r}: must be True "
                            "or False")
        if self.sequence_parallel and self.tp == 1:
            raise PlanError("Plan.sequence_parallel=True splits activations over the tp axis "
                            "and needs tp > 1 (got tp=1); set tp=2 or more (e.g. "
                            "Plan(tp=2, sequence_parallel=True)), or drop sequence_parallel")
        _check_local_steps(self)
        _check_compression(self)
        if not (isinstance(self.compile, bool) or self.compile in COMPILE_BACKENDS):
            raise PlanError(f"Plan.compile={self.compile!r}: choose True (inductor), False, "
                            f"or a backend name: {', '.join(map(repr, COMPILE_BACKENDS))}")
        if self.zero and self.dp_mode != "ddp":
            raise PlanError(f"Plan.zero={self.zero} shards over data-parallel ranks and needs "
                            f"dp_mode='ddp' (got {self.dp_mode!r})")

    @property
    def mesh_dp(self) -> int:
        """Ranks along the mesh's dp axis: dp, except under dp_mode="dp", whose replicas are
        threads of one process (ARCHITECTURE.md: DP is the one-process exception)."""
        return 1 if self.dp_mode == "dp" else self.dp

    @property
    def compile_backend(self) -> str | None:
        """The torch.compile backend the blocks are compiled with; None: run eagerly."""
        if self.compile is False:
            return None
        return "inductor" if self.compile in (True, "cudagraphs") else self.compile

    @property
    def compile_mode(self) -> str | None:
        """torch.compile's mode: "reduce-overhead" (CUDA graphs) for compile="cudagraphs"."""
        return "reduce-overhead" if self.compile == "cudagraphs" else None

    @property
    def float8_gather(self) -> bool:
        """Whether ZeRO-3 all-gathers the float8 linears' weights in e4m3."""
        return (self.zero == 3 and self.dp_mode == "ddp" and self.precision == "fp8"
                and self.fp8_recipe == "tensorwise" and self.zero3_fp8_gather is not False)

    @property
    def world_size(self) -> int:
        """Ranks this plan needs: one per (pp, dp, cp, tp) coordinate of the mesh (ep is
        taken from the dp ranks)."""
        return self.pp * self.mesh_dp * self.cp * self.tp

    def check_world_size(self, world_size: int) -> None:
        """Refuse a plan whose mesh does not cover exactly `world_size` ranks."""
        if self.dp_mode == "dp" and self.world_size != world_size:
            raise PlanError(
                f"Plan(dp={self.dp}, dp_mode='dp') runs its {self.dp} replicas as threads of "
                f"one process per pp*tp coordinate: it needs pp*tp = {self.world_size} "
                f"rank(s) but the world has {world_size}; launch {self.world_size} "
                f"(e.g. --nproc {self.world_size}), or use dp_mode='ddp' for one process per "
                "replica")
        if self.world_size != world_size:
            axes = "dp*pp*tp" if self.cp == 1 else "dp*pp*cp*tp"
            sizes = f"dp={self.dp}, pp={self.pp}, tp={self.tp}" + (
                f", cp={self.cp}" if self.cp > 1 else "")
            raise PlanError(
                f"Plan({sizes}) needs {axes} = {self.world_size} ranks but the world has "
                f"{world_size}; launch {self.world_size} ranks (e.g. --nproc "
                f"{self.world_size}) or change the plan so that {axes} = {world_size}")

    def to_dict(self) -> dict:
        """JSON-ready fields (from_dict reads them back to an equal Plan)."""
        data = asdict(self)
        if self.tp_plan is not None:
            data["tp_plan"] = dict(self.tp_plan)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(f"unknown Plan field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**data)

    def describe(self) -> str:
        """Short human form, listing only what differs from the defaults (measuring the
        activations changes no number of the run, so it is left out)."""
        default = Plan()
        parts = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                 if getattr(self, f.name) != getattr(default, f.name)
                 and f.name != "measure_activations"]
        return f"Plan({', '.join(parts)})"


def _check_local_steps(plan: Plan) -> None:
    """The values of diloco / local-sgd's fields (sync_every, outer_lr, outer_momentum);
    how they combine with the rest is core/admit.check_plan's."""
    h, lr, mom = plan.sync_every, plan.outer_lr, plan.outer_momentum
    if not isinstance(h, int) or isinstance(h, bool) or h < 1:
        raise PlanError(f"Plan.sync_every={h!r}: must be a whole number >= 1 (inner steps "
                        "between two syncs, e.g. sync_every=8)")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise PlanError(f"Plan.outer_lr={lr!r}: must be a number > 0 (e.g. outer_lr=0.7)")
    if isinstance(mom, bool) or not isinstance(mom, (int, float)) or not 0 <= mom < 1:
        raise PlanError(f"Plan.outer_momentum={mom!r}: must be in [0, 1) (e.g. 0.9; 0 for "
                        "plain outer SGD)")
    if plan.dp_mode in LOCAL_STEP_MODES and plan.zero:   # before the generic zero check
        raise PlanError(f"Plan(dp_mode={plan.dp_mode!r}, zero={plan.zero}): every worker "
                        "keeps whole parameters and its own optimizer between syncs, which "
                        "ZeRO shards over dp; use zero=0")


def _check_cp_ep(plan: Plan) -> None:
    _choose("cp_style", plan.cp_style, CP_STYLES)
    if plan.cp_style != "ring" and plan.cp == 1:
        raise PlanError(f"Plan.cp_style={plan.cp_style!r} shapes context parallel and needs "
                        "cp > 1 (got cp=1); set cp=2 or more, or drop cp_style")
    c = plan.capacity_factor
    if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float))
                          or not 0 < c < math.inf):
        raise PlanError(f"Plan.capacity_factor={c!r}: must be a number > 0 (e.g. 1.25: each "
                        "expert takes at most 1.25x its even share of a sequence's choices), "
                        "or None for dropless routing")
    if plan.ep > 1 and plan.dp % plan.ep:
        raise PlanError(f"Plan(ep={plan.ep}, dp={plan.dp}): expert parallel takes its ranks "
                        f"from the data-parallel ones, so ep must divide dp; use dp="
                        f"{plan.ep * max(1, round(plan.dp / plan.ep))} or an ep that divides "
                        f"{plan.dp}")


def _check_fp8(plan: Plan) -> None:
    _choose("fp8_recipe", plan.fp8_recipe, FP8_RECIPES)
    if not isinstance(plan.fp8_emulate, bool):
        raise PlanError(f"Plan.fp8_emulate={plan.fp8_emulate!r}: must be True or False")
    if plan.precision != "fp8" and (plan.fp8_emulate or plan.fp8_recipe != "tensorwise"):
        raise PlanError(f"Plan.fp8_recipe / fp8_emulate shape float8 training and need "
                        f"precision='fp8' (got {plan.precision!r}); set precision='fp8' or "
                        "drop them")


def _check_recompute_every(plan: Plan) -> None:
    k = plan.recompute_every
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise PlanError(f"Plan.recompute_every={k!r}: must be a whole number >= 1 (e.g. 2: "
                        "every second decoder layer recomputed)")
    if k > 1 and plan.recompute != "full":
        raise PlanError(f"Plan.recompute_every={k} picks the layers full recomputation "
                        f"recomputes and needs recompute='full' (got {plan.recompute!r}); set "
                        "recompute='full' or drop recompute_every")


def _freeze_knobs(plan: Plan) -> None:
    """Give the knobs one hashable, JSON round-trippable form: a dict tp_plan as pairs,
    lists as tuples, a path as a string. A value of another type is left for check_plan
    to refuse by name."""
    def put(name, value):
        object.__setattr__(plan, name, value)
    if isinstance(plan.tp_plan, dict):
        put("tp_plan", tuple(plan.tp_plan.items()))
    elif isinstance(plan.tp_plan, (list, tuple)) and all(
            isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in plan.tp_plan):
        put("tp_plan", tuple(tuple(pair) for pair in plan.tp_plan))
    for name in ("zero3_units", "stage_cuts"):
        if isinstance(getattr(plan, name), list):
            put(name, tuple(getattr(plan, name)))
    if isinstance(plan.offload_dir, os.PathLike):
        put("offload_dir", os.fspath(plan.offload_dir))


def _check_compression(plan: Plan) -> None:
    _choose("compression", plan.compression, COMPRESSIONS)
    r = plan.compression_rank
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise PlanError(f"Plan.compression_rank={r!r}: must be a whole number >= 1 (e.g. 4)")
    rate = plan.compression_min_rate
    if not (isinstance(rate, (int, float)) and rate >= 0):
        raise PlanError(f"Plan.compression_min_rate={rate!r}: must be a number >= 0 (e.g. 2)")


def _choose(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise PlanError(f"Plan.{name}={value!r}: choose one of {', '.join(map(repr, allowed))}")
