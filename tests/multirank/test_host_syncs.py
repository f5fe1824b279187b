"""At most one host synchronisation per training step: the reported loss (issue 29 item 2).

On CUDA the host waits for the device whenever it reads a device value (`item`, `tolist`,
`float(t)`, `bool(t)`), copies one to the host (`cpu`, `numpy`) or runs an op whose output
size depends on the data (`nonzero`, boolean masks, `unique`). A CPU run can count those
calls: a TorchDispatchMode sees every aten op below autograd (`_local_scalar_dense` is what
`item`, `float` and `bool` become), and the Python methods that never dispatch on a host
tensor (`tolist`, `cpu`, `numpy`) are wrapped. Each call is attributed to the innermost
meshtrain line that made it.

Not counted, because a CPU run cannot see them: host-to-device copies of pageable memory,
which torch also waits for (`copy_` without `non_blocking`). The step makes one where the
batch comes from pageable memory (`to_device` in the step driver copies a pinned one without
blocking: `meshtrain train` pins its batches beside a GPU), or none when the caller hands it
over already on the device. The used-parameter flags go over pinned memory without blocking.
"""
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import meshtrain as mt
from meshtrain.testing import run_ranks
from tests.multirank.equivalence import batches, gpt, sgd

SYNCING_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2",
               "unique_consecutive", "unique_dim", "repeat_interleave"}
HOST_METHODS = ("tolist", "cpu", "numpy")
MASK_INDEXING = {"index", "index_put", "_index_put_impl"}   # with a boolean mask: nonzero


def _syncs(name: str, args) -> bool:
    if name in MASK_INDEXING:
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                   for i in args[1])
    return name in SYNCING_OPS


def _site() -> str:
    """The innermost meshtrain frame of the current stack, as `path:line`."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        where = frame.filename.replace("\\", "/")
        if "/meshtrain/" in where and "/tests/" not in where:
            return f"{where.split('/meshtrain/', 1)[1]}:{frame.lineno}"
    return "outside meshtrain"


class HostSyncs(TorchDispatchMode):
    """Every call that makes the host wait for the device, while active, by site."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: list[str] = []
        self._saved = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _syncs(func.overloadpacket.__name__, args):
            self.sites.append(f"{func.overloadpacket.__name__} at {_site()}")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in HOST_METHODS:
            original = self._saved[name] = getattr(torch.Tensor, name)

            def counted(t, *a, _name=name, _original=original, **k):
                self.sites.append(f"{_name} at {_site()}")
                return _original(t, *a, **k)
            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)


PLANS = {"DDP": {}, "ZeRO-1": {"zero": 1}, "ZeRO-2": {"zero": 2},
         "ZeRO-1, clipped": {"zero": 1, "max_grad_norm": 0.5},
         "DDP, 2 micro-batches": {"microbatches": 2}}


def syncs_per_step(steps: int = 3) -> dict[str, list[list[str]]]:
    """Per plan: the host syncs of each step after the first (which builds lazy state)."""
    import torch.distributed as dist

    out = {}
    for name, fields in PLANS.items():
        torch.manual_seed(0)
        trainer = mt.Trainer(gpt(), mt.Plan(dp=dist.get_world_size(), **fields), optimizer=sgd)
        data = batches("gpt", steps, trainer.dp_rank, trainer.dp_size)
        trainer.step(*data[0])
        out[name] = []
        for x, y in data[1:]:
            with HostSyncs() as counter:
                trainer.step(x, y)
            out[name].append(counter.sites)
        if fields.get("max_grad_norm"):
            assert trainer.last_grad_norm > 0   # still readable, once the step is over
        trainer.close()
    return out


def test_a_training_step_waits_for_the_device_once():
    for rank, per_plan in enumerate(run_ranks(2, syncs_per_step)):
        for name, steps in per_plan.items():
            for sites in steps:
                assert len(sites) == 1, f"rank {rank}, {name}: {len(sites)} host syncs in " \
                                        f"one step: {sites}"
                assert sites[0].startswith("tolist at strategies/"), (name, sites)


def test_the_counter_sees_what_syncs():
    t = torch.arange(6.0)
    with HostSyncs() as counter:
        t.sum().item()
        float(t[0])
        t.tolist()
        t[t > 2].sum()
        (t + 1).exp()   # device work only
    assert [s.split(" at ")[0] for s in counter.sites] == [
        "_local_scalar_dense", "_local_scalar_dense", "tolist", "index"]
    assert torch.Tensor.tolist.__name__ == "tolist"   # put back on exit
