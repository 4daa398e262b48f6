"""Where documents come from: text files, JSON lines, Parquet, and Hugging Face ``datasets``
folders and Arrow files, each read as a stream of documents (never whole into memory).

- a text file (any suffix `moe.train.data` reads as text): one document;
- ``.jsonl``: one document per line, its ``text_key`` field (a line without it is an error
  naming the file and line);
- ``.parquet``: the ``text_key`` column, read in row batches (``pyarrow``);
- ``.arrow``: a ``datasets`` Arrow file, memory-mapped (``datasets``);
- a folder written by ``datasets.Dataset.save_to_disk`` (it has ``dataset_info.json`` and
  ``state.json``): memory-mapped, every split of a ``DatasetDict``.

Parquet and Arrow need the ``data`` extra (``pip install 'moe[data]'``: pyarrow, datasets).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["RECORD_SUFFIXES", "documents", "input_files", "is_dataset_folder"]

RECORD_SUFFIXES = {".jsonl", ".parquet", ".arrow"}
_HINT = "pip install 'moe[data]'"


def is_dataset_folder(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file())


def input_files(path: str | os.PathLike, text_suffixes: set[str], special: list | None = None) -> list[Path]:
    """The inputs under ``path``, sorted: text files with one of ``text_suffixes``, record files
    (`RECORD_SUFFIXES`) and ``datasets`` folders (each one input); hidden folders are skipped,
    and so is anything that is not a regular file (a FIFO would block the reader), which is
    added to ``special``. A broken link is kept, for the reader to count."""
    p = Path(path)
    if p.is_file() or is_dataset_folder(p):
        return [p]
    out = []
    for dirpath, dirnames, filenames in os.walk(p):
        here = Path(dirpath)
        out += [here / d for d in dirnames if is_dataset_folder(here / d)]
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and not is_dataset_folder(here / d))
        for name in filenames:
            f = here / name
            if f.suffix.lower() not in text_suffixes | RECORD_SUFFIXES:
                continue
            if f.is_file() or not f.exists():
                out.append(f)
            elif special is not None:
                special.append(f)
    return sorted(out)


def documents(path: Path, text_key: str = "text") -> Iterator[str | bytes]:
    """The documents of one file (or one ``datasets`` folder), in order."""
    if is_dataset_folder(path):
        yield from _dataset_folder(path, text_key)
        return
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _jsonl(path, text_key)
    elif suffix == ".parquet":
        yield from _parquet(path, text_key)
    elif suffix == ".arrow":
        yield from _arrow(path, text_key)
    else:
        yield path.read_bytes()


def _jsonl(path: Path, key: str) -> Iterator[str]:
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise ValueError(f"--data {path}: line {n} is not JSON ({err})") from None
            if not isinstance(record, dict) or not isinstance(record.get(key), str):
                raise ValueError(f"--data {path}: line {n} has no string field {key!r} (--text-key)")
            yield record[key]


def _column(names, key: str, path: Path) -> None:
    if key not in names:
        raise ValueError(f"--data {path}: no column {key!r} (--text-key); it has {sorted(names)}")


def _parquet(path: Path, key: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError(f"--data {path}: Parquet needs pyarrow: {_HINT}") from err
    f = pq.ParquetFile(path)
    _column(f.schema_arrow.names, key, path)
    for batch in f.iter_batches(columns=[key], batch_size=1024):
        yield from (t for t in batch.column(0).to_pylist() if t is not None)


def _datasets():
    try:
        import datasets
    except ImportError as err:
        raise ImportError(f"Hugging Face datasets folders and Arrow files need datasets: {_HINT}") from err
    return datasets


def _rows(ds, key: str, path: Path) -> Iterator[str]:
    _column(ds.column_names, key, path)
    for batch in ds.iter(batch_size=1024):
        yield from (t for t in batch[key] if t is not None)


def _arrow(path: Path, key: str) -> Iterator[str]:
    yield from _rows(_datasets().Dataset.from_file(str(path)), key, path)


def _dataset_folder(path: Path, key: str) -> Iterator[str]:
    loaded = _datasets().load_from_disk(str(path))  # memory-mapped Arrow, nothing read whole
    splits = [loaded[name] for name in sorted(loaded)] if hasattr(loaded, "keys") else [loaded]
    for ds in splits:
        yield from _rows(ds, key, path)
