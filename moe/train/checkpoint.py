"""Atomic checkpoints with torch.distributed.checkpoint (DCP), in one process or many.

Layout of ``<run>/checkpoints``::

    step_000100/      a finished checkpoint: DCP files (model, optimiser, schedule, step) + rng_rank<r>.pt
    .tmp-step_000200/ one being written; never read, removed by the next save
    latest            the name of the newest finished checkpoint, replaced last

A checkpoint is written under a temporary name, renamed when every rank has finished, and only
then does ``latest`` (itself written to a temporary file and ``os.replace``-d) point at it. A run
killed at any moment therefore leaves ``latest`` naming a complete checkpoint. DCP stores the
model and optimiser by parameter name with their global shapes, so a checkpoint written under
one layout loads under another (DCP reshards on load). The optimiser state is flattened to one
key per parameter and field (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``): pipeline
ranks each hold other parameters, and a nested ``param_groups`` list would be saved from one
rank only.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = ["latest_checkpoint", "load_checkpoint", "load_model_weights", "save_checkpoint"]

_PREFIX = "step_"
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)

# one process without a process group is a supported case of DCP, not something to warn about
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint ``latest`` names, or None when the run has none yet."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / "latest"
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    if not path.is_dir():
        raise FileNotFoundError(f"{pointer} names {path.name}, which does not exist")
    return path


def save_checkpoint(run_dir, step: int, model, optimizer, extra: dict, keep: int | None) -> Path:
    """Write checkpoint ``step`` (every rank calls) and keep the newest ``keep`` (None: all)."""
    root = Path(run_dir) / "checkpoints"
    name = f"{_PREFIX}{step:06d}"
    tmp, final = root / f".tmp-{name}", root / name
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):  # left by a run killed while writing
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # the same step again (a resumed run stopped where it began)
            shutil.rmtree(final)
    _barrier()
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer, options=_FLAT),
        "extra": json.dumps(extra),  # one leaf: DCP only loads keys the caller already has
    }
    dcp.save(state, checkpoint_id=str(tmp))
    torch.save(rng_state(), tmp / f"rng_rank{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        os.replace(tmp, final)
        pointer_tmp = root / ".latest.tmp"
        pointer_tmp.write_text(name + "\n")
        os.replace(pointer_tmp, root / "latest")
        if keep is not None:
            done = sorted(p for p in root.glob(f"{_PREFIX}*") if p.is_dir())
            for old in done[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path, model, optimizer) -> dict:
    """Load a checkpoint into ``model`` and ``optimizer`` laid out as they are now (DCP reshards)
    and restore this rank's RNG state (rank 0's when the writing run had fewer ranks); returns ``extra``."""
    path = Path(path)
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer, options=_FLAT),
        "extra": "",
    }
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"], options=_FLAT)
    rng = path / f"rng_rank{_rank()}.pt"
    set_rng_state(torch.load(rng if rng.exists() else path / "rng_rank0.pt", weights_only=True))
    return json.loads(state["extra"])


def load_model_weights(path, model) -> None:
    """Only the model's weights (for generation and export), into a model of any layout."""
    state = {"model": get_model_state_dict(model, options=StateDictOptions())}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
