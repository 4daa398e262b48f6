"""Training data: a token stream, its fixed held-out split, and batches drawn from the seed.

Legend: B global batch (sequences), S sequence length, N tokens in a split.

The corpus has a fingerprint: each file's path (relative to ``--data``, or to the standard
library), size and SHA-1, taken from the bytes as they are read for tokenizing (hashing costs
less than tokenizing). A resumed run compares it with the one in ``config.json``
(`fingerprint_diff`), so data changed in place, or another folder found under the same
relative path, is noticed instead of trained on silently.

Only regular files are read: a FIFO, socket or device in a data folder would block the read or
never end, and is skipped with a warning counting them.

The default corpus needs no download: the source files of the running Python's standard library
(sorted, so every machine with the same Python reads the same bytes), byte-level. ``--data``
takes text files or folders of them; ``--tokenizer`` a local ``tokenizer.json``.

Batches are a function of (seed, step) only: step s draws its B window starts from a generator
seeded with (seed, s). The data position in a checkpoint is therefore just the step, a resumed
run reads exactly what the uninterrupted one would, and every layout sees the same global batch
(a data-parallel rank takes its contiguous slice of it).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "ByteTokenizer", "Corpus", "HFTokenizer", "check_resume_data", "corpus_files", "data_changes", "fingerprint",
    "fingerprint_diff", "load_corpus", "load_tokenizer", "stdlib_files",
]  # fmt: skip

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


def _data_files(path: str) -> list[Path]:
    p = Path(path)
    if p.is_file():
        return [p]
    files, special = [], 0
    for dirpath, dirnames, filenames in os.walk(p):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        named = [Path(dirpath) / f for f in filenames if Path(f).suffix.lower() in _TEXT_SUFFIXES]
        regular = [f for f in named if f.is_file()]  # follows links; False for FIFOs, sockets, devices
        files += regular
        special += len(named) - len(regular)
    if special and os.environ.get("RANK", "0") == "0":  # said once per job
        print(f"moe train: warning: --data {path}: skipped {special} files that are not regular files "
              "(FIFOs, sockets, devices)", file=sys.stderr)  # fmt: skip
    return sorted(files)


def corpus_files(data: str | None) -> tuple[list[Path], Path]:
    """The files of ``--data`` (None: the standard library) in reading order, and the folder
    their fingerprint names them relative to."""
    if data is None:
        return stdlib_files(), Path(sysconfig.get_paths()["stdlib"])
    return _data_files(data), Path(data) if Path(data).is_dir() else Path(data).parent


def _entry(raw: bytes) -> str:
    return f"{len(raw)} {hashlib.sha1(raw).hexdigest()[:16]}"


def fingerprint(data: str | None) -> dict[str, str]:
    """``{relative path: "size sha1-prefix"}`` of the corpus, reading without tokenizing."""
    files, root = corpus_files(data)
    return {f.relative_to(root).as_posix(): _entry(f.read_bytes()) for f in files}


def fingerprint_diff(old: dict[str, str], new: dict[str, str]) -> str | None:
    """What differs between two fingerprints, in a few words (None: the same files and bytes)."""
    changed = sorted(k for k in old.keys() & new.keys() if old[k] != new[k])
    parts = []
    for what, names in (("changed", changed), ("missing", sorted(old.keys() - new.keys())),
                        ("new", sorted(new.keys() - old.keys()))):  # fmt: skip
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            parts.append(f"{len(names)} {what} ({', '.join(names[:3])}{more})")
    return "; ".join(parts) or None


def check_resume_data(run_dir: Path, data: str | None, changed_ok: bool) -> None:
    """``--resume`` reads the corpus the run was trained on (the fingerprint in its config.json)
    unless ``changed_ok``; a run written before fingerprints is not checked. Raises ValueError
    (one line: what differs)."""
    saved = json.loads((run_dir / "config.json").read_text()).get("data", {}).get("fingerprint")
    diff = None if saved is None else fingerprint_diff(saved, fingerprint(data))
    if diff is not None and not changed_ok:
        raise ValueError(
            f"--resume: the data differ from the run's: {diff} in {data or 'the stdlib corpus'}; "
            "restore them, or pass --data-changed-ok to train on them"
        )


def data_changes(saved: dict, corpus: Corpus, step: int, argv: list[str]) -> list[dict]:
    """``config.json``'s list of resumes that read other data than before, with this one added
    when its corpus differs from the saved fingerprint (``saved``: the old config.json)."""
    changes = list(saved.get("data_changes", []))
    diff = fingerprint_diff(saved.get("data", {}).get("fingerprint", corpus.fingerprint), corpus.fingerprint)
    if diff is not None:
        changes.append({"step": step, "differs": diff, "command": argv})
    return changes


@dataclass
class Corpus:
    """Token ids of the training and held-out splits (int32 numpy arrays)."""

    train: np.ndarray  # (N_train,)
    val: np.ndarray  # (N_val,)
    source: str  # where the text came from, for config.json
    num_files: int
    fingerprint: dict  # {relative path: "size sha1-prefix"}: see `fingerprint`

    def batch(self, step: int, seed: int, batch: int, seq_len: int) -> tuple[Tensor, Tensor]:
        """The global batch of ``step``: inputs and next-token targets, both (B, S) int64."""
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.train) - seq_len - 1, (batch,), generator=gen).numpy()
        return _windows(self.train, starts, seq_len)

    def val_batches(self, num: int, batch: int, seq_len: int):
        """``num`` fixed held-out batches (evenly spaced windows, the same every evaluation)."""
        n = len(self.val) - seq_len - 1
        starts = np.linspace(0, n, num * batch).astype(np.int64)
        for i in range(num):
            yield _windows(self.val, starts[i * batch : (i + 1) * batch], seq_len)


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[Tensor, Tensor]:
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    w = torch.from_numpy(tokens[idx].astype(np.int64))
    return w[:, :-1], w[:, 1:]


def load_corpus(data: str | None, tokenizer, *, seq_len: int, val_fraction: float = 0.01) -> Corpus:
    """Read and tokenize the corpus (documents joined by the end-of-text token when there is one),
    then hold out its last ``val_fraction`` (at least a few sequences) as the fixed validation split."""
    files, root = corpus_files(data)
    if not files:
        raise ValueError(f"--data {data}: no text files found")
    eos = getattr(tokenizer, "eos_id", None)
    ids: list[np.ndarray] = []
    prints = {}
    for f in files:
        raw = f.read_bytes()
        prints[f.relative_to(root).as_posix()] = _entry(raw)
        if isinstance(tokenizer, ByteTokenizer):
            ids.append(np.frombuffer(raw, dtype=np.uint8).astype(np.int32))
        else:
            ids.append(np.asarray(tokenizer.encode(raw), dtype=np.int32))
        if eos is not None:
            ids.append(np.asarray([eos], dtype=np.int32))
    tokens = np.concatenate(ids)
    n_val = max(int(len(tokens) * val_fraction), 8 * (seq_len + 1))
    if len(tokens) - n_val < 4 * (seq_len + 1):
        raise ValueError(
            f"--data {data or 'stdlib'}: {len(tokens)} tokens are too few for --seq-len {seq_len} "
            f"(need at least {n_val + 4 * (seq_len + 1)})"
        )
    source = "python-stdlib:" + sysconfig.get_paths()["stdlib"] if data is None else str(Path(data).resolve())
    return Corpus(train=tokens[:-n_val], val=tokens[-n_val:], source=source, num_files=len(files), fingerprint=prints)
