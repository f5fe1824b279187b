"""transformers causal LMs in the equivalence harness (tests/multirank/equivalence.py).

Each preset of meshtrain/models/hf_presets.py is registered in `equivalence.MODELS` with no
loss function: the Trainer gets nothing but `Trainer(model, Plan(...), optimizer)`. The
references are plain PyTorch in one process: the next-token cross-entropy on the output's
logits, and for bf16 the parameters in bf16 with fp32 masters (non-persistent buffers, RoPE's
inv_freq, stay as the model built them).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

import meshtrain as mt
from meshtrain.models.hf_presets import FAMILIES, MOE, build
from tests.multirank import equivalence as eq

SEQ, STEPS = 16, 4
NAMES = ("llama-tiny", "llama-tiny-tied", "hf-gpt2-tiny", "qwen2-tiny")
WINDOWED = "mistral-window-tiny"   # context parallel's sliding-window cases only
for _name in (*NAMES, WINDOWED, *FAMILIES, *MOE):
    eq.MODELS[_name] = (partial(build, _name), None, 255, SEQ)   # data() is uint8


def token_loss(output, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def transformers_loss(net: nn.Module):
    """The loss transformers computes for `net` given labels: the cross-entropy, plus
    router_aux_loss_coef x its own load-balancing loss where a mixture of experts' config
    asks for it (output_router_logits)."""
    coef = getattr(net.config, "router_aux_loss_coef", 0.0)
    if not getattr(net.config, "output_router_logits", False):
        return token_loss
    return lambda output, targets: token_loss(output, targets) + coef * output.aux_loss.float()


def reference(model: str, steps: int = STEPS, max_grad_norm: float | None = None,
              device: str = "cpu", capacity_factor: float | None = None) -> dict:
    """One process; `capacity_factor`: a mixture of experts' experts limited as every plan
    limits them (models/experts.py)."""
    from meshtrain.models.experts import limit_capacity

    torch.manual_seed(0)
    net = eq.MODELS[model][0]().to(device)
    limit_capacity(net, capacity_factor)
    opt = eq.sgd(net.parameters())
    names = {id(p): n for n, p in net.named_parameters()}
    losses, norms, loss_fn = [], [], transformers_loss(net)
    for x, y in eq.batches(model, steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(net(x.to(device), use_cache=False), y.to(device))
        loss.backward()
        if max_grad_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), max_grad_norm).item())
        opt.step()
        losses.append(loss.item())
    state = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    return eq.on_host({"losses": losses, "norms": norms, "optimizer": state,
                       "state": {k: v.clone() for k, v in net.state_dict().items()}})


def reference_bf16(model: str, steps: int = STEPS) -> dict:
    torch.manual_seed(0)
    net = eq.MODELS[model][0]()
    params = list(net.parameters())
    masters = [nn.Parameter(p.detach().clone()) for p in params]
    for p in params:
        p.data = p.data.to(torch.bfloat16)
    opt = eq.sgd(masters)
    losses, loss_fn = [], transformers_loss(net)
    for x, y in eq.batches(model, steps):
        loss = loss_fn(net(x, use_cache=False), y)
        loss.backward()
        for m, p in zip(masters, params):
            m.grad, p.grad = p.grad.float(), None
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, params):
                p.copy_(m)
        losses.append(loss.item())
    master_of = {id(p): m for p, m in zip(params, masters)}
    state = {k: master_of[id(v)].detach().clone() if id(v) in master_of else v
             for k, v in net.state_dict(keep_vars=True).items()}
    return {"losses": losses, "state": state}


def train_many(cases: list[tuple[dict, str]]) -> list[dict]:
    """Each (plan fields, model) trained on this rank, in one launched world."""
    return [eq.train(mt.Plan(**plan), model, steps=STEPS) for plan, model in cases]
