"""Tensor parallel for any model: a tp_plan maps module-name patterns to styles.

    Trainer(model, Plan(tp=2, tp_plan={"transformer.h.*.mlp.c_fc": "column", ...}), ...)

Patterns are fnmatch patterns over `model.named_modules()` names ("*" also crosses dots).
Each matched module must be an nn.Linear, transformers' Conv1D or an nn.Embedding:
    "column"  output features split; its input enters the region (all-reduce in backward);
              its output stays split, for the "row" layer after it
    "row"     input features split; the partial outputs are all-reduced, then the bias added
    "qkv"     a fused [q; k; v] projection (GPT-2's c_attn): "column" within each of its
              three equal parts, so each rank holds q, k and v of the same n_heads/T heads;
              its parent's `num_heads` and `split_size` (where it has them) are divided by T
    "vocab"   on an Embedding: rows (the vocabulary) split, masked lookup, all-reduce
              (its padding_idx row's gradient kept zero, a scaled embedding's scale kept);
              on a Linear/Conv1D: the output layer, columns (the vocabulary) split, the
              logits kept split for the vocab-parallel loss. The vocabulary is padded to a
              multiple of T with rows no token reaches and logits of -inf: exact.
    "column_gather"  "column" with its output all-gathered whole (split in backward): what
              follows needs every feature (a norm over the whole q, a fused q/k/v or
              gate/up split at fixed offsets); attention then runs whole on every rank
    "row_split"  "row" whose input arrives whole: each rank takes its slice itself
              (all-gather in backward), the partial outputs all-reduced
    "replicated"  any module with parameters (per-head q/k norms) that sees only this
              rank's heads: its parameters whole on every rank, their gradients (each
              rank's heads' part) summed over tp
Sizes a style splits must divide by T (except the padded vocabulary). Every check runs in
`resolve`, which needs no process group. A module with parameters beside "column"
projections (a sibling of them, so it may see their split outputs) must be named too:
"replicated" where it acts per head, else the projections must gather ("column_gather").
Under sequence parallel (a transformers causal LM, `SequenceSplit`) the column layers'
modules gather the sequence where they are entered and the row layers reduce-scatter it.
"""
from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from meshtrain.core.comm import Comm
from meshtrain.core.plan import PlanError
from meshtrain.strategies.tensor_parallel.aliases import refuse_aliases
from meshtrain.strategies.tensor_parallel.communications import gather_from_tp, scatter_to_tp
from meshtrain.strategies.tensor_parallel.layers import Enter, Exit
from meshtrain.strategies.tensor_parallel.sharder import Sharder, is_conv1d, linear_sizes
from meshtrain.strategies.tensor_parallel.sharding import TensorParallel

STYLES = ("column", "row", "qkv", "vocab", "column_gather", "row_split", "replicated")
SPLIT_OUTPUT = ("column", "qkv")   # styles whose output stays split over tp
HEAD_ATTRIBUTES = ("num_heads", "split_size")   # divided by T on a "qkv" module's parent
SEQUENCE_DIM = 1   # activations are (B, S, h)


def resolve(model: nn.Module, tp_plan: dict, tp: int) -> list[tuple[str, str]]:
    """(module name, style) for every module the plan shards, in model order; refuses a
    pattern that matches nothing, a module of another kind, sizes tp does not divide."""
    if not isinstance(tp_plan, dict) or not tp_plan:
        raise PlanError(f"tp_plan={tp_plan!r}: must be a non-empty dict of module-name pattern "
                        f"-> style ({', '.join(STYLES)})")
    modules = dict(model.named_modules())
    chosen: dict[str, tuple[str, str]] = {}
    for pattern, style in tp_plan.items():
        if style not in STYLES:
            raise PlanError(f"tp_plan[{pattern!r}] = {style!r}: choose one of "
                            f"{', '.join(map(repr, STYLES))}")
        matched = [n for n in modules if n and fnmatchcase(n, pattern)]
        if not matched:
            examples = ", ".join(n for n, m in modules.items() if _kind(m))[:300]
            raise PlanError(f"tp_plan pattern {pattern!r} matches no module of "
                            f"{type(model).__name__}; shardable modules are named like: "
                            f"{examples}")
        for name in matched:
            earlier = chosen.get(name)
            if earlier and earlier[0] != style:
                raise PlanError(f"{name} is matched by tp_plan patterns {earlier[1]!r} "
                                f"({earlier[0]!r}) and {pattern!r} ({style!r}); make them "
                                "agree")
            chosen[name] = (style, pattern)
    for name, (style, pattern) in chosen.items():
        _check(name, modules[name], style, pattern, tp, model)
    _check_siblings(modules, {n: style for n, (style, _) in chosen.items()})
    return [(name, chosen[name][0]) for name in modules if name in chosen]


def _check_siblings(modules: dict[str, nn.Module], styles: dict[str, str]) -> None:
    """Refuse a module with parameters, named by no pattern, beside projections whose
    output stays split: it may compute on this rank's heads only (a per-head norm) with
    weights it treats as whole, and its gradient would silently be a part."""
    parents = {n.rpartition(".")[0] for n, s in styles.items() if s in SPLIT_OUTPUT}
    for name, module in modules.items():
        if (name.rpartition(".")[0] in parents and name not in styles
                and any(True for _ in module.parameters())
                and not any(n.startswith(name + ".") for n in styles)):
            split = sorted(n for n, s in styles.items()
                           if s in SPLIT_OUTPUT and n.rpartition(".")[0] == name.rpartition(".")[0])
            raise PlanError(
                f"{name} ({type(module).__name__}) has parameters and sits beside {split[0]}, "
                f"whose output stays split over tp, but no tp_plan pattern names it: add "
                f"'{name}': 'replicated' if it acts on each rank's heads alone (a per-head "
                f"norm: its gradients are then summed over tp), or make {split[0]} and its "
                "siblings 'column_gather' (and their reader 'row_split') if it needs every "
                "feature")


def _kind(module: nn.Module) -> str | None:
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.Linear) or is_conv1d(module):
        return "linear"
    return None


def _check(name: str, module: nn.Module, style: str, pattern: str, tp: int,
           model: nn.Module) -> None:
    kind = _kind(module)
    if style == "replicated":
        if not any(True for _ in module.parameters()):
            raise PlanError(f"tp_plan pattern {pattern!r} matches {name}, which has no "
                            "parameters: 'replicated' sums parameters' gradients over tp")
        return
    _refuse_own_forward(name, module, kind)
    if kind is None:
        raise PlanError(f"tp_plan pattern {pattern!r} matches {name}, a "
                        f"{type(module).__name__}: only nn.Linear, transformers' Conv1D and "
                        f"nn.Embedding can be sharded; match those inside it instead")
    if kind == "embedding":
        if style != "vocab":
            raise PlanError(f"{name} is an nn.Embedding, sharded only as 'vocab' (rows split), "
                            f"not {style!r}")
        if module.max_norm is not None or module.sparse:
            raise PlanError(f"{name}: a vocab-parallel embedding does plain lookups (with its "
                            "padding_idx); max_norm and sparse are not supported")
        return
    full_in, full_out = linear_sizes(module)
    if style in ("column", "column_gather") and full_out % tp:
        raise PlanError(f"tp={tp} does not divide {name}'s out_features={full_out} ('column' "
                        f"splits them); choose tp dividing {full_out}")
    if style in ("row", "row_split") and full_in % tp:
        raise PlanError(f"tp={tp} does not divide {name}'s in_features={full_in} ('row' "
                        f"splits them); choose tp dividing {full_in}")
    if style == "qkv":
        if full_out % (3 * tp):
            raise PlanError(f"{name}'s out_features={full_out} are not 3 equal parts that "
                            f"tp={tp} divides ('qkv' splits each of q, k, v)")
        parent = model.get_submodule(name.rpartition(".")[0])
        heads = getattr(parent, "num_heads", None)
        if isinstance(heads, int) and heads % tp:
            raise PlanError(f"tp={tp} does not divide the {heads} attention heads of "
                            f"{name.rpartition('.')[0]} (num_heads): each rank computes whole "
                            f"heads; choose tp dividing {heads}")


def _refuse_own_forward(name: str, module: nn.Module, kind: str | None) -> None:
    """A subclass of nn.Linear / nn.Embedding with a forward of its own would lose it when
    swapped; a scaled embedding (`embed_scale`, Gemma's) is the one kept."""
    base = {"linear": nn.Linear, "embedding": nn.Embedding}.get(kind)
    if not isinstance(module, base or ()) or type(module).forward is base.forward:
        return   # transformers' Conv1D is its own kind
    if kind == "embedding" and hasattr(module, "embed_scale"):
        return
    raise PlanError(f"{name} is a {type(module).__name__}: an {base.__name__} with a forward "
                    "of its own, which a tensor-parallel layer would not reproduce; leave it "
                    "out of the tp_plan (replicated) or shard the modules inside it")


def shard_with_plan(model: nn.Module, comm: Comm, tp_plan: dict,
                    sequence: SequenceSplit | None = None) -> TensorParallel:
    """Swap every module the plan names for its tensor-parallel layer, in place; with
    `sequence`, in their sequence-parallel forms (see SequenceSplit)."""
    tp = comm.mesh.size("tp")
    sharder = Sharder(model, comm)
    resolved = resolve(model, tp_plan, tp)
    seq = SEQUENCE_DIM if sequence is not None else None
    originals = [(name, model.get_submodule(name)) for name, style in resolved
                 if style != "replicated"]   # the swapped ones, kept alive
    shared: dict[str, Enter] = {}   # parent module -> the entry its "column" layers share
    partial: set[str] = set()
    for name, style in resolved:
        module = model.get_submodule(name)
        parent = name.rpartition(".")[0]
        if style == "replicated":
            partial |= {f"{name}.{n}" for n, _ in module.named_parameters()}
        elif style == "vocab" and isinstance(module, nn.Embedding):
            sharder.vocab_embedding(name, Exit(comm, name))   # whole: split where it enters
        elif style in ("row", "row_split"):
            sharder.row(name, Exit(comm, name, seq), split_input=style == "row_split")
        elif style in ("column", "column_gather"):   # siblings reading one input enter once
            if parent not in shared:
                shared[parent] = _entry(model.get_submodule(parent), comm, parent or name, seq)
            sharder.column(name, None if seq else shared[parent], reads=shared[parent],
                           gather=style == "column_gather")
        elif style == "qkv":
            entry = (_entry(model.get_submodule(parent), comm, parent, seq) if seq is not None
                     else None)
            sharder.column(name, None if entry else Enter(comm, name), blocks=3, reads=entry)
            _divide_heads(model.get_submodule(parent), tp)
        else:   # the output layer, after the sequence is whole again
            sharder.column(name, Enter(comm, name), vocab=True)
    refuse_aliases(model, originals)   # never silently train an unsharded copy
    if sequence is not None:
        partial |= sequence.start(model, comm, dict(resolved))
    return sharder.finish(partial)


class SequenceSplit:
    """Sequence parallel for a model through its tp_plan (Korthikanti et al. 2022): the
    residual stream is split along the sequence between the input of the first of
    `layers` and the output of the last (split forward, all-gather backward, and the
    reverse at the end), so the norms inside the layers see S/T tokens each and their
    gradients are summed over tp; column layers' modules gather the sequence where they are
    entered, row layers reduce-scatter it where they exit (their bias, added after, a
    partial gradient too). What runs before and after the layers (embedding, positions,
    masks; the final norm, the output layer) sees the whole sequence, as the family's own
    code expects (GPT-2 views its output with the input's sequence length)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = layers

    def start(self, model: nn.Module, comm: Comm, styles: dict[str, str]) -> set[str]:
        """Hooks the split in; returns the parameters whose gradients are partial."""
        split = lambda x: scatter_to_tp(x, comm, SEQUENCE_DIM, "sequence")  # noqa: E731
        self.layers[0].register_forward_pre_hook(_OnHidden(split), with_kwargs=True)
        self.layers[-1].register_forward_hook(_GatherOutput(comm))
        regions = {n.rpartition(".")[0] for n, s in styles.items() if s not in
                   ("row", "row_split", "replicated", "vocab")}
        in_stream = {id(m) for top in self.layers for m in top.modules()}
        partial = {f"{n}.bias" for n, s in styles.items() if s in ("row", "row_split")
                   and model.get_submodule(n).bias is not None}
        for name, module in model.named_modules():
            if (id(module) in in_stream and name not in styles
                    and name.rpartition(".")[0] not in regions):
                partial |= {f"{name}.{p}" for p, v in module._parameters.items()
                            if v is not None}
        return partial


class _GatherOutput:
    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def __call__(self, module: nn.Module, args: tuple, out):
        gather = lambda x: gather_from_tp(x, self.comm, SEQUENCE_DIM, "sequence")  # noqa: E731
        return (gather(out[0]), *out[1:]) if isinstance(out, tuple) else gather(out)


def _entry(parent: nn.Module, comm: Comm, tag: str, seq: int | None) -> Enter:
    """The entry a module's column layers share. Under sequence parallel the module itself
    enters (a pre-hook gathers its hidden-state input): an attention module reads the
    sequence length off its input to shape its heads, so it must see the whole."""
    enter = Enter(comm, tag, seq)
    if seq is None:
        enter.share(parent)
    else:
        parent.register_forward_pre_hook(_OnHidden(enter), with_kwargs=True)
    return enter


class _OnHidden:
    """Forward pre-hook applying `fn` to a module's hidden-state input (its first
    positional argument, or `hidden_states=`)."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        if args:
            return (self.fn(args[0]), *args[1:]), kwargs
        if "hidden_states" not in kwargs:
            raise PlanError(f"sequence parallel: {type(module).__name__} was called without "
                            "its hidden states as first argument or hidden_states=, so "
                            "meshtrain cannot gather or split them; drop sequence_parallel")
        return args, {**kwargs, "hidden_states": self.fn(kwargs["hidden_states"])}


def _divide_heads(attention: nn.Module, tp: int) -> None:
    """The attention module now computes n_heads/T heads over (3h/T)-wide fused outputs."""
    for attr in HEAD_ATTRIBUTES:
        value = getattr(attention, attr, None)
        if isinstance(value, int):
            setattr(attention, attr, value // tp)

