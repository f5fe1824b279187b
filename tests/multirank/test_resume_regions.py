"""A resumed rank reads only what it keeps of a checkpoint: the bytes it reads are its
share (ZeRO: rounded out to the saved row blocks), the state it loads is exactly the saving
trainer's, and its memory peak during the load stays near its share."""
import math
from pathlib import Path

import pytest
import torch

import meshtrain as mt
from meshtrain.core.memory import peak_process_bytes, reset_process_peak, resident_bytes
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.testing import run_ranks
from meshtrain.train import checkpoint, checkpoint_regions
from meshtrain.train.errors import CheckpointError

# about 0.94M parameters (3.8 MB in fp32, 11 MB with AdamW's two moments): a rank's share
# stands out of a process's resident memory, and each matrix (from 147 kB) is above the
# host heap's mmap threshold (core/processes.py), so what a load holds is resident
CONFIG = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=4, d_model=192, bias=False)
PLANS = {"zero3": {"dp": 4, "zero": 3}, "tp": {"dp": 2, "tp": 2}, "pp": {"dp": 2, "pp": 2}}
CHUNK = 24 << 10  # row blocks of 32 rows (768-byte rows): ZeRO's rounding is visible
STATES = 3        # the parameter and AdamW's exp_avg and exp_avg_sq, all fp32
FP32 = 4


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def trained(plan: mt.Plan, seed: int) -> mt.Trainer:
    torch.manual_seed(seed)
    trainer = mt.Trainer(GPT(CONFIG), plan, optimizer=adamw)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CONFIG.vocab_size, (8, CONFIG.seq_len + 1), generator=g)
    per_rank = tokens.chunk(trainer.dp_size)[trainer.dp_rank]
    trainer.step(per_rank[:, :-1], per_rank[:, 1:])
    return trainer


def differences(a: mt.Trainer, b: mt.Trainer) -> list[str]:
    """Where what `a` and `b` hold on this rank differs at all: the tensors their optimizers
    step (whole parameters, or ZeRO's flat shards) and every state of them."""
    out = []
    for i, (p, q) in enumerate(zip(*(t.optimizer.param_groups[0]["params"] for t in (a, b)))):
        out += [f"param {i}"] if not torch.equal(p, q) else []
        theirs = b.optimizer.state[q]
        out += [f"param {i} {k}" for k, v in a.optimizer.state[p].items()
                if not torch.equal(v, theirs[k])]
    return out


def expected_share(trainer: mt.Trainer) -> tuple[int, int]:
    """(bytes this rank keeps of the checkpoint's tensors, the rounding allowed), from the
    rank's own tensors: its tp slices (local shapes), under ZeRO-3 its flat ranges; each
    with its two moments, and AdamW's step counter (a 4-byte scalar) per parameter."""
    share = rounding = 0
    for name, p in trainer.stages.named_parameters():
        kept = p.numel()
        if trainer.plan.zero == 3:
            lo, hi = trainer.data_parallel.layout.owned_range(name)
            kept = hi - lo
            if 0 < kept < math.prod(trainer.layout.shapes[name]):   # a cut tensor: at most
                rounding += 2 * CHUNK * STATES                       # a block at each end
        share += kept * FP32 * STATES + FP32
    return share + sum(b.numel() * b.element_size() for _, b in trainer.stages.named_buffers()), rounding


def save_then_resume(path: str) -> dict:
    checkpoint_regions.CHUNK_BYTES = CHUNK
    out = {}
    for kind, plan_kw in PLANS.items():
        plan = mt.Plan(**plan_kw)
        saver = trained(plan, seed=0)
        saver.save(f"{path}/{kind}")
        fresh = trained(plan, seed=1)   # other values, overwritten by the load
        before = resident_bytes()
        reset_process_peak()
        fresh.load(f"{path}/{kind}")
        peak = peak_process_bytes() - before
        out[kind] = {"read": fresh.checkpoint_read, "expected": expected_share(fresh),
                     "differ": differences(saver, fresh), "peak": peak}
        if kind == "zero3":   # the whole read, as before: every tensor, then cut
            before = resident_bytes()
            reset_process_peak()
            model_state, optim_state, _ = checkpoint.load(f"{path}/{kind}", fresh.layout)
            fresh.load_full_state(model_state, optim_state)
            del model_state, optim_state
            out[kind]["whole_peak"] = peak_process_bytes() - before
    out["refused"] = refused_when_changed(fresh, f"{path}/{kind}")
    return out


def refused_when_changed(trainer: mt.Trainer, path: str) -> str:
    """The error every rank gets loading `path` once a byte of one of its files changed
    (its size kept: only a checksum tells): each rank checksums only what it reads."""
    if torch.distributed.get_rank() == 0:
        shard = sorted(Path(path).glob("*.distcp"))[0]
        changed = bytearray(shard.read_bytes())
        changed[len(changed) // 2] ^= 0xFF
        shard.write_bytes(bytes(changed))
    torch.distributed.barrier()
    with pytest.raises(CheckpointError) as refusal:
        trainer.load(path)
    return str(refusal.value)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    return run_ranks(4, save_then_resume, str(tmp_path_factory.mktemp("regions")), timeout=170)


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_a_resumed_rank_reads_its_share_and_loads_the_saved_state(resumed, kind):
    for rank, result in enumerate(resumed):
        got = result[kind]
        share, rounding = got["expected"]
        assert not got["differ"], (kind, rank, got["differ"][:5])
        assert share <= got["read"] <= share + rounding, (kind, rank, got["read"], share)


def test_zero3_ranks_read_the_checkpoint_once_between_them_and_never_hold_it(resumed):
    numel = [p.numel() for p in GPT(CONFIG).parameters()]
    whole = sum(numel) * FP32 * STATES   # every tensor of the checkpoint
    shares = [result["zero3"]["expected"][0] for result in resumed]
    # each element is some rank's; every rank reads each parameter's step counter
    assert sum(shares) == whole + len(resumed) * len(numel) * FP32
    for rank, result in enumerate(resumed):
        got = result["zero3"]
        # the whole read holds the whole state at once; a rank's own read about a quarter
        assert got["peak"] < whole <= got["whole_peak"], (rank, got["peak"], got["whole_peak"])


def test_a_changed_file_is_refused_on_every_rank(resumed):
    for result in resumed:
        assert "__0_0.distcp does not match its checksum (corrupted); use an earlier " \
               "checkpoint" in result["refused"]
