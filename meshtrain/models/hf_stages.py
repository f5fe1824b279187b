"""A transformers causal LM as pipeline stages, run by the model's own forward code.

`stage_layers(model)` gives [embedding, one element per decoder layer, head]; run one after
another they compute `model(ids).logits`. Where the stages are cut, what runs between the
modules is the family's own business (Gemma's scaled embedding, Granite's multipliers, the
rotary tables of each layer type, sliding-window masks, Gemma-2's soft-capped logits,
Cohere's logit scale), so no element reproduces it: each calls the base model's (or the
causal LM's) own `forward`, unwrapped, on a stand-in of the model whose decoder-layer list
is replaced by `_StandIn`s:

- the embedding element gives the base model the token ids and stops at the first decoder
  layer's input: embedding, scaling, dropout as the model does them;
- decoder element i gives the base model its input hidden state as `inputs_embeds` only so
  that it computes, as it would, the positions, masks and rotary tables of every layer;
  stand-in i-1 returns the received hidden state as its layer's output (what the base model
  did to the stand-in input is discarded, what it does between two layers is kept), and
  stand-in i runs the real layer i with its arguments and stops the forward there;
- the head element lets the base model run past its last layer (the final norm, anything
  after it) and then runs the causal LM's own forward on that (output layer, soft-capping).

A mixture of experts whose config asks for the router's loss carries its routing sums
beside the hidden state (models/moe_stages.py): the elements then pass (hidden, routing)
pairs, each decoder element adds its layer's sums, and the head gives the logits with the
totals (`moe_stages.Routed`).

Which modules each element holds comes from the config's `base_model_pp_plan` (the modules
before the decoder layers go with the embedding, those after with the head), or, without
one, from the base model's children in order around its decoder-layer list. Modules without
parameters (rotary embeddings) go with every element: each stage computes its own tables.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from meshtrain.core.plan import PlanError
from meshtrain.models.moe_stages import Routed, router_tap


# A model's own token positions where they are not 0..L-1 for the L tokens a forward sees
# (context parallel gives each rank chunks of the whole sequence): a function (L, device)
# -> position_ids, set on the causal LM, read by every stage.
GLOBAL_POSITIONS = "meshtrain_global_positions"


class _Reached(Exception):
    """Stops the base model's forward where an element's work is done, with its result."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


def layer_list_name(model: nn.Module) -> str | None:
    """The base model's attribute holding the decoder layers: the ModuleList of the config's
    `base_model_pp_plan` that takes hidden states, else `layers` or `h`."""
    base = model.base_model
    plan = getattr(model.config, "base_model_pp_plan", None) or {}
    named = [n for n, (inputs, _) in plan.items() if "hidden_states" in inputs]
    for name in [*named, "layers", "h"]:
        if isinstance(getattr(base, name, None), nn.ModuleList) and len(getattr(base, name)):
            return name
    return None


def stage_layers(model: nn.Module) -> list[nn.Module]:
    """[embedding, decoder layer 0, ..., decoder layer n-1, head] (see the module docstring)."""
    base, layers_name = model.base_model, layer_list_name(model)
    if layers_name is None:
        raise PlanError(f"pipeline parallel cuts a transformers model between its decoder "
                        f"layers, and {type(model).__name__} has no list of them (an "
                        "nn.ModuleList named in its config's base_model_pp_plan, or `layers` / "
                        "`h`): use pp=1, or pass an nn.Module with a layers() method")
    before, after, helpers = _around(base, layers_name)
    runner = _Runner(model, layers_name, before)
    layers = getattr(base, layers_name)
    return [Embedding(runner, before, helpers),
            *(Decoder(runner, i, layer, helpers) for i, layer in enumerate(layers)),
            Head(runner, after, model.lm_head, helpers)]


def _around(base: nn.Module, layers_name: str):
    """(modules before the decoder layers, modules after them, parameter-free helpers), as
    the pp plan lists them, else in the order the base model registers them."""
    children = dict(base.named_children())
    helpers = {n: m for n, m in children.items()
               if n != layers_name and next(m.parameters(), None) is None}
    plan = getattr(base.config, "base_model_pp_plan", None) or {}
    order = [n for n in plan if n in children] or list(children)
    if layers_name not in order:
        order = list(children)
    cut = order.index(layers_name)
    pick = lambda names: {n: children[n] for n in names if n not in helpers}  # noqa: E731
    return pick(order[:cut]), pick(order[cut + 1:]), helpers


class _Runner:
    """Calls the base model's and the causal LM's own (undecorated) forward on stand-ins."""

    def __init__(self, model: nn.Module, layers_name: str, before: dict[str, nn.Module]) -> None:
        self.model, self.base, self.layers_name = model, model.base_model, layers_name
        # on the stages after the first, the modules before the decoder layers (GPT-2's
        # position embedding) only shape what the stand-ins discard: never their weights
        self.inert = {name: _Inert(module) for name, module in before.items()}
        self.tap = router_tap(model)   # a mixture of experts' routing, where carried
        self.base_forward = inspect.unwrap(type(self.base).forward)
        self.lm_forward = inspect.unwrap(type(model).forward)
        self.tuples = _reads_tuples(self.base_forward)

    def base_until(self, stand_ins: list, **inputs) -> torch.Tensor:
        """The base model's forward with its layers replaced by `stand_ins`: the hidden state
        a stand-in stops at, or the base model's output where none stops. Given
        `inputs_embeds` (a later stage), the modules before the layers are inert."""
        inert = self.inert if "inputs_embeds" in inputs else {}
        positions = getattr(self.model, GLOBAL_POSITIONS, None)
        if positions is not None:
            given = inputs.get("input_ids", inputs.get("inputs_embeds"))
            inputs["position_ids"] = positions(given.size(1), given.device)
        proxy = _Proxy(self.base, {**inert, self.layers_name: stand_ins})
        try:
            output = self.base_forward(proxy, use_cache=False, **inputs)
        except _Reached as reached:
            return reached.hidden
        return output[0]

    def logits(self, final: torch.Tensor) -> torch.Tensor:
        """The causal LM's forward from its base model's output `final` (the output layer
        and whatever the family does to the logits)."""
        base = lambda *args, **kwargs: _BaseOutput(final)  # noqa: E731
        proxy = _Proxy(self.model, {self.model.base_model_prefix: base})
        return self.lm_forward(proxy, inputs_embeds=final, use_cache=False).logits

    def stand_ins(self, act: dict[int, object]) -> list:
        layers = getattr(self.base, self.layers_name)
        return [_StandIn(layer, act.get(i), self.tuples) for i, layer in enumerate(layers)]


class _Proxy:
    """The model with a few attributes replaced; everything else read from it."""

    def __init__(self, real: nn.Module, overrides: dict) -> None:
        self.__dict__.update(overrides)
        self.__dict__["_real"] = real

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_real"], name)


class _Inert:
    """A module whose output is discarded: zeros shaped as its output, found on the meta
    device (its weights may be released to meta on this stage)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args, **kwargs):
        from torch.func import functional_call
        from torch.utils._pytree import tree_map

        device = next((a.device for a in (*args, *kwargs.values())
                       if isinstance(a, torch.Tensor)), None)
        meta = lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t  # noqa: E731
        state = {n: meta(t) for n, t in self.module.state_dict(keep_vars=True).items()}
        out = functional_call(self.module, state, tree_map(meta, args), tree_map(meta, kwargs))
        return tree_map(lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device)
                        if isinstance(t, torch.Tensor) else t, out)


class _BaseOutput:
    """The base model's output as a causal LM's forward reads it: the last hidden state
    (`.last_hidden_state` or `[0]`), and nothing else (no cache, attentions...)."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.last_hidden_state = hidden

    def __getitem__(self, index: int):
        if index != 0:
            raise IndexError(index)
        return self.last_hidden_state

    def __getattr__(self, name: str):
        return None


class _StandIn:
    """A decoder layer as the base model's loop sees it: its attributes are the layer's;
    calling it does `act(hidden, args, kwargs)` where one is given, else passes its input
    on unchanged (in the layer's own return form)."""

    def __init__(self, layer: nn.Module, act, as_tuple: bool) -> None:
        self._layer, self._act, self._tuple = layer, act, as_tuple

    def __getattr__(self, name: str):
        return getattr(self._layer, name)

    def __call__(self, hidden, *args, **kwargs):
        if self._act is not None:
            return self._act(hidden, args, kwargs)
        return (hidden,) if self._tuple else hidden


def _reads_tuples(base_forward) -> bool:
    """Whether the base model's loop reads each layer's output as a tuple (`outputs[0]`:
    Falcon, Bloom, GPT-Neo) rather than as the hidden state (most families). Return
    annotations are not trusted: some say tuple and return the tensor."""
    try:
        return "outputs[0]" in inspect.getsource(base_forward)
    except (OSError, TypeError):
        return False


class _Element(nn.Module):
    def __init__(self, runner: _Runner, modules: dict[str, nn.Module],
                 helpers: dict[str, nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleDict({**modules, **helpers})
        object.__setattr__(self, "runner", runner)   # not a submodule: the model is not ours


class Embedding(_Element):
    """The base model's forward from the token ids up to the first decoder layer's input."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        def stop(hidden, args, kwargs):
            raise _Reached(hidden)
        hidden = self.runner.base_until(self.runner.stand_ins({0: stop}), input_ids=ids)
        tap = self.runner.tap
        return hidden if tap is None else (hidden, tap.start(hidden))


class Decoder(_Element):
    """Decoder layer `index`, called with the arguments the base model gives it."""

    def __init__(self, runner: _Runner, index: int, layer: nn.Module,
                 helpers: dict[str, nn.Module]) -> None:
        super().__init__(runner, {}, helpers)
        self.index, self.layer = index, layer

    def forward(self, x):
        """`x`: the output of layer index-1 (the first layer: its input), with the routing
        so far where it is carried."""
        tap = self.runner.tap
        if tap is None:
            return self.run(x)
        hidden, routing = x
        with tap.recording() as logits:
            hidden = self.run(hidden)
        return hidden, tap.add(routing, logits)

    def run(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden` is given back to the base model as layer index-1's output, so that
        whatever the base model does between two layers is done to it before layer `index`
        runs."""
        def run(incoming, args, kwargs):
            out = self.layer(hidden if self.index == 0 else incoming, *args, **kwargs)
            raise _Reached(out[0] if isinstance(out, tuple) else out)
        act = {self.index: run}
        if self.index > 0:
            act[self.index - 1] = lambda *_: (hidden,) if self.runner.tuples else hidden
        stand_ins = self.runner.stand_ins(act)
        return self.runner.base_until(stand_ins, inputs_embeds=hidden.detach())


class Head(_Element):
    """The base model's forward after its last decoder layer, then the causal LM's."""

    def __init__(self, runner: _Runner, modules: dict[str, nn.Module], lm_head: nn.Module,
                 helpers: dict[str, nn.Module]) -> None:
        super().__init__(runner, modules, helpers)
        self.lm_head = lm_head

    def forward(self, x):
        if self.runner.tap is not None:   # the logits with the routing totals
            hidden, routing = x
            return Routed(self.logits(hidden), routing)
        return self.logits(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        runner = self.runner
        last = len(getattr(runner.base, runner.layers_name)) - 1
        stand_ins = runner.stand_ins(
            {last: lambda _, args, kwargs: (hidden,) if runner.tuples else hidden})
        final = self.runner.base_until(stand_ins, inputs_embeds=hidden.detach())
        return self.runner.logits(final)
