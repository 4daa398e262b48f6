"""Kept CPU memory for the large tensors the ops make on every step.

On CPU a fresh allocation of tens of MB comes straight from the OS, and every 4 KiB page of it
faults on first touch: writing a fresh (8192, 1408) fp32 GEMM output took 10-12 ms longer than
writing the same output into memory already touched (about a quarter of the GEMM itself;
docs/kernels.md, "Kept memory on CPU"). `empty` hands out memory that is kept between calls, as
CUDA's caching allocator does on GPUs, where it is not needed and `empty` is ``torch.empty``.

A kept block is handed out again only when nothing but the list of kept blocks references it:
every tensor made from it (the op's output, what autograd saved, any view) holds its storage,
raising the storage's use count, and a Python reference to the storage object itself (from
``t.untyped_storage()``) raises that object's reference count. A block moved to shared memory
(sent to another process) is forgotten. So an output the caller keeps, or one autograd saved
for a backward that never ran, is never handed out again while it is alive. Each thread keeps
its own blocks, up to the limit (`set_limit`); `release` forgets them.
"""

from __future__ import annotations

import math
import sys
import threading

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = ["MIN_BYTES", "empty", "kept_bytes", "release", "set_limit", "usable"]

MIN_BYTES = 1 << 20  # smaller tensors come from the heap, whose pages are already touched
_limit = [2 << 30]  # bytes each thread keeps at most
_local = threading.local()


def usable(*tensors: Tensor) -> bool:
    """Whether the ops' kept-memory paths (autograd functions writing into `empty`) serve these
    inputs: CPU tensors, outside ``torch.func`` transforms and forward-mode AD, which those
    functions do not support, and outside ``torch.compile``'s tracing. Elsewhere the ops run
    plain torch ops (on GPUs the caching allocator already reuses memory)."""
    if torch.compiler.is_compiling():  # traced: the compiler's own ops and memory planning
        return False
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    forward_ad = getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0
    return tensors[0].device.type == "cpu" and not forward_ad and not any(wrapped(t) for t in tensors)


def set_limit(nbytes: int) -> None:
    """Keep at most ``nbytes`` of CPU memory per thread for reuse (default 2 GiB; 0 keeps none).
    Each thread drops its unused blocks beyond the limit at its next `empty` (this one now),
    and blocks in use beyond it once they are unused."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
    _limit[0] = nbytes
    _make_room(_blocks(), 0)


def release() -> None:
    """Forget the blocks this thread keeps: unused ones are freed now, the others by torch once
    their last tensor goes."""
    _local.__dict__.pop("blocks", None)


def kept_bytes() -> int:
    """Bytes this thread keeps, in use or not."""
    return sum(s.nbytes() for s in _blocks())


def _blocks() -> list[torch.UntypedStorage]:
    return _local.__dict__.setdefault("blocks", [])


def _py_refs(blocks: list, i: int) -> int:
    return sys.getrefcount(blocks[i])


_LIST_ONLY = _py_refs([torch.UntypedStorage(0)], 0)  # Python references when only a list holds one


def _unused(blocks: list, i: int) -> bool:
    """No tensor uses block i (its storage's use count is the one of its storage object) and
    nothing but the list holds that object."""
    return torch._C._storage_Use_Count(blocks[i]._cdata) == 1 and _py_refs(blocks, i) <= _LIST_ONLY


def _make_room(blocks: list, nbytes: int) -> bool:
    """Forget shared blocks, then unused ones, largest first, until ``nbytes`` more fit under
    the limit; whether they do."""
    blocks[:] = [s for s in blocks if not s.is_shared()]  # now another process's too
    while sum(s.nbytes() for s in blocks) + nbytes > _limit[0]:
        unused = [i for i in range(len(blocks)) if _unused(blocks, i)]
        if not unused:
            return False
        del blocks[max(unused, key=lambda i: blocks[i].nbytes())]
    return True


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """An uninitialised contiguous tensor, like ``torch.empty(shape, dtype=dtype, device=device)``.

    On CPU, for tensors of at least 1 MiB, it is made from a kept block nothing else uses (the
    smallest with room for it, at most twice its size), else from a new block, kept if it fits
    under the limit. Elsewhere, under ``torch.compile``'s tracing and under any Python dispatch
    mode (e.g. fake tensors), it is a plain ``torch.empty``."""
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
    device = torch.device(device)
    if not isinstance(shape, (tuple, list, torch.Size)) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise ValueError(f"shape must be a sequence of ints >= 0, got {shape!r}")
    shape = tuple(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    plain = device.type != "cpu" or nbytes < MIN_BYTES or torch.compiler.is_compiling()
    if plain or _get_current_dispatch_mode() is not None:
        return torch.empty(shape, dtype=dtype, device=device)
    blocks = _blocks()
    _make_room(blocks, 0)  # a lowered limit, and blocks gone to shared memory
    fits = [i for i in range(len(blocks)) if nbytes <= blocks[i].nbytes() <= 2 * nbytes and _unused(blocks, i)]
    if fits:
        best = min(fits, key=lambda i: blocks[i].nbytes())
        return torch.empty(0, dtype=dtype, device=device).set_(blocks[best], 0, shape)
    out = torch.empty(shape, dtype=dtype, device=device)
    if _make_room(blocks, nbytes):
        blocks.append(out.untyped_storage())
    return out
