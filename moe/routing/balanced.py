"""Exact-balance expert assignment (BASE layers) as a transportation problem.

Legend: T tokens, E experts, K experts per token, M (token, expert) pairs kept near a boundary.

Every token gets K distinct experts and expert e gets exactly ``cap[e]`` tokens, where
``cap = expert_capacities(T, E, K)`` (the first ``T*K % E`` experts take one token more).
Among such assignments we maximise the total score.

The optimum is described by E dual prices p: token t takes the K experts with the largest
``s[t, e] - p[e]``. The solver estimates those prices, lets every token pick under them,
completes the assignment greedily, and then improves and certifies it with exchange cycles
between experts (`moe.routing.exchange`). docs/routing.md gives the math.
"""

from __future__ import annotations

import math
import threading
import warnings

import numpy as np
import torch
from torch import Tensor

from .common import bincount, drop_by_score
from .exchange import _host, cancel_cycles, fill_passes, held_mask, keep_top_claims

__all__ = [
    "balanced_assignment",
    "balanced_assignment_approx",
    "balanced_assignment_ref",
    "expert_capacities",
    "assignment_score",
    "release_work_buffers",
]


def expert_capacities(num_tokens: int, num_experts: int, k: int = 1, *, device=None) -> Tensor:
    """Tokens per expert under exact balance: (E,) int64.

    ``T*K`` slots are split as evenly as possible; when ``T*K % E = r > 0`` the experts with the
    lowest indices, ``0 .. r-1``, receive one slot more than the others. Made on the device (a
    tensor built from a host list would be a blocking copy on CUDA).
    """
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if num_tokens < 0 or k < 1:
        raise ValueError(f"num_tokens must be >= 0 and k >= 1, got num_tokens={num_tokens}, k={k}")
    base, extra = divmod(num_tokens * k, num_experts)
    caps = torch.full((num_experts,), base, dtype=torch.int64, device=device)
    return caps + (torch.arange(num_experts, device=device) < extra)


def assignment_score(scores_TE: Tensor, expert_idx_TK: Tensor) -> Tensor:
    """Total score of an assignment (dropped slots, ``-1``, count zero): scalar in float64."""
    valid = expert_idx_TK >= 0
    picked = scores_TE.double().gather(1, expert_idx_TK.clamp(min=0))
    return (picked * valid).sum()


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
    """(T, E) -> (E, T) in float32 or float64: every token's best score at 0, all in [-1, 0],
    plus a deterministic pseudo-random jitter in [0, jitter) that splits exact ties.

    Subtracting a per-token constant and dividing by one positive scale does not change the
    optimal assignment, and makes every later tolerance relative to the largest per-token score
    range R. Huge or tiny finite inputs are divided by their largest magnitude first, so the
    differences can neither overflow nor vanish. Without the jitter, tokens with identical
    scores cannot be told apart by prices and each one costs an exchange later; with it, the
    objective moves by less than ``jitter`` per slot. One host sync (the finiteness check and the
    scale). ``work``: the buffers for the result (``s``) and the jitter's pattern.
    """
    dtype = torch.promote_types(scores.dtype, torch.float32)
    lo, hi = scores.amin(dim=1).to(dtype), scores.amax(dim=1).to(dtype)  # per token; NaN propagates
    big, half = torch.stack([torch.maximum(hi.abs(), lo.abs()).amax(), (hi * 0.5 - lo * 0.5).amax()]).tolist()
    _check_finite(big, scores)
    x, scale = scores, 2 * half
    if big > 1e30 or 0 < big < 1e-30:  # differences could overflow or underflow: to [-1, 1] first
        x, lo, hi = scores.to(dtype) / big, lo / big, hi / big
        scale = float((hi - lo).amax())
    # one pass that reads x transposed and subtracts (on CPU about half a transposing copy and a sub_)
    s = torch.sub(x.T, hi, out=x.new_empty(x.shape[::-1], dtype=dtype) if work is None else work.s)
    if scale > 0:
        s.div_(scale)
    return _add_jitter(s, jitter, None if work is None else work.pattern)


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
    s = torch.sub(x.T, hi, out=work.s).div_(torch.where(scale > 0, scale, 1.0))
    return _add_jitter(s, jitter, work.pattern)


def _add_jitter(s_ET: Tensor, jitter: float, pattern: Tensor | None = None) -> Tensor:
    """``s += jitter * pattern``, in place, the pattern `_jitter_pattern` (made here unless
    given): a fixed low-discrepancy pattern in [0, jitter) that splits exact ties."""
    if jitter > 0:
        num_experts, num_tokens = s_ET.shape
        pattern = _jitter_pattern(num_experts, num_tokens, s_ET.dtype, s_ET.device) if pattern is None else pattern
        s_ET.add_(pattern, alpha=jitter)
    return s_ET


def _jitter_pattern(
    num_experts: int, num_tokens: int, dtype: torch.dtype, device: torch.device, out: Tensor | None = None
) -> Tensor:
    """(E, T): ``frac(t * phi + e * psi)``, in ``out`` when given."""
    u = (torch.arange(num_tokens, device=device, dtype=torch.float64) * 0.6180339887498949).frac()
    v = (torch.arange(num_experts, device=device, dtype=torch.float64) * 0.7548776662466927).frac()
    return torch.add(u.to(dtype), v.to(dtype)[:, None], out=out).frac_()


def _top_values(a_ET: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """K+1 largest entries per token (K < E), ties broken by lowest expert index.

    Returns values (K+1, T) and indices (K+1, T); the last row is the best expert *not* taken.
    """
    work = a_ET.clone()
    vals, idxs = [], []
    for j in range(k + 1):
        v, i = work.max(dim=0)  # first maximal index on ties
        vals.append(v)
        idxs.append(i)
        if j < k:
            work.scatter_(0, i[None], float("-inf"))
    return torch.stack(vals), torch.stack(idxs)


_WORKSPACE_MAX_BYTES = 64 << 20  # per thread: the CPU work buffers kept between solves
_workspace = threading.local()


def release_work_buffers() -> None:
    """Free the CPU work buffers this thread keeps for its next solve of the same shape (up to
    64 MB; `balanced_assignment` keeps them to avoid a page fault per 4 KiB on every call). The
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
    target_E: Tensor,
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
    tokens would pick it were the other prices fixed (the midpoint between two order statistics
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
        q = _row_quantiles(d, row_base, target_E, widths[min(i, len(widths) - 1)], _BINS_DENSE, work)
        step = omega * q
        p = p + step[:, None]
        last = step.abs().max()
    return p, last


def _above(a_ET: Tensor, floor_T: Tensor) -> Tensor:
    """Flat indices (row-major, ascending) of the entries of ``a`` above ``floor`` (one per
    column). On CPU through numpy, whose comparison and nonzero on an (E, T) array are several
    times faster than torch's there (measured: 15 against 130 us, 70 against 420 us at 64 x 4096)."""
    if a_ET.device.type != "cpu":
        return torch.nonzero((a_ET > floor_T).view(-1)).flatten()
    return torch.from_numpy(np.flatnonzero(a_ET.numpy() > floor_T.numpy()))


class _Pairs:
    """For K = 1: the (token, expert) pairs within ``width`` of each token's best under prices
    ``p0``, M of them, grouped by expert.

    Once the prices are roughly right, a token can only switch between experts close to its
    best, so the pairs further away are left out (about 1.5 to 3 pairs per token remain on
    typical scores). While no price has moved ``width`` more than another since ``p0``, no pair
    left out can beat a token's best pair, so the pairs alone give every token's pick. Every
    token's runner-up is taken as at least ``width`` below its best (the pairs left out were
    that far down under ``p0``; `select` lowers the margins by the prices' moves since). The
    order statistics of the updates are exact: each expert's values go to one row of an (E, L)
    table padded with -inf and the rows are sorted. Two host syncs (to list the pairs and to
    size the table).
    """

    def __init__(self, s_ET: Tensor, p0: Tensor, width: float, cap_E: Tensor, work: _Work) -> None:
        a = work.shifted(s_ET, p0)
        flat = _above(a, a.amax(dim=0) - width)
        self.s_M = s_ET.view(-1).index_select(0, flat)  # a flat gather: 10 against 120 us for s[e, t]
        self.p0, self.width, self.num_experts = p0, width, s_ET.shape[0]
        self.empty = s_ET.new_full((s_ET.shape[1],), float("-inf"))
        layout = _pair_layout_host if flat.device.type == "cpu" else _pair_layout
        self.e_M, self.t_M, self.cell_M, self.pick, size = layout(flat, s_ET.shape[1], cap_E)
        self.table = s_ET.new_full((self.num_experts, size), float("-inf"))
        self.cap_E = cap_E
        self.idle = cap_E == 0  # experts that take no token: their price only rises
        if s_ET.device.type == "cpu":  # `_quantiles` reads them in numpy there
            self.pick, self.idle = self.pick.numpy(), self.idle.numpy()

    def jacobi(self, p: Tensor, iters: int, omega: float = 0.7) -> Tensor:
        """The damped Jacobi updates of `_jacobi_prices` on the pairs, towards the capacities;
        a move is at most width. Each token's runner-up is found with float arithmetic rather
        than a mask (on CPU a comparison or ``where`` over the pairs costs 11-14 us, a float op
        2-3), floored at its best less the width. Unlike `_margins`, a token tied exactly at
        its best counts as holding every tied expert (margin m1 - m3 for each): this only
        shapes the price estimate; `select` gives such a token margin 0."""
        for _ in range(iters):
            a_M, m1, gap_M = self._best(p)
            rest = gap_M.sign().add_(1).mul_(-4.0).add_(a_M)  # 4 below at the best: under the floor
            m2 = (m1 - self.width).scatter_reduce_(0, self.t_M, rest, reduce="amax")
            # the margins of `_margins`: m1 - m2 at the best, the gap elsewhere
            d_M = gap_M.add_(a_M.sub_(m2.index_select(0, self.t_M)).relu_())
            p = torch.add(p, self._quantiles(d_M)[:, None], alpha=omega)
        return p

    def _best(self, p: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Pair scores under p (M,), each token's best (T,), and each pair's score less its
        token's best (M,: 0 at the best, else < 0)."""
        a_M = self.s_M - p.view(-1).index_select(0, self.e_M)
        m1 = self.empty.scatter_reduce(0, self.t_M, a_M, reduce="amax")
        return a_M, m1, a_M - m1.index_select(0, self.t_M)

    def _quantiles(self, d_M: Tensor) -> Tensor:
        """Where ``cap[e]`` of expert e's values lie above: the midpoint of the cap-th and
        (cap+1)-th largest, clamped to [-width, width] (width when it takes none), (E,). A
        missing (cap+1)-th value lies below the window: it counts at its edge, -width."""
        self.table.view(-1).index_copy_(0, self.cell_M, d_M)
        if self.table.device.type == "cpu":  # numpy: its row sort takes 19 against 240 us at 64 x 220
            pair = np.take_along_axis(np.sort(self.table.numpy(), axis=1), self.pick, axis=1)
            mid = np.maximum(pair, -self.width).sum(axis=1) * 0.5
            return torch.from_numpy(np.where(self.idle, self.width, np.minimum(mid, self.width)))
        rows = self.table.sort(dim=1).values
        mid = rows.gather(1, self.pick).clamp_(min=-self.width).sum(dim=1).mul_(0.5)
        return torch.where(self.idle, self.width, mid.clamp_(max=self.width))

    def select(self, p: Tensor) -> tuple[Tensor, Tensor] | None:
        """`_select` for K = 1 from the pairs, or None when the prices moved too far for them."""
        moved = p - self.p0
        spread = float(moved.max() - moved.min())
        if spread >= self.width:
            return None
        a_M, m1, gap_M = self._best(p)
        at_best = self.e_M - gap_M.sign().long() * self.num_experts  # E added where not the best
        idx = self.t_M.new_full(m1.shape, self.num_experts)
        idx = idx.scatter_reduce(0, self.t_M, at_best, reduce="amin")  # lowest expert on ties
        # the runner-up is the best of the other pairs: a token tied at its best gets margin 0
        rest = torch.where(at_best == idx.index_select(0, self.t_M), float("-inf"), a_M)
        m2 = (m1 - self.width).scatter_reduce_(0, self.t_M, rest, reduce="amax")
        # a pair left out was width below the best under p0; since then it may have gained the
        # spread of the price moves, so the margin is only known to be at least width - spread
        margin = (m1 - m2).clamp_(max=self.width - spread)
        return _keep_best(idx, margin, self.cap_E)[:, None], margin


def _pair_layout(flat_M: Tensor, num_tokens: int, cap_E: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """Where the pairs at ``flat`` (ascending flat indices into an (E, T) array, so grouped by
    expert) sit: their experts and tokens (M,), their cells in an (E, L) table (row e holds
    expert e's pairs, from column 0), the table's columns of the cap-th and (cap+1)-th largest
    value once its rows are sorted up (E, 2), and L: more than every expert's pair count and
    cap, so both values lie in the row (-inf where missing). One host sync (L)."""
    num_experts = cap_E.shape[0]
    rows = torch.arange(num_experts, device=flat_M.device)
    count = torch.searchsorted(flat_M, torch.arange(num_experts + 1, device=flat_M.device) * num_tokens).diff()
    size = int(torch.maximum(count, cap_E).max()) + 1
    num_pairs = flat_M.numel()
    e_M = torch.repeat_interleave(rows, count, output_size=num_pairs)
    first = count.cumsum(0) - count
    cell_M = torch.repeat_interleave(rows * size - first, count, output_size=num_pairs)
    cell_M += torch.arange(num_pairs, device=flat_M.device)
    at = (size - cap_E).clamp_(max=size - 1)
    return e_M, flat_M - e_M * num_tokens, cell_M, torch.stack([at, at - 1], dim=1), size


def _pair_layout_host(flat_M: Tensor, num_tokens: int, cap_E: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """`_pair_layout` in numpy (CPU tensors; 60 against 160 us for the torch ops it replaced, at M = 8000)."""
    flat, cap = flat_M.numpy(), cap_E.numpy()
    num_experts = cap.shape[0]
    count = np.diff(np.searchsorted(flat, np.arange(num_experts + 1) * num_tokens))
    size = int(np.maximum(count, cap).max()) + 1
    e = np.repeat(np.arange(num_experts), count)
    cell = np.repeat(np.arange(num_experts) * size - (np.cumsum(count) - count), count) + np.arange(flat.size)
    at = np.minimum(size - cap, size - 1)
    pick = np.stack([at, at - 1], axis=1)
    return tuple(torch.from_numpy(v) for v in (e, flat - e * num_tokens, cell, pick)) + (size,)


def _keep_best(idx_T: Tensor, margin_T: Tensor, cap_E: Tensor) -> Tensor:
    """K = 1: each expert over capacity keeps its tokens with the largest margins (ties: lowest
    token index) and the others get -1. Only the tokens of such experts are ranked."""
    if idx_T.device.type == "cpu":  # numpy: a third of the time of the torch ops
        return torch.from_numpy(_keep_best_host(idx_T.numpy(), margin_T.numpy(), cap_E.numpy()))
    return _keep_best_device(idx_T, margin_T, cap_E)


def _keep_best_device(idx_T: Tensor, margin_T: Tensor, cap_E: Tensor) -> Tensor:
    """`_keep_best` in torch ops."""
    num_experts = cap_E.shape[0]
    over = bincount(idx_T, num_experts) > cap_E
    sub = torch.nonzero(over[idx_T]).flatten()
    if sub.numel() == 0:
        return idx_T
    keep = drop_by_score(idx_T[sub, None], margin_T[sub, None], num_experts, cap_E)[:, 0]
    return idx_T.index_fill(0, sub[~keep], -1)


def _keep_best_host(idx_T: np.ndarray, margin_T: np.ndarray, cap_E: np.ndarray) -> np.ndarray:
    """`_keep_best` in numpy (a new array)."""
    over = np.bincount(idx_T, minlength=cap_E.shape[0]) > cap_E
    sub = np.flatnonzero(over[idx_T])
    idx_T = idx_T.copy()
    idx_T[sub[~keep_top_claims(idx_T[sub], margin_T[sub], cap_E)]] = -1
    return idx_T


def _prices(s_ET: Tensor, cap_E: Tensor, k: int, max_iters: int, work: _Work) -> tuple[Tensor, _Pairs | None]:
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
        return _jacobi_prices(s_ET, cap_E, k, max_iters, None, work=work)[0], None
    p, last = _jacobi_prices(s_ET, cap_E, k, 1, None, work=work)
    dense = 1
    if float(last) > 0.05:
        p, last = _jacobi_prices(s_ET, cap_E, k, 1, p, work=work)
        dense = 2
    pairs = _Pairs(s_ET, p, float(last.clamp(0.02, 0.05)), cap_E, work)  # wide enough for the moves still to come
    return pairs.jacobi(p, max_iters - dense), pairs


def _select(s_ET: Tensor, p: Tensor, k: int, cap_E: Tensor, work: _Work) -> tuple[Tensor, Tensor]:
    """Each token takes its K best experts under prices; a full expert keeps the tokens with the
    largest margins over their next choice (ties: lowest token index) and drops the rest.

    Returns (T, K) expert indices, -1 where a slot was dropped, and each token's margin (T,):
    how much better its K-th pick is than the next.
    """
    num_experts, num_tokens = s_ET.shape
    a = work.shifted(s_ET, p)
    if k == 1:  # fast path: no copy of the scores
        best, idx = a.max(dim=0)  # first maximal index on ties
        vals = torch.stack([best, _top2(a, work)[1]])
        idx = idx[None]
    else:
        vals, idx = _top_values(a, k)
    expert = idx[:k].T.reshape(-1)
    margin_TK = vals[:k] - vals[k]
    keep = drop_by_score(expert, margin_TK.T.reshape(-1), num_experts, cap_E)
    return torch.where(keep, expert, -1).view(num_tokens, k), margin_TK[k - 1]


def _swap_in(s_ET: Tensor, out: Tensor, t: int, deficit: Tensor) -> int:
    """Give token t one more slot when every expert with room already holds t.

    Some other token u moves from an expert f (that t lacks) to an expert d with room (that u
    lacks), and t takes f. Such a (u, f, d) always exists under the capacity rule of
    `expert_capacities` (docs/routing.md); the best-scoring one is applied in place. Returns u.
    """
    num_experts = s_ET.shape[0]
    held = held_mask(out, num_experts)
    f = out.clamp(min=0)  # (T, K): expert of each slot
    best, arg = None, None
    for d in torch.nonzero(deficit > 0).flatten().tolist():
        ok = (out >= 0) & ~held[:, t][f] & ~held[d][:, None]
        ok[t] = False
        gain = s_ET[f, t] - s_ET.gather(0, f.T).T + s_ET[d][:, None]
        gain = torch.where(ok, gain, float("-inf"))
        g, flat = gain.flatten().max(0)
        if bool(torch.isfinite(g)) and (best is None or g > best):
            best, arg = g, (int(flat) // out.shape[1], int(flat) % out.shape[1], d)
    if arg is None:
        raise RuntimeError("balanced_assignment: no feasible exchange found (capacities violate the balance rule)")
    u, j, d = arg
    slot = int(torch.nonzero(out[t] < 0)[0])
    out[t, slot] = out[u, j]
    out[u, j] = d
    return u


def _fill(s_ET: Tensor, out: Tensor, cap_E: Tensor, p: Tensor | None = None) -> list[int]:
    """Complete a partial assignment in place, greedily: each pass gives every short token its
    best expert with room under prices ``p`` (experts keep the claimants with the largest
    margins); when a pass places nothing (every expert with room already holds the short
    tokens) one exchange (`_swap_in`) makes room. The passes run on the host, over the short
    tokens; at most T * K of them. Returns the tokens such exchanges moved (they were complete).
    """
    num_experts = s_ET.shape[0]
    prices = np.zeros(num_experts) if p is None else p.detach().double().cpu().numpy().ravel()
    cap = cap_E.cpu().numpy()
    on_host = out.device.type == "cpu"
    slots = _host(out)  # on CPU out's own memory, elsewhere a copy written back at the end
    moved = []
    while True:
        short = np.flatnonzero((slots < 0).any(axis=1))
        if short.size == 0:
            break
        deficit = cap - np.bincount(slots[slots >= 0], minlength=num_experts)
        sub = slots[short]
        cols = torch.from_numpy(short).to(s_ET.device)
        fill_passes(s_ET.index_select(1, cols).double().cpu().numpy(), sub, deficit, prices)
        slots[short] = sub
        stuck = np.flatnonzero((sub < 0).any(axis=1))
        if stuck.size:
            if not on_host:
                out.copy_(torch.from_numpy(slots))
            moved.append(_swap_in(s_ET, out, int(short[stuck[0]]), cap_E - _loads(out, num_experts)))
            if not on_host:
                slots = _host(out)
    if not on_host:
        out.copy_(torch.from_numpy(slots))
    return moved


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


def _round_robin(num_tokens: int, num_experts: int, k: int, device) -> Tensor:
    """A feasible balanced assignment: slot i (token-major) goes to expert i mod E."""
    return (torch.arange(num_tokens * k, device=device) % num_experts).view(num_tokens, k)


def balanced_assignment(
    scores_TE: Tensor,
    k: int = 1,
    *,
    max_iters: int = 6,
    eps: float = 1e-6,
    max_cycles: int | None = None,
) -> Tensor:
    """Assign every token K distinct experts with exactly balanced loads, maximising the score.

    Args:
        scores_TE: (T, E) finite floating scores (higher is better). Not differentiated.
        k: experts per token, 1 <= k <= E.
        max_iters: price iterations (damped Jacobi). Up to three more rounds of as many run
            when the pick under the prices still drops over 1% of the slots and over E of
            them (tie-heavy scores).
        eps: resolution, relative to the largest per-token score range R: an exchange cycle is
            applied only when it gains more than ``eps * R`` per move, and ties are split by a
            deterministic jitter below ``eps * R / 2``. Finite and > 0.
        max_cycles: cap on the exchange cycles applied; None allows T * K + E.

    Returns:
        expert_idx (T, K) int64. Expert e receives exactly ``expert_capacities(T, E, k)[e]``
        tokens (loads differ by at most one; the extra tokens go to the lowest-index experts),
        and no token holds an expert twice. When the certificate passes (always, unless the
        cycle cap is reached, which raises a warning) the total score is within
        ``2 * T * K * eps * R`` of the optimum.

    Algorithm (docs/routing.md): estimate the E dual prices; every token picks its K best experts
    under them, full experts keep their highest-margin tokens and the dropped slots go to the
    best experts with room; then exchange cycles between experts remove every improvement, and
    a check of every token the final prices could fault certifies the result. Every loop is
    bounded, and the output is a deterministic function of the input.

    Host syncs: none inside the price iterations; one for the normalisation, one or two to
    decide how many full price updates to run, two to list the pairs near each token's best and
    size their table, a few for the pick and the refill, a few copies of the candidates' scores
    and slots to the host (the refill and the exchange-cycle search run there, in numpy, on
    (E, C) and (E, E) arrays) and their slots back, and a few per certificate check (usually one check). A
    bounded number, whatever the input.
    """
    trivial = _nothing_to_solve(scores_TE, k, max_iters, max_cycles, eps, check_finite=True)
    if trivial is not None:
        return trivial
    num_tokens, num_experts = scores_TE.shape
    device = scores_TE.device
    with torch.inference_mode():  # cheaper per op than no_grad; the result is cloned out of it
        work = _Work(scores_TE, sync_ok=True)
        s = _normalise(scores_TE, jitter=eps / 2, work=work)
        cap = expert_capacities(num_tokens, num_experts, k, device=device)
        p, pairs = _prices(s, cap, k, max_iters, work)
        picked = None if pairs is None else pairs.select(p)
        out, margin = _select(s, p, k, cap, work) if picked is None else picked
        for _ in range(3):  # many dropped slots (tie-heavy scores): the prices need more updates
            if int((out < 0).sum()) <= max(num_tokens * k // 100, num_experts):
                break
            p = _jacobi_prices(s, cap, k, max(max_iters, 2), p, work=work)[0]
            out, margin = _select(s, p, k, cap, work)
        # candidates for exchange cycles: tokens near a boundary under p, and those refilled
        near = (margin < 0.005) | (out < 0).any(dim=1)
        swapped = _fill(s, out, cap, p)
        if swapped:  # moved off their best experts by the fill's exchanges
            near[swapped] = True
        budget = num_tokens * k + num_experts if max_cycles is None else max_cycles
        delta = max(eps, 8 * torch.finfo(s.dtype).eps)  # below this, gains are rounding noise
        candidates = torch.nonzero(near).flatten()
        if not cancel_cycles(s, out, max_cycles=budget, delta=delta, candidates=candidates, basis=(p, margin)):
            warnings.warn(
                f"balanced_assignment: the exchange-cycle budget (max_cycles={budget}) ran out before the "
                "optimality certificate passed; the assignment is balanced but may be suboptimal",
                RuntimeWarning,
                stacklevel=2,
            )
    return out.clone()  # a normal tensor: an inference tensor cannot be saved for backward


_APPROX_WIDTHS = (1.0, 1.0, 0.25, 0.1, 0.05, 0.03)  # price-update windows of the sync-free solver


def balanced_assignment_approx(scores_TE: Tensor, k: int = 1, *, max_iters: int = 12, eps: float = 1e-6) -> Tensor:
    """`balanced_assignment` without a single host sync: exact balance, near-optimal.

    The same loads as `balanced_assignment` (``expert_capacities(T, E, k)``) and K distinct
    experts per token, with every shape fixed by (T, E, K) and no value read back, so on CUDA the
    host never waits for the device (what the expert-parallel static path needs:
    docs/parallel.md). The price is optimality: the prices from ``max_iters`` damped Jacobi
    updates give the pick, rounds of bids place the dropped slots with the best experts that
    still have room, and `_complete` places the rest. No exchange cycles, so no certificate: the
    gap to the optimum is measured in docs/benchmarks.md. NaN and Inf are not detected here
    (that needs a sync; the routers check their input): NaN counts as the lowest score, +-Inf
    as the largest finite ones, and the result is still a balanced assignment.
    """
    trivial = _nothing_to_solve(scores_TE, k, max_iters, None, eps, check_finite=False)
    if trivial is not None:
        return trivial
    num_tokens, num_experts = scores_TE.shape
    device = scores_TE.device
    with torch.no_grad():
        work = _Work(scores_TE)
        s = _normalise_nosync(scores_TE, jitter=eps / 2, work=work)
        cap = expert_capacities(num_tokens, num_experts, k, device=device)
        # ever finer windows as the prices settle (measured: half the gap of width 1)
        p = _jacobi_prices(s, cap, k, max_iters, None, work=work, widths=_APPROX_WIDTHS)[0]
        out, margin = _select(s, p, k, cap, work)
        out = _bids(work.shifted(s, p), out, cap, rounds=k + 2)
        return _complete(out, cap, margin)[0]


def _loads(out_TK: Tensor, num_experts: int) -> Tensor:
    """(E,) slots each expert holds (-1 slots hold none), without a host sync."""
    return bincount(torch.where(out_TK < 0, num_experts, out_TK), num_experts + 1)[:num_experts]


def _bids(a_ET: Tensor, out_TK: Tensor, cap_E: Tensor, rounds: int) -> Tensor:
    """``rounds`` rounds in which every token with an empty slot bids for its best expert under
    ``a`` (score minus price) that has room and that it does not hold; each expert keeps its best
    bids up to its room (ties: lowest token index), and a winner fills its first empty slot.
    Fixed shapes, no host sync; returns the new (T, K) assignment."""
    num_experts, num_tokens = a_ET.shape
    tokens = torch.arange(num_tokens, device=a_ET.device)
    out = out_TK.clone()
    none = cap_E.new_zeros(1)
    for _ in range(rounds):
        room = cap_E - _loads(out, num_experts)
        open_ET = ~held_mask(out, num_experts) & (room[:, None] > 0)
        val, best = torch.where(open_ET, a_ET, float("-inf")).max(dim=0)
        bidding = (out < 0).any(dim=1) & (val > float("-inf"))
        bid = torch.where(bidding, best, num_experts)  # the others go to bin E, whose room is 0
        won = drop_by_score(bid[:, None], val[:, None], num_experts + 1, torch.cat([room, none]))[:, 0]
        slot = (out < 0).to(torch.uint8).argmax(dim=1)  # the first empty slot
        out[tokens, slot] = torch.where(won, best, out[tokens, slot])
    return out


def _complete(out_TK: Tensor, cap_E: Tensor, margin_T: Tensor) -> tuple[Tensor, Tensor]:
    """Fill every empty slot with fixed shapes and no host sync, keeping exact balance and
    distinct experts.

    Every token with an empty slot gives up all its slots (n tokens), so the free places R[e]
    sum to n * K. Listed by expert, the free places go out column by column over those tokens
    in index order: place i to token i mod n. A token's places are n apart, so it gets distinct
    experts whenever no expert has more than n free places. An expert with R[e] > n needs more
    tokens to take its places: complete tokens give up their slots too, in order of how few
    such experts they hold, then of margin, up to the shortest prefix after which every such
    expert e has at least R[e] - n of them that do not hold it. That keeps every expert within
    the bound (a token holds an expert at most once), and all complete tokens always suffice
    (docs/routing.md). The result is checked on the device, and the round robin (balanced,
    distinct, score-blind) replaces it should the check fail. Returns the assignment and the
    check's flag (a bool tensor)."""
    num_tokens, k = out_TK.shape
    num_experts = cap_E.shape[0]
    device = out_TK.device
    short = (out_TK < 0).any(dim=1)
    out = torch.where(short[:, None], -1, out_TK)
    over = cap_E - _loads(out, num_experts) - short.sum()  # free places beyond n
    crowded = over > 0
    free_of = ~held_mask(out, num_experts) & crowded[:, None]  # (E, T): token t does not hold crowded e
    busy = torch.where(short, num_experts + 1, (crowded[:, None] & ~free_of).sum(dim=0))  # short tokens last
    order = torch.sort(margin_T, stable=True).indices
    order = order[torch.sort(busy[order], stable=True).indices]  # by crowded experts held, then margin
    enough = (free_of[:, order].cumsum(dim=1) >= over[:, None]) | ~crowded[:, None]
    length = torch.where(crowded.any(), enough.all(dim=0).to(torch.uint8).argmax() + 1, 0)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(num_tokens, device=device))
    give_up = short | (rank < length)
    out = torch.where(give_up[:, None], -1, out)
    n = give_up.sum()
    members = torch.sort((~give_up).to(torch.uint8), stable=True).indices  # those tokens first, by index
    place = torch.arange(num_tokens * k, device=device)
    expert = torch.searchsorted(torch.cumsum(cap_E - _loads(out, num_experts), 0), place, right=True)
    per = n.clamp(min=1)
    target = torch.where(place < n * k, members[place % per] * k + place // per, num_tokens * k)  # the end: unused
    flat = torch.cat([out.reshape(-1), out.new_full((1,), -1)])
    flat.scatter_(0, target, expert.clamp_(max=num_experts - 1))
    out = flat[:-1].view(num_tokens, k)
    ok = (_loads(out, num_experts) == cap_E).all() & (out >= 0).all()
    if k > 1:
        ok &= (out.sort(dim=1).values.diff(dim=1) != 0).all()
    return torch.where(ok, out, _round_robin(num_tokens, num_experts, k, device)), ok


def balanced_assignment_ref(scores_TE: Tensor, k: int = 1, *, eps: float = 1e-9) -> Tensor:
    """Reference solver: a round-robin balanced start, then exchange cycles over all tokens
    until none gains more than ``eps`` (relative to the largest per-token score range) per move.

    Exactly optimal up to that resolution; slow (one search per step), for tests and small
    inputs. Raises RuntimeError if it has not converged after 10 * T * K + 100 cycles.
    """
    _check(scores_TE, k)
    _check_options(0, None, eps)
    num_tokens, num_experts = scores_TE.shape
    out = _round_robin(num_tokens, num_experts, k, scores_TE.device)
    if num_tokens == 0:
        return out
    with torch.no_grad():
        s = _normalise(scores_TE.double(), jitter=0.0)  # the round robin is balanced by the same rule
        delta = max(eps, 8 * torch.finfo(s.dtype).eps)
        if not cancel_cycles(s, out, max_cycles=10 * num_tokens * k + 100, delta=delta):
            raise RuntimeError("balanced_assignment_ref did not converge")
    return out
