"""torch's own PowerSGD (the DDP comm hook) on `meshtrain train`'s default case: the peer
against which meshtrain's PowerSGD's validation loss is read.

The same corpus, model, seed, batches, optimizer (AdamW, or `--optimizer sgd`), learning-rate warm-up and validation batches as
`meshtrain train` (run.py), but the model wrapped in torch's DistributedDataParallel with
`powerSGD_hook` (torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook) registered:

    python -m meshtrain.bench.powersgd_peer --nproc 4 --steps 256 --rank 4 --start-iter 32

prints the final validation loss. torch's hook needs `start_iter` >= 2 (plain all-reduce
before it).
"""
from __future__ import annotations

import argparse

import torch


def train(steps: int, rank: int, start_iter: int, optimizer: str = "adamw", batch: int = 32,
          seed: int = 0) -> float:
    """One rank's run; returns the validation loss after `steps` steps."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel

    from meshtrain.data.corpus import load_corpus
    from meshtrain.data.sampler import BatchSampler, eval_batches
    from meshtrain.models.registry import build_model
    from meshtrain.train.config import DEFAULT_LR, RunConfig, learning_rate
    from meshtrain.train.optimizers import run_optimizer

    config = RunConfig(run_dir="", steps=steps, batch_size=batch, seed=seed,
                       optimizer=optimizer, lr=DEFAULT_LR[optimizer])
    corpus = load_corpus(config.data)
    torch.manual_seed(config.seed)
    built = build_model(config.model, config.model_overrides, config.seq_len)
    net, seq = built.module, built.seq_len
    # one bucket (as meshtrain's 25 MiB holds this model): gloo needs every rank to issue
    # the hook's P and Q all-reduces in one order, which concurrent buckets do not keep
    ddp = DistributedDataParallel(net, bucket_cap_mb=64)
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                               start_powerSGD_iter=start_iter, random_seed=0)
    ddp.register_comm_hook(state, psgd.powerSGD_hook)
    opt = run_optimizer(ddp.parameters(), config.optimizer, config.lr, config.weight_decay,
                        config.momentum)
    world, me = dist.get_world_size(), dist.get_rank()
    sampler = BatchSampler(corpus.train, config.batch_size, seq, config.seed, me, world)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(config, step)
        x, y = sampler.batch(step)
        opt.zero_grad(set_to_none=True)
        built.loss(ddp(x), y).backward()
        opt.step()
    val = eval_batches(corpus.val, max(1, config.batch_size // 2), seq, config.eval_batches)
    net.eval()
    with torch.no_grad():   # the Trainer's split: replica r takes every world-th batch
        mine = [built.loss(net(x), y).item() for x, y in val[me::world]]
    total = torch.tensor([sum(mine), len(mine)], dtype=torch.float64,
                         device=next(net.parameters()).device)
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def main() -> None:
    from meshtrain.launch import launch
    from meshtrain.train.config import OPTIMIZERS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--start-iter", type=int, default=2)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="as `meshtrain train --optimizer` (its default learning rate)")
    a = p.parse_args()
    losses = launch(train, nproc=a.nproc, args=(a.steps, a.rank, a.start_iter, a.optimizer),
                       timeout_s=3600)
    print(f"torch powerSGD_hook rank {a.rank}, start_powerSGD_iter {a.start_iter}, "
          f"{a.optimizer}, {a.steps} steps, {a.nproc} ranks: val loss {losses[0]:.4f}")


if __name__ == "__main__":
    main()
