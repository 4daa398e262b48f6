"""The data formats of `moe train --data`: token shards written by `moe data tokenize` and
memory-mapped, JSON lines, Parquet and `datasets` inputs; each gives the token stream the same
documents give as text files."""

import json

import numpy as np
import pytest

from moe.cli import main
from moe.train.data import ByteTokenizer, load_corpus
from moe.train.shards import ShardWriter, TokenStream

from .run import TINY, corpus, moe

DOCS = [f"def f{i}(x):\n    return x * {i}  # é\n" * (1 + i % 5) for i in range(300)]


def _text_folder(tmp_path):
    folder = tmp_path / "text"
    folder.mkdir()
    for i, doc in enumerate(DOCS):
        (folder / f"doc{i:04d}.txt").write_text(doc)
    return folder


def _stream(c):
    return np.concatenate([c.train[np.arange(len(c.train))], c.val[np.arange(len(c.val))]])


def test_token_stream_reads_windows_across_shards(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 300, size=int(n)) for n in rng.integers(1, 40, size=50)]
    w = ShardWriter(tmp_path, vocab_size=300, eos_id=None, tokenizer="t", shard_tokens=64)
    for d in docs:
        w.add(d)
    index = w.close()
    assert len(index["shards"]) > 5 and all(s["tokens"] <= 64 or s["documents"] == 1 for s in index["shards"])
    whole = np.concatenate(docs)
    stream = TokenStream.open(tmp_path)
    assert len(stream) == len(whole)
    idx = rng.integers(0, len(whole) - 9, size=(7, 1)) + np.arange(9)
    assert np.array_equal(stream[idx], whole[idx])
    part = stream[100:-50]  # a view over shards, as the train/val split takes
    assert np.array_equal(part[np.arange(len(part))], whole[100:-50])


class _Recording(TokenStream):
    """A TokenStream that records the positions read through it."""

    def __init__(self, parts) -> None:
        super().__init__(parts)
        self.read: set[int] = set()

    def __getitem__(self, key):
        if not isinstance(key, slice):
            self.read.update(np.asarray(key).ravel().tolist())
        return super().__getitem__(key)


def test_a_data_parallel_rank_reads_only_its_rows(tmp_path):
    """Corpus.batch(rows=) of each of 4 ranks is its block of the global batch (train and held
    out), and reads only the positions of its own windows."""
    from moe.train.data import Corpus

    tokens = np.arange(5000) % 251
    train, val = _Recording([tokens[:4000]]), _Recording([tokens[4000:]])
    c = Corpus(train=train, val=val, source="test", num_files=1, fingerprint={})
    whole = c.batch(7, 3, 8, 16)
    (val_whole,) = c.val_batches(1, 8, 16)
    for d in range(4):
        rows = slice(2 * d, 2 * d + 2)
        train.read, val.read = set(), set()
        mine = c.batch(7, 3, 8, 16, rows)
        assert all(x.equal(y[rows]) for x, y in zip(mine, whole, strict=True))
        assert 0 < len(train.read) <= 2 * 17  # its 2 windows of S + 1 tokens, not the batch's 8
        (val_mine,) = c.val_batches(1, 8, 16, rows)
        assert all(x.equal(y[rows]) for x, y in zip(val_mine, val_whole, strict=True)) and len(val.read) == 2 * 17


def test_tokenized_shards_equal_the_text_and_are_memory_mapped(tmp_path, capsys):
    text = _text_folder(tmp_path)
    assert main(["data", "tokenize", "--in", str(text), "--out", str(tmp_path / "s2"), "--workers", "2",
                 "--shard-tokens", "4000"]) == 0  # fmt: skip
    assert "in 9 shard(s) (uint16)" in capsys.readouterr().out  # 33,840 tokens in shards of <= 4000
    assert main(["data", "tokenize", "--in", str(text), "--out", str(tmp_path / "s1"), "--workers", "1"]) == 0
    one, two = TokenStream.open(tmp_path / "s1"), TokenStream.open(tmp_path / "s2")
    assert np.array_equal(one[np.arange(len(one))], two[np.arange(len(two))])  # not the workers' doing
    tok = ByteTokenizer()
    from_text = load_corpus(str(text), tok, seq_len=16)
    from_shards = load_corpus(str(tmp_path / "s2"), tok, seq_len=16)
    assert isinstance(from_shards.train, TokenStream) and isinstance(from_shards.train._parts[0], np.memmap)
    assert np.array_equal(_stream(from_text), _stream(from_shards))
    for step in range(3):
        a, b = from_text.batch(step, 0, 4, 16), from_shards.batch(step, 0, 4, 16)
        assert all(x.equal(y) for x, y in zip(a, b, strict=True))
    # the command refuses a folder that exists, and shards of another vocabulary
    assert main(["data", "tokenize", "--in", str(text), "--out", str(tmp_path / "s1")]) == 2
    assert "exists: choose a new folder" in capsys.readouterr().err
    index = json.loads((tmp_path / "s1" / "index.json").read_text())
    (tmp_path / "s1" / "index.json").write_text(json.dumps({**index, "vocab_size": 300}))
    with pytest.raises(ValueError, match="tokenized by bytes \\(300 tokens\\), the run's tokenizer has 260"):
        load_corpus(str(tmp_path / "s1"), tok, seq_len=16)
    shard = tmp_path / "s2" / "tokens_00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])  # one token short
    with pytest.raises(ValueError, match="shard tokens_00001.bin should hold"):
        load_corpus(str(tmp_path / "s2"), tok, seq_len=16)


def test_jsonl_parquet_and_datasets_give_the_texts_tokens(tmp_path):
    datasets = pytest.importorskip("datasets")  # the data extra; installed with the test extras
    tok = ByteTokenizer()
    expect = _stream(load_corpus(str(_text_folder(tmp_path)), tok, seq_len=16))
    rows = [{"id": i, "body": doc} for i, doc in enumerate(DOCS)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "a.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    for path in ("a.jsonl", "a.parquet", "saved"):
        got = load_corpus(str(tmp_path / path), tok, seq_len=16, text_key="body")
        assert np.array_equal(_stream(got), expect), path
    with pytest.raises(ValueError, match="line 1 has no string field 'text'"):
        load_corpus(str(tmp_path / "a.jsonl"), tok, seq_len=16)
    with pytest.raises(ValueError, match="no column 'text'"):
        load_corpus(str(tmp_path / "a.parquet"), tok, seq_len=16)


def test_train_on_shards_through_the_command(tmp_path):
    shards = tmp_path / "shards"
    moe("data", "tokenize", "--in", corpus(tmp_path), "--out", shards, "--workers", 1)
    run = tmp_path / "run"
    moe("train", *TINY, "--data", shards, "--steps", 1, "--eval-batches", 1, "--out", run)
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["data"]["source"] == str(shards.resolve()) and cfg["data"]["train_tokens"] > 0


def _first_loss(run):
    return next(r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r)


def test_doc_mask_changes_what_is_trained_and_needs_an_end_of_text_token(tmp_path):
    """--doc-mask on shards of short documents (their index keeps the end-of-text id): the
    first step's loss is not the causal one and config.json says so; a tokenizer without an
    end-of-text token cannot separate documents and exits 2 before training."""
    tokenizers = pytest.importorskip("tokenizers")
    short = tmp_path / "short.jsonl"  # documents of 10-20 bytes: every window holds several
    short.write_text("".join(json.dumps({"text": f"y = x * {i}  # {i % 7}"}) + "\n" for i in range(3000)))
    shards = tmp_path / "shards"
    moe("data", "tokenize", "--in", short, "--out", shards, "--workers", 1)
    losses = {}
    for extra in ([], ["--doc-mask"]):
        run = tmp_path / ("masked" if extra else "causal")
        moe("train", *TINY, "--data", shards, "--steps", 1, "--eval-batches", 1, "--out", run, *extra)
        losses[bool(extra)] = _first_loss(run)
        assert json.loads((run / "config.json").read_text())["train"]["doc_mask"] is bool(extra)
    assert losses[True] != pytest.approx(losses[False], rel=1e-4)

    words = {w: i for i, w in enumerate(["<unk>", "def", "return", "x", "*"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    proc = moe("train", *TINY, "--data", _text_folder(tmp_path), "--tokenizer", tmp_path / "tokenizer.json",
               "--doc-mask", "--out", tmp_path / "none", check=False)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "--doc-mask: the documents of --data" in proc.stderr and "has no end-of-text token" in proc.stderr
    assert "Traceback" not in proc.stderr
