"""One job per run folder: an exclusive ``flock`` on ``<run>/.lock``.

Two jobs writing one run folder interleave ``metrics.jsonl`` and overwrite each other's
checkpoints, so ``moe train`` holds the lock for as long as it runs: one process takes it
itself; the ``--nproc`` launcher takes it for its ranks and tells them so through `HELD_ENV`;
under a plain ``torchrun`` rank 0 takes it and tells the other ranks (`distributed.setup`). The
kernel releases a ``flock`` when its holder dies, so a crashed job never leaves a stale lock;
the file stays, holding the last holder's pid, host, start time and command for the message.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import sys
from pathlib import Path

__all__ = ["HELD_ENV", "LOCK_NAME", "RunFolderError", "acquire", "check_fresh", "release"]

LOCK_NAME = ".lock"
HELD_ENV = "MOE_RUN_LOCK_HELD"  # set by the --nproc launcher for its ranks: the job holds the lock
_held: list[int] = []  # open lock files of this process, kept open until it exits


class RunFolderError(Exception):
    """The run folder cannot be used by this job (a one-line message: why, and what to do)."""


def check_fresh(run_dir: Path) -> None:
    """A new run needs an empty (or missing) folder; the lock file of an ended job does not count."""
    if run_dir.exists() and any(p.name != LOCK_NAME for p in run_dir.iterdir()):
        raise RunFolderError(f"--out {run_dir} exists: pass --resume to continue it, or choose another folder")


def acquire(run_dir: Path, fresh: bool) -> None:
    """Take the lock of ``run_dir`` (created if missing) for the rest of this process's life,
    or raise `RunFolderError` naming the job that holds it. ``fresh`` (a new run): the folder
    is checked to be empty again under the lock, as another new run may have started in it
    between this one's argument check and now."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _describe(os.pread(fd, 65536, 0))
        os.close(fd)
        raise RunFolderError(
            f"--out {run_dir} is in use by another moe train ({holder}): "
            "wait for it to end or stop it, or choose another --out"
        ) from None
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["moe", *sys.argv[1:]]),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    _held.append(fd)
    if fresh:
        check_fresh(run_dir)


def release() -> None:
    """Release the locks this process holds (the command does when it returns: `moe.cli.main`
    may be called again in the same process)."""
    while _held:
        os.close(_held.pop())


def _describe(raw: bytes) -> str:
    try:
        info = json.loads(raw)
        return f"pid {info['pid']} on {info['host']}, started {info['started']}: {info['command']}"
    except (ValueError, KeyError, TypeError):  # the holder has not written it yet
        return "holder not yet recorded"
