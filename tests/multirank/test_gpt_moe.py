"""meshtrain's GPT with a mixture of experts (GPTConfig(experts=4, top_k=2): Mixtral's routing,
SwiGLU experts in transformers' packed layout, models/gpt_moe.py) under every plan it runs,
equal to one process in plain PyTorch computing cross-entropy + router_aux_coef x the
load-balancing loss (transformers' formula, written out below) on the global batch: SGD with
momentum, losses, every parameter and optimizer state within 1e-5, the first step's loss
parts too.

Cases pairwise, each composition once: dp=2; ep=2 (with full recomputation); ep=4; ep=2 in
dp=4 with ZeRO-1 and with ZeRO-3 (each expert sharded over its edp group); tp=2 (attention
split, router and experts whole); dp x tp x ep; pp=2 (1F1B) and dp x pp x ep (GPipe,
ZeRO-1), the routing carried through the stages; bf16 within bf16's round-off
(test_hf_models.check_bf16); a capacity factor under ep against one process with the same
limit. A `meshtrain train --model gpt-moe-tiny --ep 2` run's metrics
give the tokens per expert (test_expert_parallel's check) and the loss in its parts."""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from torch import nn

import meshtrain as mt
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.testing import run_ranks
from tests.multirank import equivalence as eq

MOE = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, bias=False,
                experts=4, top_k=2)
eq.MODELS["gpt_moe"] = (lambda: GPT(MOE), None, MOE.vocab_size, MOE.seq_len)
STEPS = 3
CAPACITY = 1.0   # drops choices on this model (asserted against the dropless reference)
CASES = {2: [dict(dp=2), dict(dp=2, ep=2, recompute="full"), dict(tp=2),
             dict(dp=2, ep=2, precision="bf16"), dict(dp=2, ep=2, capacity_factor=CAPACITY),
             dict(pp=2, schedule="1f1b")],
         4: [dict(dp=4, ep=4), dict(dp=4, ep=2, zero=1), dict(dp=4, ep=2, zero=3),
             dict(dp=2, tp=2, ep=2),
             dict(dp=2, pp=2, ep=2, zero=1, schedule="gpipe")]}


def balancing(router_logits: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """transformers' load_balancing_loss_func: E * sum_e f_e P_e over every layer's tokens,
    f_e the top-k choices of expert e per token, P_e its mean probability."""
    probs = F.softmax(torch.cat(router_logits), dim=-1)                # (L*T, E)
    chosen = torch.topk(probs, MOE.top_k, dim=-1).indices
    f = F.one_hot(chosen, MOE.experts).float().sum(dim=1).mean(dim=0)   # (E,)
    return MOE.experts * (f * probs.float().mean(dim=0)).sum()


def reference(bf16: bool = False, capacity_factor: float | None = None) -> dict:
    """One process, plain PyTorch; `bf16`: bf16 parameters with fp32 masters, the
    cross-entropy in fp32 (eq.reference_bf16's recipe); `capacity_factor`: the experts
    limited as every plan limits them (models/experts.py, tested on its own there)."""
    from meshtrain.models.experts import limit_capacity

    torch.manual_seed(0)
    net = GPT(MOE)
    limit_capacity(net, capacity_factor)
    names = [n for n, _ in net.named_parameters()]
    params = list(net.parameters())
    masters = [nn.Parameter(p.detach().clone()) for p in params] if bf16 else params
    if bf16:
        net.to(torch.bfloat16)
    opt = eq.sgd(masters)
    losses, parts = [], []
    for x, y in eq.batches("gpt_moe", STEPS):
        opt.zero_grad(set_to_none=True)
        out = net(x)
        ce, aux = net.loss(out.logits.float(), y), balancing(out.router_logits)
        loss = ce + MOE.router_aux_coef * aux
        loss.backward()
        if bf16:
            for m, p in zip(masters, params):
                m.grad, p.grad = p.grad.float(), None
        opt.step()
        if bf16:
            with torch.no_grad():
                for m, p in zip(masters, params):
                    p.copy_(m)
        losses.append(loss.item())
        parts.append({"cross_entropy": ce.item(), "router_aux": aux.item()})
    state = {n: m.detach().clone() for n, m in zip(names, masters)}
    by_id = {id(m): n for n, m in zip(names, masters)}
    optimizer = {by_id[id(p)]: {k: v.clone() for k, v in s.items()}
                 for p, s in opt.state.items()}
    return {"losses": losses, "parts": parts, "state": state, "optimizer": optimizer,
            "norms": []}


def train_cases(cases: list[dict], run_dir: str | None) -> list[dict]:
    """Each plan trained STEPS steps on this rank, with each step's loss parts; then, with
    `run_dir`, this rank of `meshtrain train --model gpt-moe-tiny --ep 2 --capacity-factor 1`
    (2 layers, 16 tokens) writing its metrics there."""
    results = []
    for plan in cases:
        torch.manual_seed(0)
        trainer = mt.Trainer(GPT(MOE), mt.Plan(**plan), optimizer=eq.sgd)
        losses, parts = [], []
        for x, y in eq.batches("gpt_moe", STEPS, trainer.dp_rank, trainer.dp_size):
            losses.append(trainer.step(x, y))
            parts.append(trainer.last_loss_parts)
        results.append(eq.on_host({"losses": losses, "parts": parts, "norms": [],
                                   "state": trainer.full_state_dict(),
                                   "optimizer": trainer.full_optimizer_state()["state"]}))
        trainer.close()
    if run_dir is not None:
        from meshtrain.train.config import RunConfig
        from meshtrain.train.run import train_rank

        plan = mt.Plan(dp=2, ep=2, capacity_factor=CAPACITY)
        train_rank(RunConfig(run_dir=run_dir, plan=plan.to_dict(),
                             model="gpt-moe-tiny", model_overrides={"n_layer": 2, "seq_len": 16},
                             steps=2, batch_size=4, optimizer="sgd", lr=0.1, warmup=0,
                             eval_every=1, eval_batches=1, ckpt_every=100, progress=False))
    return results


def test_gpt_moe_equals_one_process(tmp_path, capsys):
    from tests.multirank.test_expert_parallel import check_run_reports_expert_load
    from tests.multirank.test_hf_models import check_bf16

    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as a rank computes: a tiny model, many processes per core
    try:
        refs = {False: reference(), True: reference(bf16=True),
                "capacity": reference(capacity_factor=CAPACITY)}
    finally:
        torch.set_num_threads(threads)
    for world, cases in CASES.items():
        run_dir = str(tmp_path) if world == 2 else None
        per_rank = run_ranks(world, train_cases, cases, run_dir, timeout=170)
        for rank, results in enumerate(per_rank):
            for plan, result in zip(cases, results):
                what = f"gpt-moe rank {rank} {mt.Plan(**plan).describe()}"
                if plan.get("precision") == "bf16":
                    check_bf16(result, refs[True], exact=False, what=what)
                    continue
                ref = refs["capacity" if plan.get("capacity_factor") else False]
                eq.assert_equivalent(result, ref, what=what)
                for mine, theirs in zip(result["parts"], ref["parts"]):
                    for key, value in theirs.items():
                        assert abs(mine[key] - value) <= 1e-5, (what, key, mine, theirs)
    assert refs["capacity"]["losses"][1:] != refs[False]["losses"][1:]   # it dropped some
    check_run_reports_expert_load(tmp_path)
    assert "imbalance max/mean" in capsys.readouterr().out
    # each step's loss in its parts: the cross-entropy and the router's loss, unscaled
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for m in [m for m in steps if "loss" in m]:
        assert abs(m["loss"] - m["cross_entropy"] - 0.02 * m["router_aux"]) < 1e-5, m
