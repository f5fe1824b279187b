"""`meshtrain prepare`: shards equal to the tokenizer's own encode of every document (EOS
first), from text, JSON lines and Parquet; several workers and a resumed prepare give the
same shards; the index and the saved tokenizer describe them. Tokenizers are trained here,
offline, with the `tokenizers` library."""
import json
import shutil

import numpy as np
import pytest

from meshtrain.cli.main import main
from meshtrain.data.prepare import prepare
from meshtrain.data.shards import DataError, open_shard

EOS = "<|endoftext|>"


def train_tokenizer(path, vocab_size=300):
    """A byte-level BPE trained on a few sentences, saved as tokenizer.json at `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS * 3, trainer)
    tok.save(str(path))
    return path


DOCS = [f"document {i}: the quick brown fox number {i * 7} jumps over {i % 5} lazy dogs; "
        f"ünïcödé {'ab' * (i % 9)}\n" * (1 + i % 4) for i in range(60)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The DOCS as 20 text files, 20 JSON lines and 20 Parquet rows, in that order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("inputs")
    (root / "texts").mkdir()
    for i, doc in enumerate(DOCS[:20]):
        (root / "texts" / f"{i:02d}.txt").write_text(doc)
    (root / "b.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n"
                                          for i, d in enumerate(DOCS[20:40])))
    pq.write_table(pa.table({"text": DOCS[40:]}), root / "c.parquet")
    return [str(root / "texts"), str(root / "b.jsonl"), str(root / "c.parquet")]


def _all_tokens(out):
    index = json.loads((out / "index.json").read_text())
    return np.concatenate([open_shard(out / s["file"]) for s in index["shards"]]), index


def test_shards_equal_the_tokenizers_own_encode_of_every_document(tokenizer, inputs, tmp_path):
    from tokenizers import Tokenizer

    index = prepare(inputs, tokenizer, tmp_path / "d", shard_mb=0.002)
    tokens, _ = _all_tokens(tmp_path / "d")
    own = Tokenizer.from_file(str(tokenizer))
    eos = own.token_to_id(EOS)
    expect = [t for doc in DOCS for t in [eos, *own.encode(doc, add_special_tokens=False).ids]]
    assert tokens.tolist() == expect
    assert len(index["shards"]) > 3 and index["documents"] == len(DOCS)
    assert index["tokens"] == len(expect) and index["max_token"] == max(expect)
    assert index["dtype"] == "uint16" and index["eos_id"] == eos
    assert index["vocab_size"] == own.get_vocab_size()
    assert index["tokenizer"]["sha256"] and index["tokenizer"]["eos"] == EOS
    # the dataset carries its tokenizer, loadable by transformers
    from transformers import AutoTokenizer
    auto = AutoTokenizer.from_pretrained(str(tmp_path / "d" / "tokenizer"))
    assert auto.encode(DOCS[3], add_special_tokens=False) == own.encode(DOCS[3]).ids
    assert auto.eos_token == EOS


def test_workers_and_a_resumed_prepare_make_the_same_shards(tokenizer, inputs, tmp_path):
    whole = tmp_path / "whole"
    prepare(inputs, tokenizer, whole, shard_mb=0.002)
    parallel = tmp_path / "parallel"
    prepare(inputs, tokenizer, parallel, shard_mb=0.002, workers=2)
    assert _all_tokens(parallel)[0].tolist() == _all_tokens(whole)[0].tolist()
    # interrupted: one shard gone, one cut short, a half-written file left behind
    names = sorted(p.name for p in parallel.glob("shard_*.bin"))
    (parallel / names[1]).unlink()
    data = (parallel / names[2]).read_bytes()
    (parallel / names[2]).write_bytes(data[:-6])
    (parallel / (names[3] + ".tmp")).write_bytes(b"partial")
    (parallel / "index.json").unlink()
    untouched = (parallel / names[0]).stat().st_mtime_ns
    seen = []   # the progress bar's updates: every document's characters, resumed ones too
    prepare(inputs, tokenizer, parallel, shard_mb=0.002, progress=seen.append)
    assert sum(seen) == sum(map(len, DOCS)) and len(seen) == len(names)
    for name in names:
        assert (parallel / name).read_bytes() == (whole / name).read_bytes()
    assert (parallel / names[0]).stat().st_mtime_ns == untouched   # skipped, not redone
    assert json.loads((parallel / "index.json").read_text())["shards"] == \
        json.loads((whole / "index.json").read_text())["shards"]


def test_a_large_vocabulary_writes_uint32(tmp_path):
    from tokenizers import Tokenizer, models

    vocab = {f"w{i}": i for i in range(70_000)} | {EOS: 70_000, "[UNK]": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    from tokenizers.pre_tokenizers import Whitespace
    tok.pre_tokenizer = Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("w1 w69999 w5")
    index = prepare([str(tmp_path / "a.txt")], tmp_path / "tokenizer.json", tmp_path / "d")
    assert index["dtype"] == "uint32"
    assert _all_tokens(tmp_path / "d")[0].tolist() == [70_000, 1, 69_999, 5]


def test_bad_prepare_input_is_named(tokenizer, tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not a JSON object with a string 'text'"):
        prepare([str(tmp_path / "bad.jsonl")], tokenizer, tmp_path / "d")
    out = tmp_path / "other"
    (tmp_path / "ok.txt").write_text("hello")
    prepare([str(tmp_path / "ok.txt")], tokenizer, out)
    with pytest.raises(DataError, match="holds a prepare of other inputs or settings"):
        prepare([str(tmp_path / "ok.txt")], tokenizer, out, shard_mb=1)
    code = main(["prepare", str(tmp_path / "ok.txt"), "--tokenizer", str(tmp_path / "none"),
                 "--out", str(tmp_path / "x"), "--no-progress"])
    assert code == 2 and "no such file; give a tokenizer.json" in capsys.readouterr().err
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "data-00000-of-00001.arrow").write_bytes(b"ARROW1\0\0")
    with pytest.raises(DataError, match=r"arrow: a Hugging Face datasets folder .*to_parquet"):
        prepare([str(tmp_path / "hf")], tokenizer, tmp_path / "d2")
    shutil.rmtree(out)


def test_a_tokenizer_without_an_eos_says_how_to_name_one(tmp_path):
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    from meshtrain.data.tokenizer import Tokenizer

    Backend(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(tmp_path / "t.json"))
    with pytest.raises(DataError, match=r"no end-of-document token found .*`meshtrain prepare "
                                        r"--eos TOKEN`.* \"eos_token\" in the tokenizer_config"):
        Tokenizer(tmp_path / "t.json")
    assert Tokenizer(tmp_path / "t.json", eos="b").eos_id == 1   # named: prepare's --eos


def test_a_prepared_dataset_says_what_text_it_was_made_from(tokenizer, inputs, tmp_path):
    from meshtrain.data.tokens import open_tokens

    prepare(inputs, tokenizer, tmp_path / "d")
    assert open_tokens(str(tmp_path / "d")).source.startswith(
        f"{tmp_path / 'd'} (made from {inputs[0]} and 2 more; 1 shard(s), ")


def test_binary_non_utf8_and_empty_text_are_refused_not_tokenised(tokenizer, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blob.txt").write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)))
    (tmp_path / "latin1.txt").write_bytes("ok\ncaf\u00e9\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"no text found in .*empty\.txt"):
        prepare([str(tmp_path / "empty.txt")], tokenizer, tmp_path / "a")
    with pytest.raises(DataError, match=r"blob\.txt: a binary file .*not text"):
        prepare([str(tmp_path / "blob.txt")], tokenizer, tmp_path / "b")
    with pytest.raises(DataError, match=r"latin1\.txt: not UTF-8 text \(byte 0xe9 on line 2, "
                                        r"offset 6\); convert it"):
        prepare([str(tmp_path / "latin1.txt")], tokenizer, tmp_path / "c")
    (tmp_path / "lines.jsonl").write_text('{"text": ""}\n{"text": "words"}\n')
    index = prepare([str(tmp_path / "empty.txt"), str(tmp_path / "lines.jsonl")], tokenizer,
                    tmp_path / "d")
    assert index["documents"] == 1   # only the document with text, one EOS


def test_a_full_disk_names_the_folder_being_written(tokenizer, tmp_path, monkeypatch, capsys):
    import errno

    import meshtrain.data.prepare as prepare_module

    def full(*args):   # numpy's tofile raises without a file name
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prepare_module, "write_shard", full)
    (tmp_path / "a.txt").write_text("some words")
    assert main(["prepare", str(tmp_path / "a.txt"), "--tokenizer", str(tokenizer), "--out",
                 str(tmp_path / "d"), "--no-progress"]) == 2
    assert (f"meshtrain prepare: writing into {tmp_path / 'd'}: No space left on device"
            in capsys.readouterr().err)


def test_the_progress_total_is_the_inputs_bytes_where_they_measure_the_text(inputs, tmp_path):
    from meshtrain.data.prepare import input_bytes

    texts = [str(tmp_path / "a.txt"), str(tmp_path / "d")]
    (tmp_path / "a.txt").write_text("abc")
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "e" / "b.jsonl").write_text('{"text": "x"}\n')
    assert input_bytes(texts) == 3 + 14
    assert input_bytes(inputs) is None   # Parquet: compressed, no measure of its text


def test_a_long_document_is_encoded_in_pieces_to_its_whole_ids(tokenizer, tmp_path, monkeypatch):
    """A document longer than ENCODE_CHARS (a book as one file) is encoded in pieces cut
    where no word spans the cut: the library's per-token overhead (hundreds of bytes) stays
    bounded, and the ids are the whole text's."""
    import meshtrain.data.prepare as prepare_module
    from meshtrain.data.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer)
    text = "".join(DOCS) + "end.\n\n\n  spaced\n \nlast line \n\nx"
    anywhere = prepare_module._split(text, 120, exact=lambda text, cut: True)
    monkeypatch.setattr(prepare_module, "_TOKENIZER", tok)
    pieces = prepare_module._split(text, 120)   # each cut checked on the text around it
    assert pieces == anywhere and len(pieces) > 20   # this BPE's words never span a word's end
    assert [i for p in pieces for i in tok.encode(p)] == tok.encode(text)
    assert prepare_module._split(text, 120, exact=lambda text, cut: False) == [text]
    monkeypatch.setattr(prepare_module, "ENCODE_CHARS", 120)
    (tmp_path / "book.txt").write_text(text)
    tokens, _ = _all_tokens_of(prepare([str(tmp_path / "book.txt")], tokenizer, tmp_path / "d"),
                               tmp_path / "d")
    assert tokens.tolist() == [tok.eos_id, *tok.encode(text)]


def _all_tokens_of(index, out):
    return np.concatenate([open_shard(out / s["file"]) for s in index["shards"]]), index


def test_a_prepare_interrupted_before_its_first_shard_is_recorded_resumes(tokenizer, inputs,
                                                                         tmp_path, monkeypatch):
    """Workers finish shards out of order: a shard written before the first one is recorded
    (then Ctrl-C) left a folder the same command refused ("holds shards but no
    progress.json")."""
    import meshtrain.data.prepare as prepare_module

    real = prepare_module.write_shard

    def interrupted(path, tokens, dtype):
        real(path, tokens, dtype)
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_module, "write_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(inputs, tokenizer, tmp_path / "d", shard_mb=0.002)
    monkeypatch.setattr(prepare_module, "write_shard", real)
    index = prepare(inputs, tokenizer, tmp_path / "d", shard_mb=0.002)
    assert index["documents"] == len(DOCS)


def test_token_data_made_by_another_tokenizer_than_the_models_is_refused(tokenizer, inputs,
                                                                          tmp_path):
    from transformers import LlamaConfig

    from meshtrain.cli.train_data import settle_data
    from meshtrain.core.plan import PlanError
    from meshtrain.train.config import RunConfig

    model = tmp_path / "model"   # a save_pretrained folder with its own tokenizer
    LlamaConfig(vocab_size=320, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=64).save_pretrained(model)
    train_tokenizer(model / "tokenizer.json", vocab_size=290)
    prepare(inputs, tokenizer, tmp_path / "theirs")
    prepare(inputs, model, tmp_path / "ours")

    def config(data, tok=None):
        return RunConfig(run_dir=str(tmp_path / "run"), model=str(model / "config.json"),
                         init_from=str(model), data=str(tmp_path / data), tokenizer=tok,
                         seq_len=16)

    with pytest.raises(PlanError, match=r"theirs: made by another tokenizer than the model's "
                                        r"\(.*model/tokenizer\.json; the data's has vocabulary "
                                        r"300, the model's 290\)"):
        settle_data(config("theirs"))
    assert settle_data(config("ours")).vocab_size == 290
    assert settle_data(config("theirs", str(tokenizer))).vocab_size == 300   # named: taken


def test_the_text_cache_is_rebuilt_when_another_format_or_tokenizer_made_it(
        tokenizer, tmp_path, monkeypatch, capsys):
    """`train --data TEXT`'s token cache is keyed and checked by what made it: the same
    text and tokenizer reuse it; another tokenizer, or an index of another format version
    (an older meshtrain's) under the key, gives freshly prepared tokens."""
    from meshtrain.cli import train_data
    from meshtrain.data import prepare as prepare_module
    from meshtrain.data.tokenizer import Tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    text = tmp_path / "docs.txt"
    text.write_text("".join(DOCS[:8]))
    made = []
    monkeypatch.setattr(prepare_module, "prepare",
                        lambda *a, **k: made.append(a[2]) or prepare(*a, **k))
    tok = Tokenizer(tokenizer)
    out = train_data.tokenize_once(str(text), tok)
    assert train_data.tokenize_once(str(text), tok) == out and made == [out]   # reused
    index = json.loads((out / "index.json").read_text())
    assert (index["version"], index["tokenizer"]) == (prepare_module.VERSION, tok.identity)

    other = Tokenizer(train_tokenizer(tmp_path / "other.json", vocab_size=280))
    assert train_data.tokenize_once(str(text), other) != out and len(made) == 2
    assert made[1].joinpath("index.json").exists()

    (out / "index.json").write_text(json.dumps(dict(index, version=0)))   # an older format
    assert train_data.tokenize_once(str(text), tok) == out and made[2:] == [out]
    assert "was made by another meshtrain or tokenizer; rebuilding it" in capsys.readouterr().err
    rebuilt = json.loads((out / "index.json").read_text())
    assert rebuilt["version"] == prepare_module.VERSION and rebuilt["tokens"] == index["tokens"]
