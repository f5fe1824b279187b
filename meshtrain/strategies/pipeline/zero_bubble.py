"""Zero bubble's split backward (ZB-H1): B computes a chunk's input gradient alone, the
graph kept; W, later, its weight gradients from what B left. The runtime (runtime.py) calls
`forward_split` in place of the chunk's forward for a micro-batch whose backward is split."""
from __future__ import annotations

import torch

from meshtrain.strategies.pipeline import boundary


def forward_split(chunk: torch.nn.Module, x) -> tuple[object, list]:
    """Run the chunk, recording the output of each module that owns parameters (directly):
    B captures the gradient there, and W goes from there to those parameters only, so that
    it costs the weight gradients alone. Returns the output and [(parameters, outputs)].

    A module called twice, or a parameter owned by two modules (tied), would count some
    gradient twice that way: the chunk is then one owner, its output the chunk's (correct,
    but W walks the whole chunk again)."""
    owners = {m: [p for p in m.parameters(recurse=False) if p.requires_grad]
              for m in chunk.modules()}
    owners = {m: ps for m, ps in owners.items() if ps}
    outputs: dict[torch.nn.Module, list] = {m: [] for m in owners}
    hooks = [m.register_forward_hook(lambda mod, args, out: outputs[mod].append(out))
             for m in owners]
    try:
        y = chunk(x)
    finally:
        for h in hooks:
            h.remove()
    params = [p for ps in owners.values() for p in ps]
    if (len({id(p) for p in params}) < len(params)
            or any(len(o) > 1 or (o and not isinstance(o[0], torch.Tensor))
                   for o in outputs.values())):
        return y, [([p for p in chunk.parameters() if p.requires_grad],
                    [t for t in boundary.tensors(y) if t.requires_grad])]
    return y, [(owners[m], [o[0]]) for m, o in outputs.items() if o and o[0].requires_grad]


def input_gradients(y, x, captured: list, grad):
    """B: one pass from the chunk's output (or loss) to its input and to each captured
    output, the graph kept for W. Returns the input's gradient (None where no tensor of
    the input takes one) and [(parameters, outputs, their gradients)] for W."""
    inputs = [t for t in boundary.tensors(x) if t.requires_grad]
    wanted = inputs + [out for _, outs in captured for out in outs]
    if not wanted:
        return None, []
    ys = boundary.tensors(y)
    gs = boundary.tensors(grad) if grad is not None else (None,) * len(ys)
    ys, gs = zip(*[(t, g) for t, g in zip(ys, gs) if t.requires_grad])
    grads = torch.autograd.grad(ys, wanted, None if grad is None else gs, retain_graph=True,
                                allow_unused=True)
    grad_x = None
    if inputs:   # zeros where the chunk ignores a tensor of its input
        it = iter(grads)
        mine = [next(it) if t.requires_grad else None for t in boundary.tensors(x)]
        grad_x = boundary.rebuild([torch.zeros_like(t) if g is None else g
                                   for t, g in zip(boundary.tensors(x), mine)],
                                  isinstance(x, tuple))
    grads, done = list(grads[len(inputs):]), []
    for params, outs in captured:
        mine, grads = grads[:len(outs)], grads[len(outs):]
        kept = [(o, g) for o, g in zip(outs, mine) if g is not None]
        if kept:
            done.append((params, [o for o, _ in kept], [g for _, g in kept]))
    return grad_x, done


def weight_gradients(done: list) -> None:
    """W: each owner's parameters from its outputs' gradients. Each parameter is in one
    call, so its gradient hook (the dp sync) fires once, as after a plain backward."""
    for params, outs, grads in done:
        torch.autograd.backward(outs, grads, inputs=params, retain_graph=True)
