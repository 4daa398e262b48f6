"""Atomic checkpoints with torch.distributed.checkpoint (DCP), in one process or many.

Layout of ``<run>/checkpoints``::

    step_000100/      a finished checkpoint: DCP files (model, optimiser, schedule, step), rng_rank<r>.pt,
                      a copy of config.json and manifest.json (size and CRC-32 of each file: `moe.train.manifest`)
    .tmp-step_000200/ one being written; never read, removed by the next save (or at once when the disk is full)
    latest            the name of the newest finished checkpoint, replaced last

A checkpoint is written under a temporary name, checksummed and renamed when every rank has
finished, and only then does ``latest`` (itself written to a temporary file and ``os.replace``-d)
point at it; older checkpoints are pruned after that. A run killed at any moment therefore
leaves complete checkpoints only, and ``latest`` naming one. Nothing is written from weights or
optimiser state holding a NaN or an infinity (every rank checks its part; they agree through an
all-reduce). Readers (`load_newest`) take the newest checkpoint whose files match their
manifest and load, passing over damaged ones with a warning. DCP stores the
model and optimiser by parameter name with their global shapes, so a checkpoint written under
one layout loads under another (DCP reshards on load). The optimiser state is flattened to one
key per parameter and field (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``): pipeline
ranks each hold other parameters, and a nested ``param_groups`` list would be saved from one
rank only.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from .manifest import (
    PREFIX,
    CheckpointError,
    DiskFullError,
    checkpoint_folders,
    choose_checkpoint,
    disk_full_message,
    file_entries,
    point_latest,
    step_of,
    warn,
    write_manifest,
)

__all__ = ["NonFiniteError", "all_finite", "load_checkpoint", "load_model_weights", "load_newest", "save_checkpoint"]

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)

# one process without a process group is a supported case of DCP, not something to warn about
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


class NonFiniteError(CheckpointError):
    """The state to checkpoint holds a NaN or an infinity: writing it would replace good checkpoints."""


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


def _any_rank(flag: bool) -> bool:
    """``flag`` of any rank (every rank calls: one all-reduce), so all ranks take the same branch."""
    if not dist.is_initialized():
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _tensors(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, torch.Tensor):
        yield tree.to_local() if isinstance(tree, DTensor) else tree


def all_finite(tensors) -> bool:
    """Every floating tensor of ``tensors`` (a state dict, or an iterable such as parameters;
    this rank's shards) is finite; one host read."""
    tree = tensors if isinstance(tensors, dict) else dict(enumerate(tensors))
    floats = [t for t in _tensors(tree) if t.is_floating_point() and t.numel()]
    if not floats:
        return True
    peaks = [torch.linalg.vector_norm(t.detach(), ord=float("inf")).float() for t in floats]  # NaN/inf if any is
    return bool(torch.stack(peaks).isfinite().all())


def _nbytes(state: dict) -> int:
    """This rank's bytes of ``state``: what a checkpoint of it takes, about."""
    return sum(t.numel() * t.element_size() for t in _tensors(state))


def _enospc(err: BaseException) -> bool:
    if isinstance(err, CheckpointException):
        return any(_enospc(exc) for exc, _ in err.failures.values())
    return isinstance(err, OSError) and err.errno == errno.ENOSPC


def _nearly_full(path: Path) -> bool:
    """Under 1 MiB free: torch.save reports a full disk as a RuntimeError of its zip writer
    ("unexpected pos"), without the errno."""
    try:
        return shutil.disk_usage(path).free < 1 << 20
    except OSError:
        return False


def _attempt(fn) -> BaseException | None:
    """Run this rank's part of a save; the error it raised, if any (the ranks agree after it)."""
    try:
        fn()
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - raised on every rank once they agree
        return err
    return None


def _write_failed(err: BaseException | None, root: Path, tmp: Path, needed: int) -> BaseException:
    """Remove the partial checkpoint (rank 0) and return the error every rank raises."""
    full = err is not None and (_enospc(err) or _nearly_full(root))  # (measured before the removal frees it)
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    if full:
        previous = checkpoint_folders(root.parent)
        if previous:  # the last checkpoint's size is the best measure of the next one's
            needed = sum(p.stat().st_size for p in previous[0].iterdir() if p.is_file())
        return DiskFullError(disk_full_message(tmp, needed))
    return err if err is not None else CheckpointError(f"writing {tmp} failed on another rank")


def save_checkpoint(run_dir, step: int, model, optimizer, extra: dict, keep: int | None) -> Path:
    """Write checkpoint ``step`` (every rank calls) and keep the newest ``keep`` (None: all).

    Raises `NonFiniteError` (nothing written) when a weight or optimiser state is not finite on
    any rank, `DiskFullError` (the partial folder removed) when the disk fills up."""
    run_dir = Path(run_dir)
    root = run_dir / "checkpoints"
    name = f"{PREFIX}{step:06d}"
    tmp, final = root / f".tmp-{name}", root / name
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer, options=_FLAT),
        "extra": json.dumps(extra),  # one leaf: DCP only loads keys the caller already has
    }
    if _any_rank(not all_finite(state)):
        raise NonFiniteError(f"the weights are not finite after step {step}: no checkpoint written")
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in [*root.glob(".tmp-*"), *root.glob(".old-*")]:  # left by a run killed while writing
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()

    mine: dict[str, dict] = {}  # this rank's files, checksummed here rather than all by rank 0

    def write() -> None:
        dcp.save(state, checkpoint_id=str(tmp))
        torch.save(rng_state(), tmp / f"rng_rank{_rank()}.pt")
        own = [p for p in tmp.iterdir() if p.name.startswith(f"__{_rank()}_") or p.name == f"rng_rank{_rank()}.pt"]
        mine.update(file_entries(own))

    err = _attempt(write)
    if _any_rank(err is not None):
        raise _write_failed(err, root, tmp, _nbytes(state))
    known = [mine]
    if dist.is_initialized():
        known = [None] * dist.get_world_size()
        dist.all_gather_object(known, mine)
    known = {name: entry for entries in known for name, entry in entries.items()}
    err = _attempt(lambda: _publish(run_dir, tmp, final, keep, known)) if _rank() == 0 else None
    if _any_rank(err is not None):
        raise _write_failed(err, root, tmp, _nbytes(state))
    return final


def _publish(run_dir: Path, tmp: Path, final: Path, keep: int | None, known: dict) -> None:
    """Rank 0, once every rank has written: checksum, rename into place, point ``latest`` at it,
    and only then remove what is older than the newest ``keep``."""
    if (run_dir / "config.json").is_file():  # a copy the run's config can be recovered from
        shutil.copyfile(run_dir / "config.json", tmp / "config.json")
    write_manifest(tmp, known)
    root = final.parent
    old = root / f".old-{final.name}"
    if final.exists():  # the same step again, after a fallback past a damaged one: swap, never delete first
        os.replace(final, old)
    os.replace(tmp, final)
    point_latest(root, final.name)
    shutil.rmtree(old, ignore_errors=True)
    if keep is not None:  # of the older ones; a newer one is a damaged one passed over on resume, kept for
        # a look until this run reaches its step and replaces it (it is never chosen: it does not verify)
        older = [p for p in checkpoint_folders(run_dir) if step_of(p) < step_of(final)]
        for p in older[keep - 1 :]:
            shutil.rmtree(p, ignore_errors=True)


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


def load_newest(run_dir, load, *, repoint: bool = False, flag: str | None = None) -> Path:
    """``load(path)`` the newest checkpoint that verifies and loads (every rank calls; rank 0
    verifies and every rank loads the one it chose). A checkpoint that fails to load (pruned by
    a run still training, or damaged past its checksums) passes to the next newest, each thing
    passed over said once on stderr. With ``repoint`` (a resuming run) ``latest`` is rewritten
    to name the loaded checkpoint when it named another. Raises `CheckpointError` (its message
    led by ``flag``, the option that asked for it) when none is left."""
    run_dir = Path(run_dir)
    passed: dict[str, str] = {}
    said: set[str] = set()
    for _ in range(16):  # a training run can prune and add checkpoints meanwhile
        choice = [None, None]
        if _rank() == 0:
            try:
                path, notes = choose_checkpoint(run_dir, passed)
                choice = [path.name, None]
                for note in notes:
                    if note not in said:
                        said.add(note)
                        warn(note)
            except CheckpointError as err:
                choice = [None, str(err)]
        if dist.is_initialized():
            dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            raise CheckpointError(f"{flag}: {choice[1]}" if flag else choice[1])
        path = run_dir / "checkpoints" / choice[0]
        try:
            load(path)
            err = None
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - any failure passes to the next one
            err = e
        if not _any_rank(err is not None):
            if repoint and _rank() == 0 and _latest_name(run_dir) != path.name:
                point_latest(path.parent, path.name)
            return path
        gone = not path.is_dir()
        passed[path.name] = "removed while it was read" if gone else f"does not load ({_one_line(err)})"
    raise CheckpointError(f"{run_dir}: checkpoints keep changing while read; try again")


def _one_line(err: BaseException | None) -> str:
    if err is None:
        return "failed on another rank"
    if isinstance(err, CheckpointException):
        err = next(iter(err.failures.values()))[0]
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:200]


def _latest_name(run_dir: Path) -> str | None:
    try:
        return (run_dir / "checkpoints" / "latest").read_text().strip()
    except OSError:
        return None
