"""Dual prices of the experts: damped Jacobi updates towards the capacities.

Legend: T tokens, E experts, K experts per token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..common import bincount
from .buffers import _Work
from .capacities import _Capacities
from .pairs import _Pairs


def _merge_row(hi: Tensor, lo: Tensor, x_hi: Tensor, x_lo: Tensor) -> None:
    """Fold one more (largest, second largest) pair of rows into row 0 of ``hi``, ``lo``."""
    lo[0] = torch.maximum(torch.maximum(lo[0], x_lo), torch.minimum(hi[0], x_hi))
    hi[0] = torch.maximum(hi[0], x_hi)


def _top2(a_ET: Tensor, work: _Work) -> tuple[Tensor, Tensor]:
    """Largest and second largest entry of every column (T,), (T,), by a tournament of
    elementwise max and min over halves of the rows (cheaper than a sort or a masked reduction)."""
    num_experts, num_tokens = a_ET.shape
    if num_experts == 1:
        return a_ET[0].clone(), a_ET.new_full((num_tokens,), float("-inf"))
    h = num_experts // 2
    hi, lo = work.hi, work.lo
    x, y = a_ET[:h], a_ET[h : 2 * h]
    torch.maximum(x, y, out=hi)
    torch.minimum(x, y, out=lo)
    if num_experts % 2:
        _merge_row(hi, lo, a_ET[2 * h], a_ET.new_full((num_tokens,), float("-inf")))
    for x, y, x_lo, y_lo, t, odd in work.levels:
        torch.minimum(x, y, out=t)
        torch.maximum(x, y, out=x)
        torch.maximum(x_lo, y_lo, out=x_lo)
        torch.maximum(x_lo, t, out=x_lo)
        if odd:
            _merge_row(hi, lo, odd[0].clone(), odd[1].clone())
    return hi[0].clone(), lo[0].clone()


def _margins(a_ET: Tensor, k: int, work: _Work) -> Tensor:
    """(E, T): how far each expert's price may rise before token t stops picking it (> 0), or
    must fall before t picks it (< 0), the other prices fixed. For K = 1 written to buffer
    ``a`` (``a_ET`` may be that buffer or the scores themselves)."""
    if k == 1:  # the held expert's margin is m1 - m2, every other one's a - m1: both are
        m1, m2 = _top2(a_ET, work)  # a + max(a - m1 - m2, -m1), three passes
        low = torch.sub(a_ET, m1 + m2, out=work.b)
        return torch.add(a_ET, torch.maximum(low, -m1, out=low), out=work.a)
    top = a_ET.topk(k + 1, dim=0).values
    return torch.where(a_ET >= top[k - 1], a_ET - top[k], a_ET - top[k - 1])


def _row_quantiles(
    v: Tensor, row_base: Tensor, need: Tensor, width: float, bins: int, work: _Work | None = None
) -> Tensor:
    """For each row r, about where ``need[r]`` (int64) of its values lie above: (R,).

    ``v`` holds the values and ``row_base`` (broadcast against it) ``r * bins + bins / 2`` for the
    row of each value. One histogram of ``bins`` equal bins over [-width, width] per row, counted
    from the top (values outside are clamped to the end bins); within the bin that holds the
    need-th largest value, the values are taken as evenly spread. A row with fewer values than
    it needs gets ``-width``, one that needs none ``width``. Resolution about
    ``2 * width / bins``; no host sync. ``work`` (for (E, T) values) supplies the buffers.
    """
    num_rows = need.shape[0]
    scale = bins / (2 * width)
    buf = None if work is None else work.b
    pos = torch.clamp(v, min=0.5 / scale - width, max=width, out=buf)
    pos = torch.add(row_base, pos, alpha=-scale, out=buf)  # bin 0 holds the largest values
    idx = pos.to(torch.int32) if work is None else work.idx.copy_(pos)
    hist = bincount(idx, num_rows * bins, sync_ok=work is not None and work.sync_ok).view(num_rows, bins)
    cum = hist.cumsum(1)  # values in this bin or a higher one
    need = need[:, None]
    j = torch.searchsorted(cum, need).clamp_(max=bins - 1)  # the bin holding the need-th largest
    n = hist.gather(1, j)
    inside = (need - cum.gather(1, j) + n).to(v.dtype)  # of that bin's values, how many lie above
    frac = inside.div_(n.clamp(min=1)).clamp_(0.0, 1.0)
    return (j + frac).mul_(-1.0 / scale).add_(width).flatten()  # -width when the row has too few


_BINS_DENSE = 512  # histogram bins over the full margin range [-1, 1]


def _jacobi_prices(
    s_ET: Tensor,
    caps: _Capacities,
    k: int,
    iters: int,
    p: Tensor | None,
    work: _Work,
    omega: float = 0.7,
    widths: tuple[float, ...] = (1.0,),
) -> tuple[Tensor, Tensor]:
    """Damped Jacobi updates of the prices (E, 1), warm-started from ``p`` (None: from zero, and
    the first update reads the scores without shifting them); also returns the largest price
    move of the last update (a scalar tensor).

    Each update moves every expert's price to the value at which exactly ``target[e]`` (int64)
    tokens would pick it were the other prices fixed (``target = caps.at(p)``: under movable
    extra slots the r experts priced highest so far aim at one token more) (the midpoint between two order statistics
    of the margins, from a per-expert histogram over [-width, width]: a narrower window is
    finer, and a larger move is clamped to it), damped by ``omega``. Update i uses
    ``widths[i]``, the last one for the rest. No host sync.
    """
    num_experts = s_ET.shape[0]
    last = s_ET.new_zeros(())
    rows = torch.arange(num_experts, device=s_ET.device, dtype=s_ET.dtype)
    row_base = (rows * _BINS_DENSE + _BINS_DENSE / 2)[:, None]
    zero = p is None
    p = s_ET.new_zeros(num_experts, 1) if zero else p
    for i in range(iters):
        d = _margins(s_ET if zero and i == 0 else work.shifted(s_ET, p), k, work)
        target_E = caps.at(None if zero and i == 0 else p)
        q = _row_quantiles(d, row_base, target_E, widths[min(i, len(widths) - 1)], _BINS_DENSE, work)
        step = omega * q
        p = p + step[:, None]
        last = step.abs().max()
    return p, last


def _prices(s_ET: Tensor, caps: _Capacities, k: int, max_iters: int, work: _Work) -> tuple[Tensor, _Pairs | None]:
    """Prices (E, 1) after ``max_iters`` damped Jacobi updates from zero, and for K = 1 the
    pairs near each token's best (None when not used).

    K = 1: one update over every (token, expert) pair, a second one if the first moved some
    price by more than 0.05 (skewed scores), and the rest over the pairs within the last move
    (clamped to [0.02, 0.05]) of each token's best. One host sync per full update.
    Rejected after measurement: coarse starts from strided token samples (their sampling noise
    leaves the prices further from the optimum than the all-zero start) and freezing tokens far
    from any boundary (on skewed scores the prices still move far and the frozen tokens then
    cost more exchange cycles than they saved).
    """
    if k > 1 or max_iters <= 2:
        return _jacobi_prices(s_ET, caps, k, max_iters, None, work=work)[0], None
    p, last = _jacobi_prices(s_ET, caps, k, 1, None, work=work)
    dense = 1
    if float(last) > 0.05:
        p, last = _jacobi_prices(s_ET, caps, k, 1, p, work=work)
        dense = 2
    pairs = _Pairs(s_ET, p, float(last.clamp(0.02, 0.05)), caps, work)  # wide enough for the moves still to come
    return pairs.jacobi(p, max_iters - dense), pairs
