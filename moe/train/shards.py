"""Pre-tokenized corpora: the token shard format that ``moe data tokenize`` writes and
``moe train --data FOLDER`` memory-maps, so a corpus of any size is never read into memory.

Legend: N tokens of a stream, B windows, S window length.

A shard folder::

    index.json         {"format": "moe-tokens", "version": 1, "dtype": "uint16" | "uint32",
                        "vocab_size": V, "eos_id": id or null, "tokenizer": "...",
                        "shards": [{"file": "tokens_00000.bin", "tokens": N0, "documents": D0}, ...]}
    tokens_00000.bin   the token ids of whole documents, each followed by eos_id when the
    tokens_00001.bin   tokenizer has one, as raw little-endian integers of ``dtype``
    ...

uint16 when every id fits (V <= 65536), else uint32. The stream is the shards in index order;
`TokenStream` reads windows of it across shard boundaries through ``numpy.memmap``, so only the
pages of the windows a step draws are read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

__all__ = ["FORMAT", "ShardWriter", "TokenStream", "is_shard_folder", "read_index"]

FORMAT, VERSION, INDEX = "moe-tokens", 1, "index.json"


def is_shard_folder(path: str | os.PathLike) -> bool:
    return (Path(path) / INDEX).is_file()


def read_index(folder: str | os.PathLike) -> dict:
    """The folder's index.json, checked: the format, and every shard's file and size."""
    folder = Path(folder)
    try:
        index = json.loads((folder / INDEX).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"--data {folder}: {INDEX} is unreadable ({err})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != VERSION:
        raise ValueError(f"--data {folder}: {INDEX} is not a {FORMAT} v{VERSION} index (moe data tokenize writes one)")
    if index.get("dtype") not in ("uint16", "uint32"):
        raise ValueError(f"--data {folder}: {INDEX} dtype must be uint16 or uint32, got {index.get('dtype')!r}")
    width = np.dtype(index["dtype"]).itemsize
    for shard in index["shards"]:
        path = folder / shard["file"]
        size = path.stat().st_size if path.is_file() else None
        if size != shard["tokens"] * width:
            got = "missing" if size is None else f"{size} bytes"
            raise ValueError(
                f"--data {folder}: shard {shard['file']} should hold {shard['tokens']} tokens "
                f"({shard['tokens'] * width} bytes), it is {got}"
            )
    return index


class TokenStream:
    """A read-only stream of token ids over memory-mapped shards: ``len(stream)``, a slice
    ``stream[a:b]`` (another stream, no copy), and ``stream[idx]`` for an integer array of
    positions (the gathered ids, int64, of idx's shape)."""

    def __init__(self, parts: list[np.ndarray]) -> None:
        self._parts = [p for p in parts if len(p)]
        sizes = np.array([len(p) for p in self._parts], dtype=np.int64)
        self._ends = np.cumsum(sizes)  # stream position where each part ends

    @classmethod
    def open(cls, folder: str | os.PathLike) -> TokenStream:
        folder = Path(folder)
        index = read_index(folder)
        dtype = np.dtype(index["dtype"]).newbyteorder("<")
        return cls([np.memmap(folder / s["file"], dtype=dtype, mode="r") for s in index["shards"] if s["tokens"]])

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise ValueError("a TokenStream slice must be contiguous")
            return TokenStream(self._pieces(start, stop))
        idx = np.asarray(key, dtype=np.int64)
        out = np.empty(idx.shape, dtype=np.int64)
        part = np.searchsorted(self._ends, idx, side="right")  # the part holding each position
        begins = self._ends - np.array([len(p) for p in self._parts], dtype=np.int64)
        for i in np.unique(part):
            sel = part == i
            out[sel] = self._parts[i][idx[sel] - begins[i]]
        return out

    def _pieces(self, start: int, stop: int) -> list[np.ndarray]:
        pieces, begin = [], 0
        for part, end in zip(self._parts, self._ends, strict=True):
            lo, hi = max(start, begin), min(stop, int(end))
            if lo < hi:
                pieces.append(part[lo - begin : hi - begin])
            begin = int(end)
        return pieces


class ShardWriter:
    """Appends documents' token ids to ``tokens_*.bin`` files of at most ``shard_tokens``
    tokens (a document is never split: a shard holds whole documents, unless one document
    alone is longer), then writes index.json last, so a folder with an index is complete."""

    def __init__(self, folder, *, vocab_size: int, eos_id: int | None, tokenizer: str, shard_tokens: int) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.dtype = np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")
        self.meta = {"vocab_size": vocab_size, "eos_id": eos_id, "tokenizer": tokenizer}
        self.shard_tokens = shard_tokens
        self.shards: list[dict] = []
        self._file = None

    def add(self, ids) -> None:
        """One document's ids (the end-of-text token already appended)."""
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.meta["vocab_size"]):
            raise ValueError(f"token ids must be in [0, {self.meta['vocab_size']}), got [{ids.min()}, {ids.max()}]")
        current = self.shards[-1] if self.shards else None
        if current is None or (current["tokens"] and current["tokens"] + ids.size > self.shard_tokens):
            self._roll()
            current = self.shards[-1]
        self._file.write(ids.astype(self.dtype).tobytes())
        current["tokens"] += int(ids.size)
        current["documents"] += 1

    def _roll(self) -> None:
        if self._file is not None:
            self._file.close()
        name = f"tokens_{len(self.shards):05d}.bin"
        self._file = (self.folder / name).open("wb")
        self.shards.append({"file": name, "tokens": 0, "documents": 0})

    def close(self) -> dict:
        if self._file is not None:
            self._file.close()
        index = {"format": FORMAT, "version": VERSION, "dtype": self.dtype.name, **self.meta, "shards": self.shards}
        tmp = self.folder / (INDEX + ".tmp")
        tmp.write_text(json.dumps(index, indent=1) + "\n")
        os.replace(tmp, self.folder / INDEX)
        return index
