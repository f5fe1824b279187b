"""The first test of every strategy: training under a plan reproduces one process.

The reference is plain PyTorch in one process (no meshtrain at all): the same model, seed,
optimizer and global batches. A plan's run returns, from every rank, the per-step losses, the
consolidated model and optimizer states and the gradient norms, which must equal the
reference's within fp32 round-off.

Models:
- the tiny GPT (`gpt`), whose sizes divide evenly;
- `gpt_tp`: a tiny GPT with biases, 4 heads and a vocabulary of 62, which tp = 4 splits only
  once padded to 64 (tensor parallel's awkward case);
- `hf_gpt2`: transformers' GPT2LMHeadModel, tiny and randomly initialised (fused c_attn
  Conv1D, embedding tied to the output layer, a vocabulary of 50 that tp = 4 pads to 52);
  tensor parallel reaches it through `HF_GPT2_TP_PLAN`, the tp_plan the README shows;
- `tied_sequential`: an nn.Sequential whose sizes divide no dp size in 2..8 and whose first
  and last layers share a weight (a tied embedding and output layer), the awkward case for
  flat shards, for pipeline stages and for tensor parallel alike.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import meshtrain as mt
from meshtrain.data.sampler import BatchSampler
from meshtrain.models.deferred import build_on_meta
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.strategies.tensor_parallel import token_cross_entropy
from tests.multirank.ddp_cases import CONFIG, data

TIED_VOCAB, TIED_WIDTH, TIED_HIDDEN, TIED_SEQ = 37, 13, 29, 16
TP_CONFIG = GPTConfig(vocab_size=62, seq_len=16, n_layer=2, n_head=4, d_model=32, bias=True)
GLOBAL_BATCH = 48   # splits over dp = 1, 2, 3, 4 and then into 1, 2, 4 micro-batches


def gpt() -> nn.Module:
    return GPT(CONFIG)


def gpt_tp() -> nn.Module:
    return GPT(TP_CONFIG)


HF_VOCAB, HF_SEQ = 50, 16
# The README's tp_plan for transformers' GPT-2 (kept equal to it by test_tensor_parallel).
HF_GPT2_TP_PLAN = {
    "transformer.wte": "vocab",               # embedding rows split over the vocabulary
    "transformer.h.*.attn.c_attn": "qkv",     # fused q, k, v: each rank its heads' q, k, v
    "transformer.h.*.attn.c_proj": "row",
    "transformer.h.*.mlp.c_fc": "column",
    "transformer.h.*.mlp.c_proj": "row",
    "lm_head": "vocab",                       # tied to wte: logits stay split for the loss
}


def hf_gpt2() -> nn.Module:
    """A tiny GPT2LMHeadModel without dropout (needs transformers: the `hf` extra)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=HF_VOCAB, n_positions=HF_SEQ, n_embd=32, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def tied_sequential() -> nn.Sequential:
    """Embedding(37, 13) -> Linear(13, 29) -> GELU -> Linear(29, 13) -> LayerNorm(13) ->
    Linear(13, 37) sharing the embedding's weight: (B, T) int64 -> (B, T, 37)."""
    embed = nn.Embedding(TIED_VOCAB, TIED_WIDTH)
    head = nn.Linear(TIED_WIDTH, TIED_VOCAB, bias=False)
    head.weight = embed.weight
    return nn.Sequential(embed, nn.Linear(TIED_WIDTH, TIED_HIDDEN), nn.GELU(),
                         nn.Linear(TIED_HIDDEN, TIED_WIDTH), nn.LayerNorm(TIED_WIDTH), head)


PIPE_CONFIG = GPTConfig(vocab_size=64, seq_len=16, n_layer=6, n_head=2, d_model=16,
                        bias=False)


def gpt_pipe() -> nn.Module:
    """The GPT with 8 layers (embed, 6 blocks, head): enough for 4 ranks x 2 chunks."""
    return GPT(PIPE_CONFIG)


def tied_pipe() -> nn.Sequential:
    """The tied model with 8 layers (embedding ... output layer sharing its weight), enough
    for 4 pipeline ranks x 2 chunks: (B, T) int64 -> (B, T, 37)."""
    embed = nn.Embedding(TIED_VOCAB, TIED_WIDTH)
    head = nn.Linear(TIED_WIDTH, TIED_VOCAB, bias=False)
    head.weight = embed.weight
    return nn.Sequential(embed, nn.Linear(TIED_WIDTH, TIED_HIDDEN), nn.GELU(),
                         nn.Linear(TIED_HIDDEN, TIED_WIDTH), nn.Tanh(),
                         nn.Linear(TIED_WIDTH, TIED_WIDTH), nn.LayerNorm(TIED_WIDTH), head)


class WithExtras(nn.Module):
    """The tied model, scaled by a constant buffer, beside a Linear no step ever uses:
    buffers and gradient-less parameters, for the strategies that shard."""

    def __init__(self):
        super().__init__()
        self.seq = tied_sequential()
        self.register_buffer("scale", torch.linspace(0.9, 1.1, TIED_VOCAB))
        self.unused = nn.Linear(3, 5)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.seq(idx) * self.scale


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token: logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


MODELS = {"gpt": (gpt, None, CONFIG.vocab_size, CONFIG.seq_len),
          "gpt_tp": (gpt_tp, None, TP_CONFIG.vocab_size, TP_CONFIG.seq_len),
          "tied": (tied_sequential, token_loss, TIED_VOCAB, TIED_SEQ),
          "gpt_pipe": (gpt_pipe, None, PIPE_CONFIG.vocab_size, PIPE_CONFIG.seq_len),
          "tied_pipe": (tied_pipe, token_loss, TIED_VOCAB, TIED_SEQ),
          "extras": (WithExtras, token_loss, TIED_VOCAB, TIED_SEQ),
          "hf_gpt2": (hf_gpt2, token_cross_entropy, HF_VOCAB, HF_SEQ)}


def world_size() -> int:
    """Ranks in this run: 1 in a plain process."""
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_initialized() else 1


def sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def plain_sgd(params):
    """No momentum: averaging parameters after a step then equals averaging gradients."""
    return torch.optim.SGD(params, lr=0.5)


OPTIMIZERS = {"sgd": sgd, "adamw": adamw, "plain-sgd": plain_sgd}


def batches(model: str, steps: int, dp_rank: int = 0, dp_size: int = 1):
    """This dp rank's (inputs, targets) of each step's global batch."""
    _, _, vocab, seq = MODELS[model]
    tokens = data() % vocab
    sampler = BatchSampler(tokens, GLOBAL_BATCH, seq, seed=0, dp_rank=dp_rank, dp_size=dp_size)
    return [sampler.batch(s) for s in range(steps)]


def on_host(value):
    """`value` with every tensor in it copied to the host (results cross processes and are
    compared there, whatever device trained them)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: on_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_host(v) for v in value)
    return value


def reference(model: str = "gpt", optimizer: str = "sgd", steps: int = 10,
              max_grad_norm: float | None = None, dtype=None, device: str = "cpu") -> dict:
    """Plain PyTorch, one process on `device`: the numbers every plan must reproduce."""
    build, loss_fn, _, _ = MODELS[model]
    torch.manual_seed(0)
    net = build().to(device)
    if dtype is not None:
        net = net.to(dtype)
    loss_fn = loss_fn or net.loss
    opt = OPTIMIZERS[optimizer](net.parameters())
    names = {id(p): n for n, p in net.named_parameters()}
    losses, norms = [], []
    for x, y in batches(model, steps):
        x, y = x.to(device), y.to(device)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(net(x), y)
        loss.backward()
        if max_grad_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), max_grad_norm).item())
        opt.step()
        losses.append(loss.item())
    state = {names[id(p)]: {k: v.clone() if isinstance(v, torch.Tensor) else v
                            for k, v in s.items()} for p, s in opt.state.items()}
    return on_host({"losses": losses, "state": {k: v.clone() for k, v in net.state_dict().items()},
                    "optimizer": state, "norms": norms})


def reference_bf16(model: str = "gpt", optimizer: str = "sgd", steps: int = 10,
                   device: str = "cpu", convert=None) -> dict:
    """Mixed precision in one process, plain PyTorch: bf16 parameters and gradients, fp32
    master weights the optimizer steps, the loss taken in fp32. `convert(net)`: changes the
    bf16 model in place before training (torchao's float8 linears)."""
    build, loss_fn, _, _ = MODELS[model]
    torch.manual_seed(0)
    net = build().to(device)
    loss_fn = loss_fn or net.loss
    names = [n for n, _ in net.named_parameters()]
    masters = [nn.Parameter(p.detach().clone()) for p in net.parameters()]
    net.to(torch.bfloat16)
    if convert is not None:
        convert(net)
    opt = OPTIMIZERS[optimizer](masters)
    losses = []
    for x, y in batches(model, steps):
        x, y = x.to(device), y.to(device)
        loss = loss_fn(net(x).float(), y)
        loss.backward()
        for m, p in zip(masters, net.parameters()):
            m.grad, p.grad = p.grad.float(), None
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, net.parameters()):
                p.copy_(m)
        losses.append(loss.item())
    return on_host({"losses": losses,
                    "state": {n: m.detach().clone() for n, m in zip(names, masters)}})


def train(plan: mt.Plan, model: str = "gpt", optimizer: str = "sgd", steps: int = 10,
          max_grad_norm: float | None = None, dtype=None, meta: bool = False, **plan_kw) -> dict:
    """The same training under `plan` (with `max_grad_norm` and the Plan fields in
    `plan_kw` set on it), on this rank and its mesh's device (MESHTRAIN_DEVICE, which
    `run_ranks(device=...)` sets); returns what `reference` returns, on the host. `meta`:
    the model built on the meta device, each rank materialising only what it keeps."""
    build, loss_fn, _, _ = MODELS[model]
    torch.manual_seed(0)
    net = build_on_meta(build) if meta else build()
    if dtype is not None:
        net = net.to(dtype)
    plan = dataclasses.replace(plan, max_grad_norm=max_grad_norm, **plan_kw)
    trainer = mt.Trainer(net, plan, optimizer=OPTIMIZERS[optimizer], loss_fn=loss_fn)
    losses, norms = [], []
    for x, y in batches(model, steps, trainer.dp_rank, trainer.dp_size):
        losses.append(trainer.step(x, y))
        if max_grad_norm is not None:
            norms.append(trainer.last_grad_norm)
    out = {"losses": losses, "state": trainer.full_state_dict(),
           "optimizer": trainer.full_optimizer_state()["state"], "norms": norms}
    trainer.close()
    return on_host(out)


def train_many(cases: list[tuple[dict, str, float | None]], steps: int = 10) -> list[dict]:
    """`train` for each (plan fields, model, max_grad_norm) on this rank, in one launch: a
    world starts once and checks many plans (a start costs more than a small plan's run)."""
    return [train(mt.Plan(**plan), model, max_grad_norm=clip, steps=steps)
            for plan, model, clip in cases]


def assert_equivalent(result: dict, ref: dict, atol: float = 1e-5, what: str = "") -> None:
    """Losses, every parameter, every optimizer state and the norms within `atol`."""
    close = dict(rtol=0, atol=atol)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]),
                               **close, msg=lambda m: f"{what} losses: {m}")
    assert sorted(result["state"]) == sorted(ref["state"]), what
    for name, value in ref["state"].items():
        torch.testing.assert_close(result["state"][name], value, **close,
                                   msg=lambda m: f"{what} {name}: {m}")
    assert sorted(result["optimizer"]) == sorted(ref["optimizer"]), what
    # optimizer states are sums of past gradients and grow past 1 (a momentum buffer of 1.15
    # in the tied model): the same 1e-5, relative to their size where that is above 1 (torch's
    # own DDP ends 7.6e-6 from one process on a 1.15 there, world 3, 4 micro-batches)
    states_close = dict(rtol=atol, atol=atol)
    for name, states in ref["optimizer"].items():
        for key, value in states.items():
            torch.testing.assert_close(torch.as_tensor(result["optimizer"][name][key]),
                                       torch.as_tensor(value), **states_close,
                                       msg=lambda m: f"{what} {name}.{key}: {m}")
    torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(ref["norms"]),
                               rtol=1e-5, atol=0, msg=lambda m: f"{what} norms: {m}")


def train_torch_ddp(model: str = "gpt", optimizer: str = "adamw", steps: int = 10,
                    microbatches: int = 1) -> dict:
    """The peer: torch's own DistributedDataParallel on this rank's share of the same
    batches (no_sync for all but the last micro-batch), on this rank's device (as `train`);
    returns what `reference` returns, on the host."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from meshtrain.core.device import rank_device

    device = rank_device()
    build, loss_fn, _, _ = MODELS[model]
    torch.manual_seed(0)
    net = build().to(device)
    loss_fn = loss_fn or net.loss
    ddp = DistributedDataParallel(net, device_ids=[device] if device.type == "cuda" else None)
    opt = OPTIMIZERS[optimizer](ddp.parameters())
    names = {id(p): n for n, p in net.named_parameters()}
    losses = []
    for x, y in batches(model, steps, dist.get_rank(), dist.get_world_size()):
        x, y = x.to(device), y.to(device)
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for i, (xm, ym) in enumerate(zip(x.chunk(microbatches), y.chunk(microbatches))):
            last = i == microbatches - 1
            with (ddp.no_sync() if not last else _nothing()):
                loss = loss_fn(ddp(xm), ym) / microbatches
                loss.backward()
            total += loss.detach()
        dist.all_reduce(total)
        opt.step()
        losses.append(total.item() / dist.get_world_size())
    state = {names[id(p)]: {k: v.clone() if isinstance(v, torch.Tensor) else v
                            for k, v in s.items()} for p, s in opt.state.items()}
    return on_host({"losses": losses, "state": {k: v.clone() for k, v in net.state_dict().items()},
                    "optimizer": state, "norms": []})


def drift(result: dict, ref: dict) -> float:
    """The largest absolute difference from the reference over losses and parameters."""
    worst = max(abs(a - b) for a, b in zip(result["losses"], ref["losses"]))
    for name, value in ref["state"].items():
        worst = max(worst, (result["state"][name] - value).abs().max().item())
    return worst


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def train_torch_fsdp(model: str = "gpt", optimizer: str = "adamw", steps: int = 10,
                     microbatches: int = 1) -> dict:
    """The peer that reduces gradients every micro-batch, as ZeRO-2 does: torch's FSDP2
    (`fully_shard` on each layer and the root); returns what `reference` returns."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    build, loss_fn, _, _ = MODELS[model]
    torch.manual_seed(0)
    net = build()
    loss_fn = loss_fn or net.loss
    if hasattr(net, "layers"):   # the GPT: a unit per layer; the tied model: the root alone
        for layer in net.layers():
            fully_shard(layer)
    fully_shard(net)
    opt = OPTIMIZERS[optimizer](net.parameters())
    losses = []
    for x, y in batches(model, steps, dist.get_rank(), dist.get_world_size()):
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches)):
            loss = loss_fn(net(xm), ym) / microbatches
            loss.backward()
            total += loss.detach()
        dist.all_reduce(total)
        opt.step()
        losses.append(total.item() / dist.get_world_size())
    full = {n: v.full_tensor().detach().clone() for n, v in net.state_dict().items()}
    return {"losses": losses, "state": full, "optimizer": {}, "norms": []}
