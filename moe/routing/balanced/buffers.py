"""The work buffers one solve shares between its (E, T) passes, kept per thread on CPU."""

from __future__ import annotations

import threading

import torch
from torch import Tensor


def _jitter_pattern(
    num_experts: int,
    num_tokens: int,
    dtype: torch.dtype,
    device: torch.device,
    out: Tensor | None = None,
    first: int = 0,
) -> Tensor:
    """(E, T): ``frac(t * phi + e * psi)``, in ``out`` when given, for tokens t = first ..
    first + T - 1 (a shard of a larger problem gets the columns the whole one would)."""
    t = torch.arange(first, first + num_tokens, device=device, dtype=torch.float64)
    u = (t * 0.6180339887498949).frac()
    v = (torch.arange(num_experts, device=device, dtype=torch.float64) * 0.7548776662466927).frac()
    return torch.add(u.to(dtype), v.to(dtype)[:, None], out=out).frac_()


_WORKSPACE_MAX_BYTES = 128 << 20  # per thread: the CPU work buffers kept between solves
_workspace = threading.local()


def release_work_buffers() -> None:
    """Free the CPU work buffers this thread keeps for its next solve of the same shape (up to
    128 MB; `balanced_assignment` keeps them to avoid a page fault per 4 KiB on every call). The
    next solve makes new ones."""
    _workspace.__dict__.pop("held", None)


def _buffers(num_experts: int, num_tokens: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, ...]:
    """The buffers of `_Work` (s, a, b, hi, lo, levels, idx, pattern) on one allocation of four
    (E, T) buffers and a (max(1, E // 4), T) one; ``pattern`` holds `_jitter_pattern`. On CPU, while
    it fits in ``_WORKSPACE_MAX_BYTES``, the allocation is kept for the thread's next solve of
    the same shape, its pattern made once (`release_work_buffers` frees it): a fresh one costs a
    page fault per 4 KiB on first touch (0.2-0.3 ms at T=4096, E=64). CUDA's caching allocator
    already reuses its memory."""
    key = (num_experts, num_tokens, dtype)
    held = getattr(_workspace, "held", None)
    if held is not None and held[0] == key and device.type == "cpu":
        return held[1]
    rows = (4 * num_experts, max(1, num_experts // 4))
    size = sum(rows) * num_tokens
    with torch.inference_mode(False):  # normal tensors: solves also run outside inference mode
        flat = torch.empty(size, dtype=dtype, device=device)
        big, tmp = flat.split([rows[0] * num_tokens, rows[1] * num_tokens])
        s, a, b, pattern = big.view(4, num_experts, num_tokens).unbind(0)
        _jitter_pattern(num_experts, num_tokens, dtype, device, out=pattern)
        half = num_experts // 2
        # `_top2` runs in b before b is written again; the histogram bins reuse a
        idx = a.view(-1).view(torch.int32)[: num_experts * num_tokens].view(num_experts, num_tokens)
        hi, lo = b[:half], b[half : 2 * half]
        views = (s, a, b, hi, lo, _levels(hi, lo, tmp.view(rows[1], num_tokens)), idx, pattern)
    if device.type == "cpu" and size * dtype.itemsize <= _WORKSPACE_MAX_BYTES:
        _workspace.held = (key, views)
    return views


class _Work:
    """Work buffers shaped like the (E, T) normalised scores of ``scores_TE``, reused by every
    pass of one solve: ``s`` for the normalised scores, two buffers ``a`` and ``b``, a small one
    and the jitter's pattern (`_buffers`). After other work has filled the caches every buffer
    is read back from memory, as slow on CPU as the arithmetic, so the passes share these few.
    ``sync_ok``: the solve syncs anyway, so its counts may too (`bincount`)."""

    def __init__(self, scores_TE: Tensor, sync_ok: bool = False) -> None:
        num_tokens, num_experts = scores_TE.shape
        dtype = torch.promote_types(scores_TE.dtype, torch.float32)
        self.sync_ok = sync_ok
        self.s, self.a, self.b, self.hi, self.lo, self.levels, self.idx, self.pattern = _buffers(
            num_experts, num_tokens, dtype, scores_TE.device
        )

    def shifted(self, s_ET: Tensor, p: Tensor) -> Tensor:
        """``s - p`` in buffer ``a``."""
        return torch.sub(s_ET, p, out=self.a)


def _levels(hi: Tensor, lo: Tensor, tmp: Tensor) -> list[tuple]:
    """The views `_top2` folds at each level after the first, from ``hi`` and ``lo`` (the
    first level's largest and smallest of each pair of rows): (x, y, x_lo, y_lo, scratch, odd),
    odd the last row pair when the level has an odd number of rows, else None."""
    levels, n = [], hi.shape[0]
    while n > 1:
        h = n // 2
        odd = (hi[2 * h], lo[2 * h]) if n % 2 else None
        levels.append((hi[:h], hi[h : 2 * h], lo[:h], lo[h : 2 * h], tmp[:h], odd))
        n = h
    return levels
