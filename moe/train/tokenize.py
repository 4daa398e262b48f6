"""``moe data tokenize``: documents in (text files, JSON lines, Parquet, ``datasets`` folders)
-> token shards out (`moe.train.shards`), tokenized by worker processes.

Documents are read in order by this process, tokenized in batches by ``workers`` processes
(each with its own copy of the tokenizer) and written in the same order, so the shards do not
depend on the number of workers. Each document is followed by the tokenizer's end-of-text
token when it has one, as ``moe train`` joins text documents.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from itertools import islice
from pathlib import Path

import numpy as np

from .data import _TEXT_SUFFIXES, load_tokenizer
from .shards import ShardWriter
from .sources import documents, input_files

__all__ = ["tokenize_corpus"]

_BATCH = 256  # documents per task: large enough to amortise the pickling, small enough to balance

_tokenizer = None


def _init(path: str | None) -> None:
    global _tokenizer
    _tokenizer = load_tokenizer(path)


def _encode(batch: list[str | bytes]) -> list[np.ndarray]:
    eos = getattr(_tokenizer, "eos_id", None)
    tail = [eos] if eos is not None else []
    return [np.asarray(_tokenizer.encode(doc) + tail, dtype=np.int64) for doc in batch]


def _batches(files: list[Path], text_key: str):
    for f in files:
        docs = documents(f, text_key)
        while batch := list(islice(docs, _BATCH)):
            yield batch


def tokenize_corpus(
    inputs: str, out: str, *, tokenizer: str | None, text_key: str = "text", workers: int = 1,
    shard_tokens: int = 1 << 28, progress: bool = True,
) -> dict:  # fmt: skip
    """Tokenize every document under ``inputs`` into shards in ``out``; returns the index."""
    files = input_files(inputs, _TEXT_SUFFIXES)
    if not files:
        raise ValueError(f"--in {inputs}: no text, .jsonl, .parquet, .arrow or datasets input found")
    tok = load_tokenizer(tokenizer)
    writer = ShardWriter(out, vocab_size=tok.vocab_size, eos_id=getattr(tok, "eos_id", None), tokenizer=tok.name,
                         shard_tokens=shard_tokens)  # fmt: skip
    from tqdm.auto import tqdm

    bar = tqdm(desc="tokenize", unit="doc", file=sys.stderr, disable=not progress)
    if workers > 1:
        pool = mp.get_context("spawn").Pool(workers, initializer=_init, initargs=(tokenizer,))
        results = pool.imap(_encode, _batches(files, text_key))  # in order
    else:
        pool = None
        _init(tokenizer)
        results = map(_encode, _batches(files, text_key))
    try:
        for encoded in results:
            for ids in encoded:
                writer.add(ids)
            bar.update(len(encoded))
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    index = writer.close()
    if not any(s["tokens"] for s in index["shards"]):
        raise ValueError(f"--in {inputs}: the inputs hold no tokens")
    return index
