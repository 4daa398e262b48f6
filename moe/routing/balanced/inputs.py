"""Argument checks and the normalisation of the scores that every solver starts from."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .buffers import _jitter_pattern, _Work


def _check(scores: Tensor, k: int, name: str = "scores") -> None:
    if not isinstance(scores, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(scores).__name__}")
    if scores.dim() != 2:
        raise ValueError(f"{name} must have shape (T, E), got {tuple(scores.shape)}")
    if not scores.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {scores.dtype}")
    num_experts = scores.shape[1]
    if num_experts < 1:
        raise ValueError(f"{name} must have E >= 1 experts (columns), got E = {num_experts}")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1 or k > num_experts:
        raise ValueError(f"k must be an int in [1, E={num_experts}], got {k!r}")


def _check_finite(largest: float, scores: Tensor, name: str = "scores") -> None:
    """``largest`` = max |scores|: NaN or Inf anywhere makes it non-finite."""
    if not math.isfinite(largest):
        raise ValueError(f"{name} must be finite: found NaN or Inf in a tensor of shape {tuple(scores.shape)}")


def _check_options(max_iters: int, max_cycles: int | None, eps: float) -> None:
    if not isinstance(max_iters, int) or isinstance(max_iters, bool) or max_iters < 0:
        raise ValueError(f"max_iters must be an int >= 0, got {max_iters!r}")
    if max_cycles is not None and (not isinstance(max_cycles, int) or isinstance(max_cycles, bool) or max_cycles < 0):
        raise ValueError(f"max_cycles must be None or an int >= 0, got {max_cycles!r}")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps must be a finite float > 0, got {eps!r}")


def _normalise(scores: Tensor, jitter: float, work: _Work | None = None) -> Tensor:
    """`_normalise_unit`'s scores alone."""
    return _normalise_unit(scores, jitter, work)[0]


def _normalise_unit(scores: Tensor, jitter: float, work: _Work | None = None) -> tuple[Tensor, float]:
    """(T, E) -> (E, T) in float32 or float64: every token's best score at 0, all in [-1, 0],
    plus a deterministic pseudo-random jitter in [0, jitter) that splits exact ties.

    Subtracting a per-token constant and dividing by one positive scale does not change the
    optimal assignment, and makes every later tolerance relative to the largest per-token score
    range R. Huge or tiny finite inputs are divided by their largest magnitude first, so the
    differences can neither overflow nor vanish. Without the jitter, tokens with identical
    scores cannot be told apart by prices and each one costs an exchange later; with it, the
    objective moves by less than ``jitter`` per slot. One host sync (the finiteness check and the
    scale). ``work``: the buffers for the result (``s``) and the jitter's pattern. Also returns
    the scores' units in one of the result's (0 where every token's scores are all equal).
    """
    dtype = torch.promote_types(scores.dtype, torch.float32)
    lo, hi = scores.amin(dim=1).to(dtype), scores.amax(dim=1).to(dtype)  # per token; NaN propagates
    big, half = torch.stack([torch.maximum(hi.abs(), lo.abs()).amax(), (hi * 0.5 - lo * 0.5).amax()]).tolist()
    _check_finite(big, scores)
    x, scale, unit = scores, 2 * half, 1.0
    if big > 1e30 or 0 < big < 1e-30:  # differences could overflow or underflow: to [-1, 1] first
        x, lo, hi = scores.to(dtype) / big, lo / big, hi / big
        scale, unit = float((hi - lo).amax()), big
    s = _sub_transposed(x, hi, x.new_empty(x.shape[::-1], dtype=dtype) if work is None else work.s)
    if scale > 0:
        s.div_(scale)
    return _add_jitter(s, jitter, None if work is None else work.pattern), unit * scale


def _normalise_nosync(scores: Tensor, jitter: float, work: _Work) -> Tensor:
    """`_normalise` without a host sync: the input is always divided by its largest magnitude
    first, and the scale stays on the device. Nothing is checked: NaN counts as the lowest
    score and +-Inf as the largest finite ones."""
    dtype = torch.promote_types(scores.dtype, torch.float32)
    big = torch.finfo(dtype).max
    x = torch.nan_to_num(scores.to(dtype), nan=-big, posinf=big, neginf=-big)
    x = x / x.abs().amax().clamp(min=torch.finfo(dtype).tiny)
    lo, hi = x.amin(dim=1), x.amax(dim=1)
    scale = (hi - lo).amax()
    s = _sub_transposed(x, hi, work.s).div_(torch.where(scale > 0, scale, 1.0))
    return _add_jitter(s, jitter, work.pattern)


_TILE_BYTES = 1 << 20  # the (tokens, E) block of one transposing pass on CPU


def _sub_transposed(x_TE: Tensor, hi_T: Tensor, out_ET: Tensor) -> Tensor:
    """``out = x.T - hi`` in one pass that reads ``x`` transposed. On CPU, once ``x`` outgrows
    the caches, a strided read of the whole of it runs at a fraction of the memory's speed
    (14 ms for a (16384, 256) float32 against 2.5 ms tiled), so it goes in blocks of tokens of
    about ``_TILE_BYTES`` each, read while they sit in the cache."""
    num_tokens, num_experts = x_TE.shape
    chunk = max(1, _TILE_BYTES // (num_experts * x_TE.element_size()))
    if x_TE.device.type != "cpu" or num_tokens <= chunk:
        return torch.sub(x_TE.T, hi_T, out=out_ET)
    for t0 in range(0, num_tokens, chunk):
        t1 = t0 + chunk
        torch.sub(x_TE[t0:t1].T, hi_T[t0:t1], out=out_ET[:, t0:t1])
    return out_ET


def _add_jitter(s_ET: Tensor, jitter: float, pattern: Tensor | None = None) -> Tensor:
    """``s += jitter * pattern``, in place, the pattern `_jitter_pattern` (made here unless
    given): a fixed low-discrepancy pattern in [0, jitter) that splits exact ties."""
    if jitter > 0:
        num_experts, num_tokens = s_ET.shape
        pattern = _jitter_pattern(num_experts, num_tokens, s_ET.dtype, s_ET.device) if pattern is None else pattern
        s_ET.add_(pattern, alpha=jitter)
    return s_ET


def _nothing_to_solve(
    scores_TE: Tensor, k: int, max_iters: int, max_cycles: int | None, eps: float, *, check_finite: bool
) -> Tensor | None:
    """Check the arguments, and return the answer when there is no choice to make (no tokens,
    or K = E: every token takes every expert), else None."""
    _check(scores_TE, k)
    _check_options(max_iters, max_cycles, eps)
    num_tokens, num_experts = scores_TE.shape
    if num_tokens == 0:
        return torch.empty(0, k, dtype=torch.int64, device=scores_TE.device)
    if k == num_experts:
        if check_finite:
            _check_finite(float(scores_TE.abs().amax()), scores_TE)
        return torch.arange(k, device=scores_TE.device).expand(num_tokens, k).clone()
    return None
