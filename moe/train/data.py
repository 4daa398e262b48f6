"""Training data: a token stream, its fixed held-out split, and batches drawn from the seed.

Legend: B global batch (sequences), S sequence length, N tokens in a split.

The corpus has a fingerprint (`moe.train.fingerprint`), taken from the bytes as they are read
for tokenizing; a resumed run compares it with the one in ``config.json``, so data changed in
place, or another folder found under the same relative path, is noticed instead of trained on
silently.

Only regular files are read: a FIFO, socket or device in a data folder would block the read or
never end, and is skipped with a warning counting them.

The default corpus needs no download: the source files of the running Python's standard library
(sorted, so every machine with the same Python reads the same bytes), byte-level. ``--data``
takes text files, ``.jsonl``, ``.parquet`` and ``datasets`` inputs or folders of them
(`moe.train.sources`), tokenized at start, or a shard folder written by ``moe data tokenize``
(`moe.train.shards`), memory-mapped; ``--tokenizer`` a local ``tokenizer.json``.

Batches are a function of (seed, step) only: step s draws its B window starts from a generator
seeded with (seed, s). The data position in a checkpoint is therefore just the step, a resumed
run reads exactly what the uninterrupted one would, and every layout sees the same global batch
(a data-parallel rank reads only its contiguous slice of it).
"""

from __future__ import annotations

import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .fingerprint import entries_of, entry, shard_fingerprint
from .shards import TokenStream, is_shard_folder, read_index
from .sources import RECORD_SUFFIXES, documents, input_files

__all__ = ["ByteTokenizer", "Corpus", "HFTokenizer", "corpus_files", "load_corpus", "load_tokenizer", "stdlib_files"]

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".json", ".csv", ".html", ".c", ".h", ".js", ".tex", ""}


class ByteTokenizer:
    """Bytes 0-255 are tokens 0-255; then four specials (``vocab_size`` 260)."""

    specials = ("<bos>", "<eos>", "<pad>", "<unk>")
    bos_id, eos_id, pad_id, unk_id = 256, 257, 258, 259
    vocab_size = 260
    name = "bytes"

    def encode(self, text: str | bytes) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return list(data)

    def decode(self, ids) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local ``tokenizer.json`` read by the ``tokenizers`` package (optional dependency)."""

    def __init__(self, path: str | os.PathLike) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as err:
            raise ImportError("--tokenizer needs the tokenizers package: pip install tokenizers") from err
        self.name = str(path)
        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        ends = [self._tok.token_to_id(t) for t in ("</s>", "<|endoftext|>", "<eos>", "[SEP]")]
        self.eos_id = next((i for i in ends if i is not None), None)  # joins documents when known

    def encode(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text).ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))


def load_tokenizer(path: str | None):
    return ByteTokenizer() if path is None else HFTokenizer(path)


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files (installed packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        out += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return sorted(out)


def corpus_files(data: str | None) -> tuple[list[Path], Path]:
    """The inputs of ``--data`` (None: the standard library) in reading order, and the folder
    their fingerprint names them relative to. Files that are not regular (FIFOs, sockets,
    devices) are skipped with a warning counting them."""
    if data is None:
        return stdlib_files(), Path(sysconfig.get_paths()["stdlib"])
    special: list[Path] = []
    files = input_files(data, _TEXT_SUFFIXES, special)
    if special and os.environ.get("RANK", "0") == "0":  # said once per job
        print(f"moe train: warning: --data {data}: skipped {len(special)} files that are not regular files "
              "(FIFOs, sockets, devices)", file=sys.stderr)  # fmt: skip
    return files, Path(data) if Path(data).is_dir() else Path(data).parent


def _is_text(raw: bytes) -> bool:
    """Text unless its first 64 KiB hold a NUL byte, which text in any 8-bit encoding never
    has and images, archives and executables almost always do (text that is not UTF-8 is still
    text: 4 standard-library modules are Latin-1)."""
    return b"\x00" not in raw[: 1 << 16]


@dataclass
class Corpus:
    """Token ids of the training and held-out splits: int32 numpy arrays, or `TokenStream`s
    memory-mapped from a shard folder (both take ``len`` and an index array)."""

    train: np.ndarray  # (N_train,)
    val: np.ndarray  # (N_val,)
    source: str  # where the text came from, for config.json
    num_files: int
    fingerprint: dict  # {relative path: "size sha1-prefix"}: see `moe.train.fingerprint`
    eos_id: int | None = None  # the end-of-text token after each document, when there is one

    def batch(self, step: int, seed: int, batch: int, seq_len: int, rows: slice = slice(None)) -> tuple[Tensor, Tensor]:
        """The global batch of ``step``: inputs and next-token targets, both (B, S) int64, or only
        its ``rows`` (a data-parallel rank's: the B window starts are drawn, only those windows
        are read)."""
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.train) - seq_len - 1, (batch,), generator=gen).numpy()
        return _windows(self.train, starts[rows], seq_len)

    def val_batches(self, num: int, batch: int, seq_len: int, rows: slice = slice(None)):
        """``num`` fixed held-out batches (evenly spaced windows, the same every evaluation), or
        their ``rows``."""
        n = len(self.val) - seq_len - 1
        starts = np.linspace(0, n, num * batch).astype(np.int64)
        for i in range(num):
            yield _windows(self.val, starts[i * batch : (i + 1) * batch][rows], seq_len)


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[Tensor, Tensor]:
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    w = torch.from_numpy(tokens[idx].astype(np.int64))
    return w[:, :-1], w[:, 1:]


RAW_LIMIT = 1 << 30  # bytes of raw input tokenized in memory at start; more: pre-tokenize to shards


def load_corpus(data: str | None, tokenizer, *, seq_len: int, val_fraction: float = 0.01,
                text_key: str = "text") -> Corpus:  # fmt: skip
    """The corpus's token stream, with its last ``val_fraction`` (at least a few sequences) held
    out as the fixed validation split. A shard folder (``moe data tokenize``) is memory-mapped;
    text, ``.jsonl``, ``.parquet`` and ``datasets`` inputs are tokenized at start (documents joined
    by the end-of-text token when there is one), up to `RAW_LIMIT` bytes."""
    prints: dict[str, str] = {}
    eos = getattr(tokenizer, "eos_id", None)
    if data is not None and is_shard_folder(data):
        index = read_index(data)
        tokens, num_files, eos = _shard_tokens(data, tokenizer), len(index["shards"]), index.get("eos_id")
        prints = shard_fingerprint(data)
    else:
        files, root = corpus_files(data)
        if not files:
            raise ValueError(f"--data {data}: no text files found")
        tokens, num_files = _tokenize(files, root, data, tokenizer, text_key, prints), len(files)
    n_val = max(int(len(tokens) * val_fraction), 8 * (seq_len + 1))
    if len(tokens) - n_val < 4 * (seq_len + 1):
        raise ValueError(
            f"--data {data or 'stdlib'}: {len(tokens)} tokens are too few for --seq-len {seq_len} "
            f"(need at least {n_val + 4 * (seq_len + 1)})"
        )
    source = "python-stdlib:" + sysconfig.get_paths()["stdlib"] if data is None else str(Path(data).resolve())
    return Corpus(train=tokens[:-n_val], val=tokens[-n_val:], source=source, num_files=num_files, fingerprint=prints,
                  eos_id=eos)  # fmt: skip


def _shard_tokens(folder: str, tokenizer) -> TokenStream:
    index = read_index(folder)
    if index["vocab_size"] != tokenizer.vocab_size:
        raise ValueError(
            f"--data {folder}: the shards were tokenized by {index['tokenizer']} ({index['vocab_size']} tokens), "
            f"the run's tokenizer has {tokenizer.vocab_size}: pass that --tokenizer"
        )
    return TokenStream.open(folder)


def _tokenize(files: list[Path], root: Path, data: str | None, tokenizer, text_key: str, prints: dict) -> np.ndarray:
    """The token stream of ``files``; fills ``prints`` with their fingerprint as they are read."""
    size = sum(p.stat().st_size for f in files for p in ([f] if not f.is_dir() else f.rglob("*")) if p.is_file())
    if size > RAW_LIMIT:
        raise ValueError(
            f"--data {data}: {size / 1e9:.1f} GB of raw input would be tokenized in memory: tokenize it once "
            f"with moe data tokenize --in {data} --out SHARDS and pass the shard folder"
        )
    eos = getattr(tokenizer, "eos_id", None)
    tail = [np.asarray([eos], dtype=np.int32)] if eos is not None else []
    ids: list[np.ndarray] = []
    binary: list[Path] = []
    missing: list[Path] = []
    for f in files:
        if f.suffix.lower() in RECORD_SUFFIXES or f.is_dir():  # documents of a record file or dataset
            prints.update(entries_of(f, root))
            for doc in documents(f, text_key):
                ids += [np.asarray(tokenizer.encode(doc), dtype=np.int32), *tail]
            continue
        try:
            raw = f.read_bytes()
        except FileNotFoundError:  # a broken link, or a file removed since the folder was listed
            missing.append(f)
            continue
        prints[f.relative_to(root).as_posix()] = entry(raw)
        if not _is_text(raw):  # an image or archive among the text: not something to train on
            binary.append(f)
            continue
        if isinstance(tokenizer, ByteTokenizer):
            ids.append(np.frombuffer(raw, dtype=np.uint8).astype(np.int32))
        else:
            ids.append(np.asarray(tokenizer.encode(raw), dtype=np.int32))
        ids += tail
    if binary and data is not None and Path(data).is_file():
        raise ValueError(f"--data {data}: a binary file, not text (it has NUL bytes)")
    for what, skipped in (("binary file(s)", binary), ("missing file(s) or broken link(s)", missing)):
        if skipped and os.environ.get("RANK", "0") == "0":
            print(f"moe train: warning: skipped {len(skipped)} {what} in --data {data}, e.g. {skipped[0]}",
                  file=sys.stderr)  # fmt: skip
    if not ids:
        raise ValueError(f"--data {data}: no text found ({len(binary) + len(missing)} files skipped)")
    return np.concatenate(ids)
