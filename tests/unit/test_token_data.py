"""Token datasets: llm.c-format shards read memory-mapped, split, sampled by (seed, step),
blended; and their bad input refused by `meshtrain train` before any rank starts."""
import json

import numpy as np
import pytest
import torch

from meshtrain.cli.main import main
from meshtrain.data.sampler import BatchSampler, eval_batches
from meshtrain.data.shards import HEADER_BYTES, DataError, open_shard, read_header, write_shard
from meshtrain.data.source import load_data, parse_blend
from meshtrain.data.tokens import VAL_FRACTION, open_tokens


def _tokens(n, high=1000, seed=0):
    return np.random.default_rng(seed).integers(0, high, n)


@pytest.mark.parametrize("dtype, high", [(np.uint16, 65_535), (np.uint32, 100_000)])
def test_a_shard_reads_back_memory_mapped_in_llmc_format(tmp_path, dtype, high):
    tokens = _tokens(5000, high)
    write_shard(tmp_path / "a.bin", tokens, dtype)
    raw = np.fromfile(tmp_path / "a.bin", dtype="<i4", count=3)
    assert list(raw) == [20240520 if dtype == np.uint16 else 20240801,
                         1 if dtype == np.uint16 else 7, 5000]
    back = open_shard(tmp_path / "a.bin")
    assert isinstance(back, np.memmap) and back.dtype == dtype
    assert np.array_equal(back, tokens)


def test_bad_shards_are_refused_naming_the_file(tmp_path):
    write_shard(tmp_path / "t.bin", _tokens(100), np.uint16)
    data = (tmp_path / "t.bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[:-10])
    (tmp_path / "long.bin").write_bytes(data + b"\0\0")
    (tmp_path / "tiny.bin").write_bytes(data[:100])
    header = np.frombuffer(data[:HEADER_BYTES], dtype="<i4").copy()
    for name, index, value in [("magic.bin", 0, 12345), ("version.bin", 1, 2)]:
        bad = header.copy()
        bad[index] = value
        (tmp_path / name).write_bytes(bad.tobytes() + data[HEADER_BYTES:])
    for name, words in [("cut.bin", "truncated"), ("long.bin", "longer than its header"),
                        ("tiny.bin", "shorter than an llm.c token shard"),
                        ("magic.bin", "magic 12345 version 1"),
                        ("version.bin", "magic 20240520 version 2")]:
        with pytest.raises(DataError, match=words) as info:
            read_header(tmp_path / name)
        assert name in str(info.value)


def test_npy_token_arrays_are_read_too(tmp_path):
    a = _tokens(3000, seed=5).astype(np.uint16)
    np.save(tmp_path / "edu_train_000001.npy", a)
    np.save(tmp_path / "edu_val_000000.npy", a[:500])
    data = open_tokens(str(tmp_path))
    assert data.train.numel() == 3000 and data.val.numel() == 500
    assert np.array_equal(data.train.read(torch.tensor([0, 2000]), 8).numpy(),
                          np.stack([a[:9], a[2000:2009]]))
    np.save(tmp_path / "bad.npy", np.zeros((3, 4), dtype=np.uint16))
    with pytest.raises(DataError, match=r"bad\.npy: a \.npy array of shape \(3, 4\)"):
        open_tokens(str(tmp_path / "bad.npy"))


def test_validation_by_shard_name_else_by_fraction(tmp_path):
    write_shard(tmp_path / "d_val_000000.bin", _tokens(300, seed=1), np.uint16)
    write_shard(tmp_path / "d_train_000001.bin", _tokens(2000, seed=2), np.uint16)
    data = open_tokens(str(tmp_path))
    assert data.train.numel() == 2000 and data.val.numel() == 300
    assert "named *val*" in data.source
    one = tmp_path / "one"
    one.mkdir()
    write_shard(one / "a.bin", _tokens(6000), np.uint16)
    write_shard(one / "b.bin", _tokens(4000), np.uint16)
    data = open_tokens(str(one))
    assert data.val.numel() == int(10_000 * VAL_FRACTION) and data.train.numel() == 9000
    assert "the last 1,000 tokens (a tenth" in data.source


def test_windows_are_the_shards_tokens_and_never_cross_a_shard(tmp_path):
    a, b = _tokens(500, seed=3), _tokens(700, seed=4)
    write_shard(tmp_path / "a.bin", a, np.uint16)
    write_shard(tmp_path / "b.bin", b, np.uint16)
    stream = open_tokens(f"{tmp_path}/*.bin").train   # 1080 train tokens: a, then b[:580]
    seq = 16
    assert stream.num_windows(seq) == (500 - seq) + (580 - seq)
    offsets = torch.arange(stream.num_windows(seq))
    w = stream.read(offsets, seq).numpy()
    expect = [a[i:i + seq + 1] for i in range(500 - seq)] + [b[i:i + seq + 1]
                                                            for i in range(580 - seq)]
    assert np.array_equal(w, np.stack(expect))


def test_dp_ranks_read_their_rows_of_one_global_batch(tmp_path):
    write_shard(tmp_path / "a.bin", _tokens(50_000), np.uint16)
    stream = open_tokens(str(tmp_path / "a.bin")).train
    whole = BatchSampler(stream, 8, 32, seed=5)
    for step in (0, 7):
        x, y = whole.batch(step)
        parts = [BatchSampler(stream, 8, 32, seed=5, dp_rank=r, dp_size=4).batch(step)
                 for r in range(4)]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert whole.window_hash(step) == BatchSampler(stream, 8, 32, seed=5, dp_rank=1,
                                                       dp_size=2).window_hash(step)
    assert whole.window_hash(0) != whole.window_hash(1)
    # windows come from the whole length: some start in the last tenth of the train split
    starts = torch.cat([whole.windows(s)[1] for s in range(20)])
    assert starts.max() > 0.9 * stream.num_windows(32)


def test_a_blend_draws_rows_by_weight(tmp_path):
    for name, value in [("a", 1), ("b", 2)]:
        (tmp_path / name).mkdir()
        write_shard(tmp_path / name / "x.bin", np.full(4000, value), np.uint16)
    assert parse_blend("p@3,q") == [("p", 3.0), ("q", 1.0)]
    data = load_data(f"{tmp_path / 'a'}@3,{tmp_path / 'b'}@1")
    sampler = BatchSampler(data.train, 400, 8, weights=data.weights)
    x, _ = sampler.batch(0)
    share = (x[:, 0] == 1).float().mean().item()
    assert 0.68 < share < 0.82 and set(x[:, 0].tolist()) == {1, 2}
    assert (x == x[:, :1]).all()   # each row from one dataset
    assert len(eval_batches(data.val, 4, 8, 2)) == 2


def test_a_token_at_or_above_the_vocabulary_is_refused_when_read(tmp_path):
    write_shard(tmp_path / "a.bin", np.arange(3000) % 600, np.uint16)
    stream = open_tokens(str(tmp_path / "a.bin"), vocab_size=512).train
    with pytest.raises(DataError, match=r"a\.bin: token \d+ is id 5\d\d, at or above the "
                                        r"vocabulary of 512"):
        eval_batches(stream, 4, 64, 4)


@pytest.fixture
def bad_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))   # the scanned largest ids
    write_shard(tmp_path / "big.bin", np.arange(40_000) % 40_000, np.uint16)
    write_shard(tmp_path / "empty.bin", np.zeros(0), np.uint16)
    write_shard(tmp_path / "ok.bin", _tokens(4000), np.uint16)
    (tmp_path / "cut.bin").write_bytes((tmp_path / "ok.bin").read_bytes()[:-1])
    return tmp_path


@pytest.mark.parametrize("argv, message", [
    ("--data cut.bin", "cut.bin: truncated: the header promises 4000 uint16 tokens"),
    ("--data empty.bin", "--data empty.bin: the dataset holds no tokens"),
    ("--data big.bin --model llama-tiny", "big.bin holds token id 39999, at or above the "
                                          "model's vocabulary"),
    ("--data ok.bin@2,notes.txt", "ok.bin@2,notes.txt: notes.txt is text"),
    ("--data ok.bin@x", "'ok.bin@x' is not PATH or PATH@WEIGHT"),
    ("--data ok.bin --seq 512", "val split of"),   # its last 400 tokens: no window of 513
])
def test_bad_token_data_is_refused_before_any_rank_starts(bad_data, argv, message, capsys):
    (bad_data / "notes.txt").write_text("words " * 1000)
    code = main(["train", "--nproc", "1", "--steps", "1", *argv.split()])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err
    if "big.bin" in argv:   # scanned once, then known: (path, size, time) -> largest id
        cached = json.loads((bad_data / "cache/meshtrain/tokens/max_token.json").read_text())
        assert list(cached.values()) == [39_999]


def test_bench_data_reports_the_loaders_headroom_over_a_step(tmp_path, capsys):
    import json

    write_shard(tmp_path / "a.bin", _tokens(20_000, high=256), np.uint16)
    argv = ["bench", "data", "--data", str(tmp_path / "a.bin"), "--world", "2", "--batch", "4",
            "--steps", "2", "--reps", "1", "--warmup", "0", "--json", str(tmp_path / "r.json")]
    assert main(argv) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    loader, step = r["loader"], r["training step"]
    assert r["local_batch"] == 2 and r["seq_len"] == 128
    assert loader["windows_per_s"] == pytest.approx(2 / loader["median_s"])
    assert r["headroom"] == pytest.approx(loader["windows_per_s"] / step["windows_per_s"])
    assert "headroom: the loader delivers" in capsys.readouterr().out
    assert main(["bench", "data", "--data", str(tmp_path / "none.bin")]) == 2
    assert "none.bin: no such file or folder" in capsys.readouterr().err
