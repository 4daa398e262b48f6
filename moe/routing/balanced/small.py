"""Small CPU problems at K = 1: the whole solve in numpy, with exact order statistics.

Legend: T tokens, E experts.

Up to T * E = `SMALL` a solve's torch ops cost more in dispatch than in arithmetic (at
T = 1024, E = 8 about 400 ops of 2-3 us, most of the solve), so here every step runs on the
host. The prices: the damped Jacobi updates of `prices._jacobi_prices` (every expert's price
to where its load of tokens would pick it, the other prices fixed), with the exact order
statistics of each expert's margins (a partition of its row) where the torch path reads a
histogram, stopping once the pick under the prices fills every expert exactly. Such a pick is
optimal as it stands: every token holds its best expert under the prices and every expert its
load, so the pick meets the prices' bound (`assignment_bound`). Otherwise the fill, the
exchange cycles (`cycle_graph._Graph`) and the certificate follow as in `exact`, on numpy arrays,
the certificate reading every token (a few microseconds at this size).
"""

from __future__ import annotations

import numpy as np

from ..cycle_graph import _Graph
from ..exchange import fill_passes
from .capacities import _Capacities
from .pairs import _keep_best_host

SMALL = 1 << 14  # largest T * E solved here (CPU, K = 1): measured faster up to 2048 x 8, 1024 x 16


def _top2_host(a_ET: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Largest and second largest entry of every column (T,), (T,), E >= 2, by a tournament of
    elementwise max and min over halves of the rows (a partition along the experts takes 4x
    longer at E = 8)."""
    hi, lo = a_ET, None
    while hi.shape[0] > 1:
        n = hi.shape[0]
        h = n // 2
        x, y = hi[:h], hi[h : 2 * h]
        big, small = np.maximum(x, y), np.minimum(x, y)
        if lo is not None:  # a pair's runner-up: the smaller top or the larger runner-up
            np.maximum(small, np.maximum(lo[:h], lo[h : 2 * h]), out=small)
        if n % 2:  # the odd row joins the first pair
            odd = hi[n - 1]
            np.maximum(small[0], np.minimum(big[0], odd), out=small[0])
            if lo is not None:
                np.maximum(small[0], lo[n - 1], out=small[0])
            np.maximum(big[0], odd, out=big[0])
        hi, lo = big, small
    return hi[0], lo[0]


class _HostPrices:
    """The state of the host updates: the prices (E,) and, under them, the scores less the
    prices and every token's best and second best of those."""

    def __init__(self, s_ET: np.ndarray, caps: _Capacities) -> None:
        self.s, self.caps = s_ET, caps
        num_tokens = s_ET.shape[1]
        # a row's b + 2 largest margins hold the order statistics of the loads b and b + 1
        # (`_Capacities`): from this ascending position on
        self.top_from = max(num_tokens - caps.base - 2, 0)
        self.p = np.zeros(s_ET.shape[0], dtype=s_ET.dtype)
        self.rows = np.arange(s_ET.shape[0])
        self.cap = caps.at_host(self.p)
        self.d = np.empty_like(s_ET)
        self._look()

    def _look(self) -> None:
        """The scores less the prices, their two largest per token, and the margins
        (`prices._margins`: m1 - m2 at the best, a - m1 elsewhere) in ``d``."""
        self.a = self.s - self.p[:, None]
        self.m1, self.m2 = _top2_host(self.a)
        np.subtract(self.a, self.m1 + self.m2, out=self.d)
        np.maximum(self.d, -self.m1, out=self.d)
        self.d += self.a

    def balanced(self) -> bool:
        """Does every expert lead exactly its capacity of tokens? A margin is > 0 only at a
        token's one best expert, so with ties the counts sum to less than T and some differ.
        Rounding may also take a near tie's margin to 0: a pick that is balanced then reads as
        not, and the cycles run (slower, never wrong)."""
        return bool(((self.d > 0).sum(axis=1) == self.cap).all())

    def update(self, omega: float = 0.7) -> None:
        """One damped Jacobi update: expert e's price moves to the midpoint of the cap-th and
        (cap+1)-th largest of its margins, clamped to [-1, 1] as the dense update's window,
        times ``omega``; an expert whose capacity is 0 (T < E) rises by ``omega``."""
        num_tokens, cap, first = self.s.shape[1], self.cap, self.top_from
        # one partition and a sort of the few largest: 1.5x faster than a partition at 3 places
        self.d.partition(first, axis=1)  # the margins are made again from the prices
        top = np.sort(self.d[:, first:], axis=1)
        rows = self.rows
        hi_at = num_tokens - np.maximum(cap, 1) - first  # the cap-th largest
        upper = top[rows, hi_at]
        lower = np.where(cap >= num_tokens, upper - 1.0, top[rows, np.maximum(hi_at - 1, 0)])
        q = np.clip(0.5 * (upper + lower), -1.0, 1.0)
        self.p = self.p + omega * np.where(cap == 0, 1.0, q).astype(self.p.dtype)
        if self.caps.movable:
            self.cap = self.caps.at_host(self.p)
        self._look()

    def pick(self) -> tuple[np.ndarray, np.ndarray]:
        """Every token's best expert under the prices, -1 where a full expert dropped it (it
        keeps the tokens with the largest leads), and each token's lead (T,)."""
        margin = self.m1 - self.m2
        return _keep_best_host(self.a.argmax(axis=0), margin, self.cap), margin


def host_prices(state: _HostPrices, iters: int) -> _HostPrices:
    """Up to ``iters`` updates of ``state`` (`_HostPrices.update`), stopping once the pick
    fills every expert exactly."""
    for _ in range(iters):
        if state.balanced():
            break
        state.update()
    return state


def host_finish(
    state: _HostPrices, out_T: np.ndarray, margin_T: np.ndarray, delta: float, budget: int, start: bool = False
) -> tuple[bool, np.ndarray]:
    """The fill and the exchange cycles of `exact` on the host, in place on ``out`` (T,): the
    dropped tokens take their best experts with room, cycles run among the tokens near a
    boundary, and every token is checked against the cycles' final prices (at this size one
    pass over all of them); where some fail, the candidates grow (the failing ones and those
    within a doubling band) and the cycles go on. Returns False when ``budget`` cycles ran out
    first (else True), and the cycles' final prices (E,). ``start``: the searches end from the
    state's prices (`exchange._cancel`), not from zeros."""
    s, caps = state.s, state.caps
    num_experts = s.shape[0]
    out = out_T[:, None]  # (T, 1) view: `fill_passes` and the graph take (N, K) slots
    short = np.flatnonzero(out_T < 0)
    if short.size:  # K = 1: a dropped token holds nothing, so every expert with room takes it
        deficit = state.cap - np.bincount(out_T[out_T >= 0], minlength=num_experts)
        sub = out[short]
        fill_passes(s[:, short], sub, deficit, state.p)
        out[short] = sub
    near = margin_T < 0.005
    near[short] = True
    tok = np.flatnonzero(near)
    band, applied = 0.005, 0
    rows = np.arange(s.shape[1])
    while True:
        extra = np.bincount(out_T, minlength=num_experts) > caps.base if caps.movable else None
        graph = _Graph(s[:, tok], out[tok], delta, extra)
        done, n, dist = graph.cancel(budget - applied, state.p if start else None)  # read, not written
        applied += n
        out[tok] = graph.out
        if not done:
            return False, dist
        a = s - dist.astype(s.dtype)[:, None]
        held = a[out_T, rows]
        a[out_T, rows] = -np.inf
        gap = held - a.max(axis=0)  # each token's lead over its best other expert (< 0: behind)
        bad = np.flatnonzero(gap < -delta)
        if bad.size == 0 or near[bad].all():  # candidates pass by construction
            return True, dist
        band *= 2  # grow geometrically: a few rebuilds at most
        near |= gap < band
        tok = np.flatnonzero(near)
