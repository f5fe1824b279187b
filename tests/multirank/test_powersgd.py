"""PowerSGD: at full rank it reproduces one process (and so DDP) to round-off, with
micro-batches and clipping too; at rank 1 it still trains; its bytes per collective are (M + N) r per compressed matrix plus the rest."""
import torch
import torch.distributed as dist

import meshtrain as mt
from meshtrain.core.comm import ring_all_reduce_elements
from meshtrain.testing import run_ranks
from tests.multirank import equivalence as eq

STEPS = 4


def expected_elements(model: torch.nn.Module, rank: int, min_rate: float) -> tuple[int, int, int]:
    """The formula: P and Q elements of the matrices worth compressing, and the flat rest
    (uncompressed gradients, then the loss and one used flag per parameter)."""
    p = q = plain = 0
    params = [t for t in model.parameters() if t.requires_grad]
    for t in params:
        rows = t.shape[0]
        cols = t.numel() // rows
        r = min(rank, rows, cols)
        if t.dim() >= 2 and rows * cols > min_rate * (rows + cols) * r:
            p, q = p + rows * r, q + cols * r
        else:
            plain += t.numel()
    return p, q, plain + 1 + len(params)


def powersgd_rank():
    world, me = dist.get_world_size(), dist.get_rank()
    exact = dict(dp=world, compression="powersgd", compression_rank=1000,
                 compression_min_rate=0.0)
    full = [eq.train(mt.Plan(**exact), steps=STEPS),
            eq.train(mt.Plan(**exact, microbatches=2), steps=STEPS, max_grad_norm=0.5),
            # rank 1 after a warm-up as long as the run: plain DDP throughout
            eq.train(mt.Plan(dp=world, compression="powersgd", compression_rank=1,
                             sync_warmup_steps=STEPS), steps=STEPS)]
    # rank 1, fitting one fixed batch (the data are random tokens: only memorising them
    # lowers the loss); the default min rate leaves the small matrices whole; count bytes
    torch.manual_seed(0)
    net = eq.gpt()
    trainer = mt.Trainer(net, mt.Plan(dp=world, compression="powersgd", compression_rank=1),
                         optimizer=eq.sgd)
    sizes = expected_elements(net, 1, 2.0)
    losses = []
    x, y = eq.batches("gpt", 1, trainer.dp_rank, trainer.dp_size)[0]
    for i in range(12):
        if i == 1:
            trainer.comm.stats.reset()
        losses.append(trainer.step(x, y))
    traffic = {tag: trainer.comm.stats.total("dp", "all_reduce", tag)
               for tag in ("powersgd_p", "powersgd_q", "grad")}
    p, q, plain = sizes   # P travels with the rest: one all-reduce, then Q's
    sent = [ring_all_reduce_elements(n, world, me) * 4 for n in (p + plain, q)]
    trainer.close()
    return (full, losses, sizes, {t: (tr.calls, tr.sent) for t, tr in traffic.items()}, sent,
            warmup_traffic(world))


def warmup_traffic(world: int) -> dict:
    """Three steps with sync_warmup_steps=2: what each step sent, by tag; and DDP's bytes
    per step (one bucket: every gradient, the loss and a used flag per parameter)."""
    torch.manual_seed(0)
    trainer = mt.Trainer(eq.gpt(), mt.Plan(dp=world, compression="powersgd",
                                           compression_rank=1, sync_warmup_steps=2),
                         optimizer=eq.sgd)
    params = trainer.data_parallel.params
    ddp_elements = sum(p.numel() for p in params) + 1 + len(params)
    out = []
    for x, y in eq.batches("gpt", 3, trainer.dp_rank, trainer.dp_size):
        trainer.comm.stats.reset()
        trainer.step(x, y)
        out.append({t: trainer.comm.stats.total("dp", "all_reduce", t).sent
                    for t in ("powersgd_p", "grad")})
    trainer.close()
    return out, ring_all_reduce_elements(ddp_elements, world, dist.get_rank()) * 4


def test_powersgd_full_rank_equals_one_process_and_rank_one_trains_with_formula_bytes():
    refs = [eq.reference(steps=STEPS), eq.reference(steps=STEPS, max_grad_norm=0.5)]
    refs.append(refs[0])
    for full, losses, sizes, traffic, sent, warm in run_ranks(2, powersgd_rank):
        for result, ref, what in zip(full, refs, ("", " 2 micro-batches, clipped",
                                                  " rank 1 in its warm-up")):
            eq.assert_equivalent(result, ref, what="powersgd full rank" + what)
        assert losses[-1] < 0.95 * losses[0], losses   # measured 4.163 -> 3.894
        p, q, plain = sizes
        assert p > 0 and q > 0 and plain > 0, sizes   # the test model exercises both paths
        steps = 11   # counted after the first step
        # two all-reduces a step: every P with what travels whole, the loss and the used
        # flags; then every Q
        assert traffic["powersgd_p"] == (steps, steps * sent[0])
        assert traffic["powersgd_q"] == (steps, steps * sent[1])
        assert traffic["grad"] == (0, 0)
        # warm-up steps send DDP's buckets (every gradient, the loss and the used flags),
        # compression starts at step 2
        steps_sent, ddp_bytes = warm
        assert [w["powersgd_p"] for w in steps_sent] == [0, 0, sent[0]]
        assert [w["grad"] for w in steps_sent] == [ddp_bytes, ddp_bytes, 0]
