import pytest
import torch

from meshtrain.data.corpus import MIN_SPLIT_BYTES, load_corpus
from meshtrain.data.source import TrainingData, check_fits
from meshtrain.data.sampler import BatchSampler, eval_batches


def _text(n: int, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return bytes(torch.randint(32, 127, (n,), generator=g, dtype=torch.uint8).tolist())


# ---- corpus -------------------------------------------------------------------------------

def test_default_corpus_is_deterministic_and_split():
    a = load_corpus(max_bytes=2**20)
    b = load_corpus(max_bytes=2**20)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.train.dtype == torch.uint8 and a.train.dim() == 1
    assert a.train.numel() + a.val.numel() == 2**20
    assert a.train.numel() == int(2**20 * 0.9)
    assert a.num_files > 1 and "standard library" in a.source and "files" in a.source


def test_user_file(tmp_path):
    data = _text(10_000)
    path = tmp_path / "book.txt"
    path.write_bytes(data)
    c = load_corpus(path, val_fraction=0.25)
    assert c.num_files == 1
    assert bytes(c.train.tolist()) == data[:7500] and bytes(c.val.tolist()) == data[7500:]
    assert load_corpus(path, max_bytes=9000, val_fraction=0.25).train.numel() == 6750


def test_user_folder_sorted_skips_binary_and_hidden(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "b" / "two.txt").write_bytes(_text(3000, 2))
    (tmp_path / "a.txt").write_bytes(_text(3000, 1))
    (tmp_path / "c.txt").write_bytes(_text(3000, 3))
    (tmp_path / "image.bin").write_bytes(b"\x89PNG\0\0" + _text(3000, 4))
    (tmp_path / ".git" / "HEAD").write_bytes(_text(3000, 5))
    c = load_corpus(tmp_path, val_fraction=0.3)
    stream = bytes(torch.cat([c.train, c.val]).tolist())
    assert c.num_files == 3
    assert stream == b"\n".join([_text(3000, 1), _text(3000, 2), _text(3000, 3)])


def test_corpus_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'.*nowhere' does not exist"):
        load_corpus(tmp_path / "nowhere")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "x.bin").write_bytes(b"\0" * 100)
    with pytest.raises(ValueError, match=r"no text files found under '.*bin'"):
        load_corpus(tmp_path / "bin")
    small = tmp_path / "small.txt"
    small.write_bytes(_text(MIN_SPLIT_BYTES * 5))
    with pytest.raises(ValueError, match=r"too small: 10240 bytes split 9216 train / 1024 val"):
        load_corpus(small)
    with pytest.raises(ValueError, match=r"val_fraction=1.5"):
        load_corpus(small, val_fraction=1.5)
    c = TrainingData.of_corpus(load_corpus(small, val_fraction=0.5))
    check_fits(c, seq_len=1000)
    with pytest.raises(ValueError, match=r"train split of .*small.txt .* has 5120 bytes, fewer than seq_len\+1=8193"):
        check_fits(c, seq_len=8192)


# ---- sampler ------------------------------------------------------------------------------

DATA = torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(0),
                     dtype=torch.uint8)


def test_a_named_binary_parquet_or_json_lines_file_is_not_read_as_bytes(tmp_path):
    text = b"plain text " * 1000
    for name, data, message in [
            ("web.parquet", b"PAR1" + text, r"web\.parquet: parquet documents are read with a "
                                            r"tokenizer: give --tokenizer"),
            ("notes.jsonl", b'{"text": "a"}\n' * 800, r"notes\.jsonl: jsonl documents"),
            ("blob.txt", b"\x7fELF\0" + text, r"blob\.txt: a binary file .*not text")]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=message):
            load_corpus(tmp_path / name)


def test_dp_shards_concatenate_to_the_global_batch():
    whole = BatchSampler(DATA, batch_size=8, seq_len=32, seed=7).batch(3)
    for n in (2, 4, 8):
        parts = [BatchSampler(DATA, 8, 32, seed=7, dp_rank=r, dp_size=n).batch(3)
                 for r in range(n)]
        assert all(x.shape == (8 // n, 32) for x, _ in parts)
        assert torch.equal(torch.cat([x for x, _ in parts]), whole[0])
        assert torch.equal(torch.cat([y for _, y in parts]), whole[1])


def test_batch_depends_only_on_seed_and_step():
    s = BatchSampler(DATA, 4, 16, seed=1)
    later = [s.batch(k)[0] for k in (5, 0, 5)]
    assert torch.equal(later[0], later[2])
    assert torch.equal(BatchSampler(DATA, 4, 16, seed=1).batch(5)[0], later[0])
    assert not torch.equal(s.batch(6)[0], later[0])
    assert not torch.equal(BatchSampler(DATA, 4, 16, seed=2).batch(5)[0], later[0])


def test_targets_are_inputs_shifted_by_one():
    x, y = BatchSampler(DATA, 4, 16).batch(0)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row_x, row_y in zip(x, y):                   # each row is one window of the data
        start = next(i for i in range(DATA.numel() - 16)
                     if torch.equal(DATA[i:i + 16].long(), row_x))
        assert torch.equal(DATA[start + 1:start + 17].long(), row_y)


def test_sampler_errors_are_clear():
    with pytest.raises(ValueError, match=r"global batch 10 does not split over dp=4 ranks; "
                                         r"use a multiple of 4"):
        BatchSampler(DATA, 10, 16, dp_size=4)
    with pytest.raises(ValueError, match=r"data has 5000 tokens, fewer than seq_len\+1=5001"):
        BatchSampler(DATA, 4, 5000)
    with pytest.raises(ValueError, match=r"dp_rank=2 is outside"):
        BatchSampler(DATA, 4, 16, dp_rank=2, dp_size=2)


def test_eval_batches_fixed_and_spanning():
    a = eval_batches(DATA, 4, 16, num_batches=3)
    b = eval_batches(DATA, 4, 16, num_batches=3)
    assert len(a) == 3 and all(x.shape == y.shape == (4, 16) for x, y in a)
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))
    assert torch.equal(a[0][0][0], DATA[:16].long())           # first window at offset 0
    assert torch.equal(a[-1][1][-1], DATA[-16:].long())        # last window ends at the end


def test_pinned_batches_are_the_same_batches_pinned(monkeypatch):
    """pin_memory=True (a GPU's batches, train/run.py) pins each batch, as torch's DataLoader
    does; its values are the unpinned sampler's. Pinning needs a GPU build: it is recorded
    here, not done."""
    pinned = []

    def pin(tensor):
        pinned.append(tensor)
        return tensor.clone()
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    data = torch.arange(200, dtype=torch.uint8)
    plain = BatchSampler(data, batch_size=4, seq_len=8, seed=3).batch(5)
    assert pinned == []   # the default pins nothing
    got = BatchSampler(data, batch_size=4, seq_len=8, seed=3, pin_memory=True).batch(5)
    assert len(pinned) == 2 and all(torch.equal(a, b) for a, b in zip(got, plain))
    fixed = eval_batches(data, 2, 8, 3, pin_memory=True)
    assert len(pinned) == 2 + 2 and len(fixed) == 3   # one pinned (inputs, targets) pair, split
    assert all(torch.equal(a, b) for pair in zip(fixed, eval_batches(data, 2, 8, 3))
               for a, b in zip(*pair))
