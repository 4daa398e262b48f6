"""For K = 1: the (token, expert) pairs near each token's best, on which the later price
updates and the pick run.

Legend: T tokens, E experts, M pairs kept.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..common import bincount, drop_by_score
from ..exchange import keep_top_claims
from .buffers import _Work
from .capacities import _Capacities


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

    def __init__(self, s_ET: Tensor, p0: Tensor, width: float, caps: _Capacities, work: _Work) -> None:
        a = work.shifted(s_ET, p0)
        flat = _above(a, a.amax(dim=0) - width)
        self.s_M = s_ET.view(-1).index_select(0, flat)  # a flat gather: 10 against 120 us for s[e, t]
        self.p0, self.width, self.num_experts = p0, width, s_ET.shape[0]
        self.empty = s_ET.new_full((s_ET.shape[1],), float("-inf"))
        layout = _pair_layout_host if flat.device.type == "cpu" else _pair_layout
        self.e_M, self.t_M, self.cell_M, self.pick, self.size = layout(flat, s_ET.shape[1], caps.upper)
        self.table = s_ET.new_full((self.num_experts, self.size), float("-inf"))
        self.caps, self.aimed = caps, None
        self.idle = caps.upper == 0  # experts that take no token: their price only rises
        if s_ET.device.type == "cpu":  # `_quantiles` reads them in numpy there
            self.pick, self.idle = self.pick.numpy(), self.idle.numpy()

    def _aim(self, p: Tensor) -> None:
        """Aim `_quantiles` at the capacities under prices ``p`` (`_Capacities.at`) rather than
        at those of the layout (``upper``): the table columns it reads, and which experts take
        no token."""
        if self.table.device.type == "cpu":  # numpy, as `_quantiles` reads them there: a few us
            if self.aimed is None:  # the columns for b and for b + 1 tokens, made once
                at = np.minimum(self.size - np.array([self.caps.base, self.caps.base + 1]), self.size - 1)
                self.aimed = np.array([[at[0], at[0] - 1]]), np.array([[at[1], at[1] - 1]])
            order = np.argsort(-p.numpy().ravel(), kind="stable")  # the r highest prices take one more
            extra = np.zeros(order.size, dtype=bool)
            extra[order[: self.caps.spare]] = True
            self.pick = np.where(extra[:, None], *self.aimed[::-1])
            self.idle = ~extra if self.caps.base == 0 else np.zeros_like(extra)
            return
        cap = self.caps.at(p)
        at = (self.size - cap).clamp_(max=self.size - 1)
        self.pick, self.idle = torch.stack([at, at - 1], dim=1), cap == 0

    def jacobi(self, p: Tensor, iters: int, omega: float = 0.7) -> Tensor:
        """The damped Jacobi updates of `_jacobi_prices` on the pairs, towards the capacities;
        a move is at most width. Each token's runner-up is found with float arithmetic rather
        than a mask (on CPU a comparison or ``where`` over the pairs costs 11-14 us, a float op
        2-3), floored at its best less the width. Unlike `_margins`, a token tied exactly at
        its best counts as holding every tied expert (margin m1 - m3 for each): this only
        shapes the price estimate; `select` gives such a token margin 0."""
        for _ in range(iters):
            if self.caps.movable:
                self._aim(p)
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

    def select(self, p: Tensor, cap_E: Tensor) -> tuple[Tensor, Tensor] | None:
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
        return _keep_best(idx, margin, cap_E)[:, None], margin


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
