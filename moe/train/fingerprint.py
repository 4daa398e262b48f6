"""A corpus's fingerprint, kept in a run's ``config.json`` and compared on ``--resume``.

``{path relative to --data (or to the standard library): "size sha1-prefix"}``, one entry per
file, taken from the bytes as they are read for tokenizing (hashing costs less than
tokenizing). A ``datasets`` folder has an entry per file in it. A shard folder (``moe data
tokenize``) is memory-mapped, never read whole, so its entry for ``index.json`` is hashed and
each shard has its size alone: the index holds every shard's token count, and a changed
tokenizer or corpus rewrites it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

__all__ = [
    "check_resume_data", "data_changes", "entries_of", "entry", "fingerprint", "fingerprint_diff", "shard_fingerprint",
]  # fmt: skip


def entry(raw: bytes) -> str:
    return f"{len(raw)} {hashlib.sha1(raw).hexdigest()[:16]}"


def entries_of(path: Path, root: Path) -> dict[str, str]:
    """The entries of one input: a file, or each file of a ``datasets`` folder."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return {f.relative_to(root).as_posix(): entry(f.read_bytes()) for f in files}


def shard_fingerprint(folder) -> dict[str, str]:
    folder = Path(folder)
    out = {"index.json": entry((folder / "index.json").read_bytes())}
    for shard in json.loads((folder / "index.json").read_text())["shards"]:
        out[shard["file"]] = str((folder / shard["file"]).stat().st_size)
    return out


def fingerprint(data: str | None) -> dict[str, str]:
    """The corpus's fingerprint, reading its files without tokenizing them."""
    from .data import corpus_files
    from .shards import is_shard_folder

    if data is not None and is_shard_folder(data):
        return shard_fingerprint(data)
    files, root = corpus_files(data)
    out: dict[str, str] = {}
    for f in files:
        if f.is_dir() or f.is_file():  # a broken link is not part of the corpus
            out.update(entries_of(f, root))
    return out


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
    from .manifest import read_run_config

    saved = read_run_config(run_dir).get("data", {}).get("fingerprint")  # (a damaged one: its checkpoint copy)
    diff = None if saved is None else fingerprint_diff(saved, fingerprint(data))
    if diff is not None and not changed_ok:
        raise ValueError(
            f"--resume: the data differ from the run's: {diff} in {data or 'the stdlib corpus'}; "
            "restore them, or pass --data-changed-ok to train on them"
        )


def data_changes(saved: dict, corpus, step: int, argv: list[str]) -> list[dict]:
    """``config.json``'s list of resumes that read other data than before, with this one added
    when its corpus differs from the saved fingerprint (``saved``: the old config.json)."""
    changes = list(saved.get("data_changes", []))
    diff = fingerprint_diff(saved.get("data", {}).get("fingerprint", corpus.fingerprint), corpus.fingerprint)
    if diff is not None:
        changes.append({"step": step, "differs": diff, "command": argv})
    return changes
