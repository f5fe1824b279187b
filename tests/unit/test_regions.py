"""A rank's region of a whole tensor (core/regions.py), as tensor parallel's splits give it,
and the chunks a checkpoint writes a tensor in (train/checkpoint_regions.py)."""
import math

import pytest
import torch

from meshtrain.strategies.tensor_parallel.sharding import Split
from meshtrain.train.checkpoint_regions import chunk_grid

SPLITS = [
    (Split(0, 62, 64), (62, 32)),            # a vocabulary, padded for tp = 4
    (Split(1, 96, 96, blocks=3), (32, 96)),  # a fused q, k, v Conv1D (in, out)
    (Split(1, 128, 128), (32, 128)),         # nn.Linear split by input features
]


def read(whole: torch.Tensor, region) -> list[torch.Tensor]:
    return [whole[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))].clone()
            for b in region.reads()]


@pytest.mark.parametrize("split, shape", SPLITS)
def test_a_region_reads_what_the_slice_holds(split, shape):
    whole = torch.arange(1, math.prod(shape) + 1, dtype=torch.float32).view(shape)  # no 0
    for rank in range(4):
        local = split.local(whole, rank, 4)
        region = split.region(shape, rank, 4)
        assert torch.equal(region.assemble(read(whole, region), whole.dtype), local)
        assert region.share() == torch.count_nonzero(local)   # the padding is not read
        for flat in [(0, local.numel()), (5, 77), (local.numel() - 9, local.numel())]:
            part = region.within(flat)
            piece = local.reshape(-1)[flat[0]:flat[1]]
            assert torch.equal(part.assemble(read(whole, part), whole.dtype), piece)
            assert part.share() == torch.count_nonzero(piece)


@pytest.mark.parametrize("split, shape", SPLITS)
def test_chunks_cut_where_the_slices_do(split, shape):
    cuts = [[] for _ in shape]
    cuts[split.dim] = sorted({start for _, _, start in split.starts(4)})
    chunks = chunk_grid(shape, cuts, itemsize=4, chunk_bytes=1 << 20)
    boxes = [b for rank in range(4) for b in split.region(shape, rank, 4).boxes]
    for offsets, sizes in chunks:   # each chunk lies inside one box or outside all of them
        for box in boxes:
            spans = [(max(o, bo), min(o + s, bo + bs)) for o, s, bo, bs in
                     zip(offsets, sizes, box.offsets, box.sizes)]
            overlap = math.prod(max(0, b - a) for a, b in spans)
            assert overlap in (0, math.prod(sizes)), (offsets, sizes, box)


def test_chunks_tile_the_tensor_in_row_blocks_of_at_most_the_chunk_size():
    shape, row = (100, 8), 8 * 4
    chunks = chunk_grid(shape, [[], [3]], itemsize=4, chunk_bytes=10 * row)
    covered = torch.zeros(shape, dtype=torch.int32)
    for offsets, sizes in chunks:
        covered[offsets[0]:offsets[0] + sizes[0], offsets[1]:offsets[1] + sizes[1]] += 1
        assert sizes[0] <= 10
    assert torch.equal(covered, torch.ones(shape, dtype=torch.int32))   # once each
    assert len(chunks) == 10 * 2
    assert chunk_grid((), [], 4, 64) == [((), ())]   # a scalar: one chunk


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_load_checksums_the_files_it_reads(tmp_path):
    from meshtrain.core.plan import Plan
    from meshtrain.core.regions import whole
    from meshtrain.core.state import StateLayout
    from meshtrain.train import checkpoint
    from meshtrain.train.errors import CheckpointError

    value = torch.randn(10, 6)
    checkpoint.save(tmp_path / "ck", {"w": value}, None, Plan(), {})
    layout = StateLayout(["w"], {"w": "w"}, {"w": (10, 6)}, ["w"])
    read = checkpoint.load_regions(tmp_path / "ck", layout, lambda entry, shape: whole(shape))
    assert torch.equal(read[0]["w"], value) and read[3] == value.numel() * 4
    shard = sorted((tmp_path / "ck").glob("*.distcp"))[0]
    changed = bytearray(shard.read_bytes())
    changed[-30] ^= 0xFF   # same size: only its checksum tells
    shard.write_bytes(bytes(changed))
    assert checkpoint.load_regions(tmp_path / "ck", layout, lambda e, s: None)[3] == 0
    with pytest.raises(CheckpointError, match=f"{shard.name} does not match its checksum"):
        checkpoint.load_regions(tmp_path / "ck", layout, lambda entry, shape: whole(shape))
