"""After sharding: refuse a model whose forward can still reach a module that was swapped.

The sharder replaces each module the plan splits by its tensor-parallel layer under the same
name (`setattr` on its parent). A reference to the old module held anywhere but in the
registered tree (a plain attribute, a Python list or dict of modules: a wrapper's "stages")
would keep computing with the whole, unsharded weights: training runs, to wrong numbers.
So every plain attribute reachable from the model is searched for the replaced modules.
"""
from __future__ import annotations

from torch import nn

from meshtrain.core.plan import PlanError

_INTERNAL = ("_parameters", "_buffers", "_modules")


def refuse_aliases(model: nn.Module, originals: list[tuple[str, nn.Module]]) -> None:
    """`originals`: (name, the module as it was before the swap), held by the caller so
    that no id is reused while this runs. Raises PlanError naming the first alias."""
    replaced = {id(m): name for name, m in originals}
    seen: set[int] = set()
    pending = [(model, type(model).__name__)]
    while pending:
        obj, path = pending.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, nn.Module):
            if id(obj) in replaced:
                raise PlanError(
                    f"{path} still refers to {replaced[id(obj)]} as it was before tensor "
                    f"parallel split it (an alias outside the registered modules, e.g. a plain "
                    f"list of layers): forward would use the unsharded weights. Hold modules "
                    f"as registered submodules (nn.ModuleList / attributes), not in Python "
                    f"containers")
            pending += [(m, f"{path}.{n}") for n, m in obj._modules.items() if m is not None]
            pending += [(v, f"{path}.{k}") for k, v in vars(obj).items()
                        if k not in _INTERNAL and _may_hold_modules(v)]
        elif isinstance(obj, dict):
            pending += [(v, f"{path}[{k!r}]") for k, v in obj.items() if _may_hold_modules(v)]
        elif isinstance(obj, (list, tuple, set)):
            pending += [(v, f"{path}[{i}]") for i, v in enumerate(obj) if _may_hold_modules(v)]


def _may_hold_modules(value) -> bool:
    return isinstance(value, (nn.Module, dict, list, tuple, set))
