"""Which checkpoint of a run folder can be trusted, in the standard library only (the command's
argument checks use it before torch is imported).

Every checkpoint folder holds ``manifest.json``: the size and CRC-32 of each of its files (the
DCP files of every rank, ``.metadata``, each rank's RNG file, the run's ``config.json``), written
by rank 0 once every rank has finished writing and before the folder is renamed into place. A
checkpoint is used only if every file it lists is there with its size and checksum; otherwise
the newest one that is takes its place, and a one-line warning on stderr says what was passed
over and why. ``latest`` is a hint for people and older readers: a folder is only ever renamed
into place complete, so the newest verified folder is the newest complete checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import zlib
from pathlib import Path

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "DiskFullError",
    "checkpoint_folders",
    "choose_checkpoint",
    "disk_full_message",
    "file_entries",
    "point_latest",
    "read_run_config",
    "step_of",
    "verify",
    "warn",
    "write_manifest",
]

MANIFEST = "manifest.json"
PREFIX = "step_"
_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """No checkpoint (or config) of a run can be used, or one cannot be written: a one-line message."""


class DiskFullError(CheckpointError):
    """A write ran out of space: the message names the device, the path and the bytes short."""


_warned: set[str] = set()


def warn(message: str) -> None:
    """One line on stderr, once per process (several readers may find the same damage)."""
    if message not in _warned:
        _warned.add(message)
        print(f"warning: {message}", file=sys.stderr, flush=True)


def _crc(path: Path) -> str:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _write_durably(path: Path, text: str) -> None:
    """``text`` to ``path`` through a temporary file, synced, then renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def file_entries(paths) -> dict[str, dict]:
    """The manifest entries (size, CRC-32) of ``paths``."""
    return {p.name: {"bytes": p.stat().st_size, "crc32": _crc(p)} for p in paths}


def write_manifest(folder: Path, known: dict[str, dict] | None = None) -> None:
    """Record the size and checksum of every file in ``folder`` (all ranks have written theirs);
    ``known``: entries the ranks computed for their own files (checksummed in parallel)."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST and not p.name.endswith(".tmp"))
    if not any(p.name == ".metadata" for p in files):
        raise CheckpointError(f"{folder}: DCP wrote no .metadata")
    known = known or {}
    entries = {**file_entries(p for p in files if p.name not in known), **known}
    _write_durably(folder / MANIFEST, json.dumps({"files": dict(sorted(entries.items()))}, indent=1) + "\n")


def verify(folder: Path) -> str | None:
    """Why ``folder`` is not a complete, intact checkpoint, or None when it is."""
    if not folder.is_dir():
        return "the folder is gone"
    try:
        entries = json.loads((folder / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"no {MANIFEST} (not written completely, or by a version without checksums)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{MANIFEST} is damaged ({type(err).__name__})"
    if ".metadata" not in entries:
        return f"{MANIFEST} lists no .metadata"
    for name, entry in sorted(entries.items()):
        path = folder / name
        try:
            size = path.stat().st_size
            if size != entry["bytes"]:
                return f"{name} has {size} bytes, {MANIFEST} says {entry['bytes']}"
            if _crc(path) != entry["crc32"]:
                return f"{name} does not match its checksum in {MANIFEST}"
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as err:
            return f"{name} cannot be read ({err.strerror})"
    return None


def step_of(path: Path) -> int:
    """The step of a checkpoint folder (-1 for another name)."""
    try:
        return int(path.name[len(PREFIX) :])
    except ValueError:
        return -1


def checkpoint_folders(run_dir) -> list[Path]:
    """The run's checkpoint folders (renamed into place, so once complete), newest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.glob(f"{PREFIX}*") if step_of(p) >= 0 and p.is_dir()]
    return sorted(found, key=step_of, reverse=True)


def _latest_note(run_dir: Path, chosen: Path) -> str | None:
    """What is wrong with ``latest`` when it does not name ``chosen`` (None when it does)."""
    pointer = run_dir / "checkpoints" / "latest"
    try:
        name = pointer.read_text().strip()
    except FileNotFoundError:
        return "checkpoints/latest is missing"
    except OSError as err:
        return f"checkpoints/latest cannot be read ({err.strerror})"
    if not name:
        return "checkpoints/latest is empty"
    if name == chosen.name:
        return None
    if not (pointer.parent / name).is_dir():
        return f"checkpoints/latest names {name}, which does not exist"
    return None  # an older complete one: the pointer lagged behind (a run killed after the rename)


def choose_checkpoint(run_dir, passed: dict[str, str] | None = None) -> tuple[Path, list[str]]:
    """The newest checkpoint that verifies, and one note per thing passed over on the way (a
    checkpoint in ``passed``, name -> reason, is passed over for that reason). Raises
    `CheckpointError` when none is left."""
    run_dir = Path(run_dir)
    passed = dict(passed or {})
    notes = []
    for folder in checkpoint_folders(run_dir):
        reason = passed.get(folder.name) or verify(folder)
        if reason is None:
            note = _latest_note(run_dir, folder)
            return folder, notes + ([note] if note else [])
        passed[folder.name] = reason
        notes.append(f"checkpoint {folder.name} skipped: {reason}")
    if not passed:
        raise CheckpointError(f"{run_dir} has no checkpoint yet")
    why = "; ".join(f"{name}: {reason}" for name, reason in sorted(passed.items(), reverse=True))
    raise CheckpointError(f"{run_dir} has no usable checkpoint ({why})")


def point_latest(root: Path, name: str) -> None:
    _write_durably(root / "latest", name + "\n")


def read_run_config(run_dir) -> dict:
    """``config.json`` of a run; when it is damaged, the copy in its newest verified checkpoint
    (with a warning). Raises `CheckpointError` when neither can be read."""
    path = Path(run_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{run_dir} is not a run folder (no config.json)") from None
    except (OSError, ValueError) as err:
        damage = f"{path} is damaged ({type(err).__name__}: {err})"
    for folder in checkpoint_folders(run_dir):
        if verify(folder) is None and (folder / "config.json").is_file():
            warn(f"{damage}; using the copy in {folder}")
            return json.loads((folder / "config.json").read_text())
    raise CheckpointError(f"{damage}, and no verified checkpoint holds a copy")


def _mount(path: Path) -> tuple[str, str]:
    """(device, mount point) of the filesystem holding ``path``."""
    mount = path.resolve()
    while not mount.exists() or not os.path.ismount(mount):
        mount = mount.parent
    device = "?"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 1 and fields[1] == str(mount):
                device = fields[0]  # the last entry for a mount point is the one in effect
    except OSError:
        pass
    return device, str(mount)


def disk_full_message(path, needed: int | None = None) -> str:
    """``no space left on DEVICE (mounted at M) writing PATH, N bytes short (needed, free)``."""
    path = Path(path)
    device, mount = _mount(path)
    free = shutil.disk_usage(mount).free
    where = f"no space left on {device} (mounted at {mount}) writing {path}"
    if needed is None:
        return f"{where} ({free} bytes free)"
    return f"{where}, {max(needed - free, 0)} bytes short ({needed} needed, {free} free)"
