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
import os
import sys
import threading
from collections.abc import Mapping

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = [
    "DEFAULT_LIMIT",
    "MIN_BYTES",
    "apply_named",
    "eager",
    "empty",
    "kept_bytes",
    "release",
    "set_limit",
    "tracked_grads",
    "usable",
]

MIN_BYTES = 1 << 20  # smaller tensors come from the heap, whose pages are already touched


# where a container's memory limit is (cgroup v2, then v1), at the mount's root: a container
# with its own cgroup namespace sees its limit there; a process in a sub-cgroup of the host's
# (a SLURM job, a systemd slice) does not, and gets the machine's memory: set the limit there
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def _memory_bytes() -> int | None:
    """The memory this process may use: the machine's, or its container's limit where lower."""
    try:
        found = [os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")]
    except (AttributeError, OSError, ValueError):  # no sysconf (Windows) or no such name
        found = []
    for path in _CGROUP_LIMITS:
        try:
            with open(path, "rb") as f:
                found.append(int(f.read().strip()))  # "max" (no limit) and odd contents raise
        except (OSError, ValueError):
            continue
    return min((n for n in found if n > 0), default=None)


def _default_limit(memory: int | None, environ: Mapping[str, str]) -> int:
    """A quarter of ``memory`` over the processes a launcher starts on the machine (torchrun's
    ``LOCAL_WORLD_SIZE`` in ``environ``; 1 where it is missing or not a positive integer), and
    at least 2 GiB: what one step of a large layer needs kept (64 experts of 1024 x 2816 in fp32
    keep 2.7 GiB at 2,048 tokens and 4.5 GiB at 8,192; below that its weight gradients come
    fresh every step: docs/kernels.md)."""
    try:
        processes = max(1, int(environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        processes = 1
    return max(2 << 30, (memory or 0) // 4 // processes)


DEFAULT_LIMIT = _default_limit(_memory_bytes(), os.environ)  # read once, at import
_limit = [DEFAULT_LIMIT]  # bytes each thread keeps at most
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


def eager(*tensors: Tensor) -> bool:
    """`usable`, and outside any Python dispatch mode: where an op may skip the custom op's
    dispatch and run its autograd function on the tensors themselves."""
    return usable(*tensors) and _get_current_dispatch_mode() is None


def apply_named(name: str, function: type[torch.autograd.Function], *args):
    """``function.apply(*args)`` run directly (where `eager` allows), under ``name`` in a
    profiler's trace: the name its custom op would show. Without a profiler, no range opens."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return function.apply(*args)
    with torch.profiler.record_function(name):
        return function.apply(*args)


def tracked_grads(plain, inputs: tuple, needs: tuple[bool, ...], grad_out: Tensor) -> tuple[Tensor | None, ...]:
    """What a kept-memory autograd function's backward returns under ``create_graph=True``: the
    gradients of ``plain(*inputs)``, its formula in plain torch ops, re-run and differentiated
    by autograd with ``create_graph``, so the results are autograd's own and higher
    derivatives flow. ``needs``: ``ctx.needs_input_grad``."""
    with torch.enable_grad():
        out = plain(*inputs)
    grads = iter(
        torch.autograd.grad(out, [t for t, n in zip(inputs, needs, strict=True) if n], grad_out, create_graph=True)
    )
    return tuple(next(grads) if n else None for n in needs)


def set_limit(nbytes: int) -> None:
    """Keep at most ``nbytes`` of CPU memory per thread for reuse (default `DEFAULT_LIMIT`: a
    quarter of the machine's memory, or its container's, over torchrun's local processes, at
    least 2 GiB; 0 keeps none).
    Each thread drops its unused blocks beyond the limit at its next `empty` (this one now),
    and blocks in use beyond it once they are unused."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
    _limit[0] = nbytes
    _kept().make_room(0)


def release() -> None:
    """Forget the blocks this thread keeps: unused ones are freed now, the others by torch once
    their last tensor goes."""
    _local.__dict__.pop("kept", None)


def kept_bytes() -> int:
    """Bytes this thread keeps, in use or not."""
    return _kept().total


def _py_refs(blocks: list, i: int) -> int:
    return sys.getrefcount(blocks[i])


_LIST_ONLY = _py_refs([torch.UntypedStorage(0)], 0)  # Python references when only a list holds one


def _unused(blocks: list, i: int) -> bool:
    """No tensor uses block i (its storage's use count is the one of its storage object) and
    nothing but the list holds that object."""
    return torch._C._storage_Use_Count(blocks[i]._cdata) == 1 and _py_refs(blocks, i) <= _LIST_ONLY


class _Kept:
    """One thread's blocks, by size in bytes, and their total."""

    def __init__(self) -> None:
        self.by_size: dict[int, list[torch.UntypedStorage]] = {}
        self.total = 0

    def add(self, storage: torch.UntypedStorage) -> None:
        self.by_size.setdefault(storage.nbytes(), []).append(storage)
        self.total += storage.nbytes()

    def _drop(self, size: int, keep) -> None:
        bucket = self.by_size[size]
        kept = [s for i, s in enumerate(bucket) if keep(bucket, i)]
        self.total -= size * (len(bucket) - len(kept))
        if kept:
            bucket[:] = kept
        else:
            del self.by_size[size]

    def _drop_stale(self, size: int) -> None:
        # shared: sent to another process, which may still read it; resized by a tensor's resize_
        self._drop(size, lambda b, i: not b[i].is_shared() and b[i].nbytes() == size)

    def take(self, nbytes: int) -> torch.UntypedStorage | None:
        """The smallest unused block of nbytes to 2 * nbytes, if any."""
        for size in sorted(k for k in self.by_size if nbytes <= k <= 2 * nbytes):
            self._drop_stale(size)
            bucket = self.by_size.get(size, [])
            for i in range(len(bucket)):
                if _unused(bucket, i):
                    return bucket[i]
        return None

    def make_room(self, nbytes: int) -> bool:
        """Forget stale blocks, then unused ones, largest first, until ``nbytes`` more fit under
        the limit; whether they do."""
        for size in list(self.by_size):
            self._drop_stale(size)
        for size in sorted(self.by_size, reverse=True):
            if self.total + nbytes <= _limit[0]:
                break
            over = self.total + nbytes - _limit[0]
            unused = [i for i in range(len(self.by_size[size])) if _unused(self.by_size[size], i)]
            drop = set(unused[: -(-over // size)])  # as many as cover the excess
            self._drop(size, lambda b, i, drop=drop: i not in drop)
        return self.total + nbytes <= _limit[0]


def _kept() -> _Kept:
    return _local.__dict__.setdefault("kept", _Kept())


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
    kept = _kept()
    if kept.total > _limit[0]:  # a lowered limit
        kept.make_room(0)
    block = kept.take(nbytes)
    if block is not None:
        return torch.empty(0, dtype=dtype, device=device).set_(block, 0, shape)
    out = torch.empty(shape, dtype=dtype, device=device)
    if kept.make_room(nbytes):
        kept.add(out.untyped_storage())
    return out
