"""Run the real ``moe`` command in a subprocess (the worktree's package, one thread so a loaded
machine does not slow the tiny models down by thread contention)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--preset", "tiny", "--batch", "4", "--seq-len", "32", "--warmup", "2"]


def env(drop: tuple[str, ...] = ()) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in drop}
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e["OMP_NUM_THREADS"] = "1"
    return e


def moe(*args, check: bool = True, timeout: float = 300, cwd=None, drop_env=()) -> subprocess.CompletedProcess:
    """``python -m moe ARGS`` (without the variables ``drop_env``); with ``check`` a non-zero
    exit fails with the command's output."""
    proc = subprocess.run(
        [sys.executable, "-m", "moe", *map(str, args)],
        capture_output=True,
        text=True,
        env=env(drop_env),
        timeout=timeout,
        cwd=cwd or ROOT,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"moe {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def popen(*args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "moe", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
        cwd=ROOT,
    )


def corpus(tmp_path: Path) -> Path:
    """A small text corpus (a few standard-library modules) so tests read little."""
    import json as _json
    import shutil as _shutil

    data = tmp_path / "data"
    data.mkdir()
    for mod in (_json, _shutil):
        (data / Path(mod.__file__).name).write_bytes(Path(mod.__file__).read_bytes())
    return data
