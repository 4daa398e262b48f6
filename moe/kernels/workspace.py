"""Kept CPU memory for the large tensors the ops make on every step.

On CPU a fresh allocation of tens of MB comes straight from the OS, and every 4 KiB page of it
faults on first touch: writing a fresh (8192, 1408) fp32 GEMM output took 10-12 ms longer than
writing the same output into memory already touched (about a quarter of the GEMM itself; the
figures are in docs/benchmarks.md). `empty` hands out memory that is kept between calls, as
CUDA's caching allocator does on GPUs, where it is not needed and `empty` is ``torch.empty``.

A kept block is reused only when nothing else references it: the tensors made from it (the
op's output, what autograd saved, any view) all hold its storage, whose use count then exceeds
the one reference kept here. So an output the caller keeps, or one autograd saved for a
backward that never ran, is never handed out again while it is alive. Each thread keeps its own
blocks (at most `limit_bytes` in all); `release` frees them.
"""

from __future__ import annotations

import math
import threading

import torch
from torch import Tensor

__all__ = ["empty", "kept_bytes", "release", "set_limit"]

MIN_BYTES = 1 << 20  # smaller tensors come from the heap, whose pages are already touched
_limit = [2 << 30]  # bytes one thread keeps at most
_local = threading.local()


def set_limit(nbytes: int) -> None:
    """Keep at most ``nbytes`` of CPU memory per thread for reuse (default 2 GiB; 0 keeps none).
    Unused blocks beyond the new limit are freed now."""
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
    _limit[0] = nbytes
    _make_room(0)


def release() -> None:
    """Forget the blocks this thread keeps: unused ones are freed now, the others by torch once
    their last tensor goes."""
    _local.__dict__.pop("blocks", None)


def kept_bytes() -> int:
    """Bytes this thread keeps, in use or not."""
    return sum(s.nbytes() for s in _blocks())


def _blocks() -> list[torch.UntypedStorage]:
    return _local.__dict__.setdefault("blocks", [])


def _unused(storage: torch.UntypedStorage) -> bool:
    return torch._C._storage_Use_Count(storage._cdata) == 1  # only the reference in the list


def _make_room(nbytes: int) -> bool:
    """Drop unused blocks, largest first, until ``nbytes`` more fit under the limit."""
    blocks = _blocks()
    while sum(s.nbytes() for s in blocks) + nbytes > _limit[0]:
        unused = [s for s in blocks if _unused(s)]
        if not unused:
            return False
        blocks.remove(max(unused, key=lambda s: s.nbytes()))
    return True


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialised contiguous tensor, like ``torch.empty``. On CPU, for tensors of at
    least 1 MiB, it is made from a kept block nothing else uses (the smallest with room for it,
    at most twice its size), else from a new block, kept if it fits under the limit."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < MIN_BYTES or torch.compiler.is_compiling():
        return torch.empty(shape, dtype=dtype, device=device)
    blocks = _blocks()
    fits = [s for s in blocks if nbytes <= s.nbytes() <= 2 * nbytes and _unused(s)]
    if fits:
        return torch.empty(0, dtype=dtype).set_(min(fits, key=lambda s: s.nbytes()), 0, shape)
    out = torch.empty(shape, dtype=dtype)
    if _make_room(nbytes):
        blocks.append(out.untyped_storage())
    return out
