"""The experts' prices of a distributed balanced assignment, agreed through histograms.

Legend: W ranks, T tokens of one shard, E experts, K experts per token, B histogram bins.

Damped Jacobi as in the single-process solver (docs/routing.md): every expert's price moves
towards the value at which exactly ``cap[e]`` tokens of the whole group would pick it if the
other prices stayed put. That value is an order statistic of the tokens' thresholds
``v[e, t]`` (token t takes e while the price of e is below it), and the ranks find it without
showing each other a token: each counts its thresholds into B bins of a window around the
current price, one sum of E x (B + 2) int32 counts per update (per chain of updates where
several run side by side: `jacobi_prices`), and the price moves to where the
counts cross the capacity (values taken as evenly spread within a bin; outside the window,
to its edge). The window narrows with the moves, so the resolution follows the convergence.
The same counts give every expert's load at the current prices, which decides when to stop.

Where the updates stall (`pair_prices`), a few rounds count the tokens by the pair of experts
they stand between instead, which sees how one expert's move pulls on another's load.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from ..routing.balanced import _Capacities
from ..routing.balanced.threads import solve_threads
from .reduction import Reduction

BINS = 16  # per expert and update: E * (BINS + 2) counts travel (64 took as many updates at 3.7x the bytes)
OMEGA = 0.7  # damping, as in the single-process solver
COLD_WIDTH = 1.0  # the window's half-width from p = 0: thresholds lie in [-1, 1]
WARM_WIDTH = 0.02  # from the previous call's prices; grows when a move reaches its edge
STALL = 0.8  # stalled: two updates left more than this share of the miss
MIN_BAND = 1e-6  # the margin's least band (`price_margin`)
GAP_BINS = 32  # the tokens counted by their margin, in bins growing 2x from MIN_BAND


def chain_values(num_experts: int) -> int:
    """The int32 counts one chain's update sums per rank: its histogram, its tokens by margin."""
    return num_experts * (BINS + 2) + GAP_BINS + 1


def thresholds(s_ET: Tensor, p_E1: Tensor, k: int) -> Tensor:
    """(E, T): the price of e below which token t keeps e among its K best under the other
    prices: ``s[e, t]`` less the K-th best ``s - p`` of the other experts."""
    return _thresholds(s_ET, p_E1, k)[0]


def _thresholds(s_ET: Tensor, p_E1: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """`thresholds`, and each token's margin (T,): its K-th best ``s - p`` less the next, the
    same values as `pick`'s."""
    a = s_ET - p_E1
    if k == 1:  # the two largest by two maxima: the same values as topk's, in about 0.6 of its time
        best = a.amax(0)
        mine = a == best
        second = torch.where(mine.sum(0) > 1, best, a.masked_fill(mine, float("-inf")).amax(0))
        return s_ET - torch.where(mine, second, best), best - second
    vals = torch.topk(a, k + 1, dim=0).values  # (K+1, T), descending
    mine = a >= vals[k - 1]  # e is among t's K best (ties: both count as held, both see vals[k])
    return s_ET - torch.where(mine, vals[k], vals[k - 1]), vals[k - 1] - vals[k]


_GAP_EDGES = MIN_BAND * 2.0 ** torch.arange(GAP_BINS, dtype=torch.float64)


def gap_edges() -> Tensor:
    """(GAP_BINS,) float64: the upper edges of `gap_counts`' bins, ``MIN_BAND * 2**i`` (the last
    far above 4, where the margin is the whole problem). Read only."""
    return _GAP_EDGES


def gap_counts(margin_T: Tensor) -> Tensor:
    """(GAP_BINS + 1,) int64: the tokens by their margin, bin i holding those below edge i
    (`gap_edges`) and not below the edge before (the last: at or above every edge)."""
    at = torch.bucketize(margin_T, gap_edges().to(margin_T.device, margin_T.dtype), right=True)
    return torch.bincount(at, minlength=GAP_BINS + 1)


def capacities(caps: _Capacities, p_E: Tensor) -> Tensor:
    """(E,) int64 loads aimed at under prices ``p`` (the r highest take the extras under
    ``"best"``), on p's device."""
    if not caps.movable:
        return caps.fixed.to(p_E.device)
    return torch.from_numpy(caps.at_host(p_E.cpu().numpy())).to(p_E.device)


def _histogram(v_ET: Tensor, top_E1: Tensor, h_E1: Tensor) -> Tensor:
    """(E, B + 2) int32 counts: above the window, its B bins from the top, below it. Overwrites
    ``v`` (each bin's key is made in place: whole numbers below 2^24, exact in float32)."""
    num_experts = v_ET.shape[0]
    first = torch.arange(num_experts, device=v_ET.device, dtype=v_ET.dtype)[:, None] * (BINS + 2) + 1
    key = torch.sub(top_E1, v_ET, out=v_ET).div_(h_E1).floor_().clamp_(-1, BINS).add_(first)
    counts = torch.bincount(key.reshape(-1).long(), minlength=num_experts * (BINS + 2)).view(num_experts, BINS + 2)
    return counts.to(torch.int32)  # a group's tokens fit: half the bytes on the wire


def _crossing(counts_EB: Tensor, cap_E: Tensor, top_E: Tensor, h_E: Tensor) -> Tensor:
    """(E,) the price at which ``cap`` thresholds lie above it, from the window's counts."""
    cum = counts_EB.cumsum(1)
    j = (cum < cap_E[:, None]).sum(1)  # first column whose running count reaches cap
    inside = (j > 0) & (j <= BINS)
    jb = (j - 1).clamp(0, BINS - 1)
    before = torch.where(j > 0, cum.gather(1, (j - 1).clamp(min=0)[:, None])[:, 0], 0)
    n = counts_EB.gather(1, j.clamp(max=BINS + 1)[:, None])[:, 0].clamp(min=1)
    within = top_E - jb * h_E - h_E * (cap_E - before) / n
    q = torch.where(j == 0, top_E, top_E - BINS * h_E)  # outside the window: its edge
    return torch.where(inside, within, q)


class _Chain:
    """One sequence of price updates (`jacobi_prices`): its prices, window, last move, the
    loads' miss after each of its updates, and why it stopped (None: running)."""

    def __init__(self, p_E: Tensor | None, num_experts: int, device) -> None:
        self.cold = p_E is None
        zeros = torch.zeros(num_experts, dtype=torch.float64, device=device)
        self.p = zeros if self.cold else p_E.to(device, torch.float64)
        self.width, self.step = (COLD_WIDTH if self.cold else WARM_WIDTH), 0.0
        self.misses: list[int] = []
        self.stop: str | None = None  # "converged", "stalled" or "capped"
        self.gaps: Tensor | None = None  # the group's tokens by margin (`gap_counts`) at p, once stopped

    def counts(self, s_ET: Tensor, k: int) -> Tensor:
        """This shard's counts at the chain's prices: its histogram (E x (B + 2)) in the window,
        then its tokens by margin (GAP_BINS + 1), int32."""
        w = torch.full((self.p.shape[0],), self.width, dtype=torch.float64, device=self.p.device)
        self.top, self.h = self.p + w, 2 * w / BINS
        dtype = s_ET.dtype
        v, margin = _thresholds(s_ET, self.p.to(dtype)[:, None], k)
        hist = _histogram(v, self.top.to(dtype)[:, None], self.h.to(dtype)[:, None])
        return torch.cat([hist.flatten(), gap_counts(margin).to(torch.int32)])

    def update(self, counts: Tensor, caps: _Capacities, tol: int) -> bool:
        """The summed counts (as `counts` makes them): measure the miss, stop or move. Whether
        it moved. A chain that stops keeps the tokens by margin at its prices."""
        num_experts = self.p.shape[0]
        counts_EB = counts[: num_experts * (BINS + 2)].view(num_experts, BINS + 2)
        cap_E = capacities(caps, self.p)
        loads = counts_EB[:, : BINS // 2 + 1].sum(1)  # thresholds above p: the tokens that pick e now
        self.misses.append(int((loads - cap_E).abs().sum()))
        if self.misses[-1] <= tol:
            self.stop = "converged"
        elif not self.cold and len(self.misses) >= 3 and self.misses[-1] > STALL * self.misses[-3]:
            self.stop = "stalled"
        if self.stop:
            self.gaps = counts[num_experts * (BINS + 2) :].cpu()
            return False
        move = OMEGA * (_crossing(counts_EB, cap_E, self.top, self.h) - self.p)
        self.p = self.p + move
        self.step = float(move.abs().max())
        self.width = min(COLD_WIDTH, max(4 * self.step, 1e-6))
        return True


def _leader(chains: list[_Chain]) -> _Chain:
    """The chain whose loads missed least when last measured (the first on a tie)."""
    return min(chains, key=lambda c: c.misses[-1] if c.misses else float("inf"))


def jacobi_prices(
    s_parts: list[Tensor],
    caps: _Capacities,
    k: int,
    red: Reduction,
    starts: list,
    *,
    max_iters: int,
    tol: int,
    late: tuple[list[Tensor], Callable[[Tensor], Tensor | None]] | None = None,
) -> tuple[Tensor, int, float, bool, int | None, int]:
    """Damped Jacobi prices over every rank's tokens, from each of ``starts`` (prices (E,), or
    None: zeros, a cold start) in the same collectives: one sum per update carries every
    running chain's counts (`chain_values`: E x (B + 2) + GAP_BINS + 1 int32, the last its
    tokens by margin, which the margin reads where the chain stopped at the prices it kept).
    ``late``: (per shard an int32 tensor, a function of their sum giving prices or None):
    summed with the first update's counts, and the prices it gives start one more chain from
    the second update.

    A chain stops once the loads under its prices miss the capacities by at most ``tol`` slots
    in all (converged), after ``max_iters`` updates, or, from given prices, once two updates
    have taken less than ``1 - STALL`` off its miss (stalled: on a trained router's scores the
    miss then falls a few percent an update, and each update is a round). The updates end once
    a chain has converged or every chain has stopped, and the one whose loads missed least when
    last measured (the leader; the first on a tie) is kept: the same choice as running each
    chain alone one after another, in the rounds of the longest. (Ending once the leader had
    stopped saved a few more rounds, but on a trained router's scores the chain behind it
    would have gone on to a smaller miss, and the margin grew by a third or more.) Returns the
    leader's prices (E,) float64 (the same on every
    rank: they follow from summed integer counts), the updates run (collectives after which a
    chain moved), its last move (what the prices are known to within, roughly), whether they
    converged, and its loads' last measured miss in slots (at the returned prices where it
    stopped early, at the ones before its last move where it reached ``max_iters``; None where
    no update ran), which chain it is: its index in ``starts``, or ``len(starts)`` for
    ``late``'s, and the group's tokens by margin at the returned prices (`gap_counts`), or
    None where it moved after its last count (it reached ``max_iters``)."""
    num_experts = s_parts[0].shape[0]
    chains = [_Chain(p, num_experts, s_parts[0].device) for p in starts]
    moved = 0
    for _ in range(max_iters):
        running = [c for c in chains if c.stop is None]
        parts = [torch.cat([c.counts(s, k) for c in running]).flatten() for s in s_parts]
        if late is not None:
            parts = [torch.cat([c, x.to(c.device)]) for c, x in zip(parts, late[0], strict=True)]
        summed = red.sum(parts)
        each = chain_values(num_experts)
        n = len(running) * each
        counts = summed[:n].long()  # int32 on the wire: a group's tokens fit
        if sum([c.update(m, caps, tol) for c, m in zip(running, counts.split(each), strict=True)]):
            moved += 1
        if late is not None:
            p_late = late[1](summed[n:].view(red.world, num_experts))
            late = None
            if p_late is not None:
                chains.append(_Chain(p_late, num_experts, s_parts[0].device))
        if any(c.stop == "converged" for c in chains) or all(c.stop is not None for c in chains):
            break
    else:
        for c in chains:
            c.stop = c.stop or "capped"
    best = _leader(chains)
    miss = best.misses[-1] if best.misses else None
    return best.p, moved, best.step, best.stop == "converged", miss, chains.index(best), best.gaps


# Where the Jacobi updates stall (a trained router: many experts within a hair of each other
# for most tokens, and clusters of near-equal tokens) every expert's own histogram misses how
# the others' moves pull on it. A few rounds then count the tokens by the pair of experts
# they stand between instead, and every rank moves the prices by the same small model.
PAIR_BINS = 4  # per expert pair and round: E x E x PAIR_BINS + E int32 counts travel
PAIR_ROUNDS = 3
PAIR_WINDOW = 4e-3  # the first round's window, in the normalised scores ([-1, 0] per token)
PAIR_SHRINK = 4.0  # the window narrows by this each round
PAIR_TRIES = 3  # pair rounds from the same prices, the first window halved each time the loads' miss grew
_MODEL_STEPS = 50  # Newton steps on the model, each rank alike (numpy, float64)


PAIR_TRY_ROUNDS = PAIR_ROUNDS + 1  # the rounds one try adds where it holds: its check is the margin's first sum


def pair_bytes(num_experts: int) -> int:
    """Bytes each rank receives over the `PAIR_ROUNDS` pair rounds and the loads that check
    them (one try of `pair_prices`; the margin's counts on the check are sent with or without
    them)."""
    return PAIR_ROUNDS * (num_experts * num_experts * PAIR_BINS + num_experts) * 4 + num_experts * 8


def pair_rounds_pay(num_experts: int, spared_bytes: float, round_bytes: float = 0.0) -> bool:
    """Whether the pair rounds cost less than the margin bytes they spare (``spared_bytes``):
    their counts plus their `PAIR_TRY_ROUNDS` collectives at ``round_bytes`` each (a round's
    latency as the bytes the link moves meanwhile; 0 weighs the bytes alone). The solver and
    the planner decide by this one rule."""
    return pair_bytes(num_experts) + PAIR_TRY_ROUNDS * round_bytes < spared_bytes


def pair_counts(s_ET: Tensor, p_E1: Tensor, k: int, window: float) -> Tensor:
    """(E * E * B + E,) int32: the tokens whose K-th expert under the prices is a, the next b,
    and their margin in bin j of [0, window), at ``(a * E + b) * B + j``; then every expert's
    load under the prices."""
    num_experts = s_ET.shape[0]
    vals, idx = torch.topk(s_ET - p_E1, k + 1, dim=0)
    gap = vals[k - 1] - vals[k]
    inside = gap < window
    j = (gap[inside] * (PAIR_BINS / window)).long().clamp_(max=PAIR_BINS - 1)
    key = (idx[k - 1][inside] * num_experts + idx[k][inside]) * PAIR_BINS + j
    pairs = torch.bincount(key, minlength=num_experts * num_experts * PAIR_BINS)
    loads = torch.bincount(idx[:k].flatten(), minlength=num_experts)
    return torch.cat([pairs, loads]).to(torch.int32)


def model_move(pairs_EEB: np.ndarray, excess_E: np.ndarray, window: float) -> np.ndarray:
    """(E,) the price moves D that balance the model: a token at a whose next expert is b at
    margin g moves to b once ``D[a] - D[b] > g`` (the counts spread evenly within a bin), and
    the loads then meet the capacities (``excess`` = loads - capacities). The model is the
    gradient of a convex function (a sum over pairs of the integrals of their counts, less
    ``excess . D``), minimised by damped Newton steps; every move stays within half the
    window before their mean is taken off (a penalty: the model knows no token beyond it), so
    within the window after. Stops once the loads meet the capacities to half a token, or the
    Newton step is below 1e-4 of the window. Deterministic: numpy on the host."""
    num_experts, _, bins = pairs_EEB.shape
    h = window / bins
    ia, ib = np.nonzero(pairs_EEB.sum(2))  # the pairs with tokens: the others add nothing
    n = np.arange(ia.size)
    below = np.concatenate([np.zeros((ia.size, 1)), pairs_EEB[ia, ib].cumsum(1)], 1)  # tokens under each bin edge
    area = np.concatenate([np.zeros((ia.size, 1)), (h * (below[:, 1:] + below[:, :-1]) / 2).cumsum(1)], 1)
    r = excess_E.astype(np.float64)
    mu = 1e3 * (np.abs(r).sum() + below[:, -1].sum() + 1) / window
    rows, cells = np.arange(num_experts), num_experts * num_experts

    def at(D, full=True):
        x = D[ia] - D[ib]
        xc = np.maximum(x, 0)
        j = np.minimum(np.floor(xc / h), bins - 1).astype(np.int64)
        t = xc - j * h
        c0, c1, a0 = below[n, j], below[n, j + 1], area[n, j]
        slope = (c1 - c0) / h
        over = xc > window
        f = np.where(over, below[:, -1], c0 + slope * t)
        g = np.where(over, area[:, -1] + below[:, -1] * (xc - window), a0 + c0 * t + slope * t * t / 2)
        d = np.where(over | (x <= 0), 0.0, slope)
        ex = np.maximum(np.abs(D) - window / 2, 0)
        value = g.sum() - r @ D + mu * (ex * ex).sum()
        if not full:
            return value, None, None
        grad = np.bincount(ia, f, num_experts) - np.bincount(ib, f, num_experts) - r + 2 * mu * ex * np.sign(D)
        hess = -(np.bincount(ia * num_experts + ib, d, cells) + np.bincount(ib * num_experts + ia, d, cells))
        hess = hess.astype(np.float64)  # no pair in the window: bincount's zeros are integers
        hess = hess.reshape(num_experts, num_experts)
        hess[rows, rows] += np.bincount(ia, d, num_experts) + np.bincount(ib, d, num_experts) + 2 * mu * (ex > 0)
        return value, grad, hess

    D = np.zeros(num_experts)
    for _ in range(_MODEL_STEPS):
        value, grad, hess = at(D)
        if np.abs(grad).max() < 0.5:
            break
        ridge = 1e-9 + 1e-6 * hess.diagonal().mean()
        # torch's solve, on the threads `solve_threads` chose: numpy's BLAS may start one a core
        step = torch.linalg.solve(torch.from_numpy(hess + ridge * np.eye(num_experts)), torch.from_numpy(-grad)).numpy()
        t = 1.0
        while t > 1e-6 and at(D + t * step, full=False)[0] > value + 1e-4 * t * (grad @ step):
            t /= 2
        D = D + t * step
        if np.abs(step).max() < 1e-4 * window:  # the full Newton step: near the minimum
            break
    return D - D.mean()


def pair_prices(
    s_parts: list[Tensor], caps: _Capacities, k: int, red: Reduction, p_E: Tensor, margin: Callable
) -> tuple[Tensor, int, float, object]:
    """`PAIR_ROUNDS` rounds of pair counts from prices ``p``, each moving them by
    `model_move`, the window narrowing by `PAIR_SHRINK`; then one max of the prices and the
    last move, so that every rank holds the same bits whatever its BLAS did, and one sum of
    the loads at them. That sum also carries the margin's first counts at them (``margin(q,
    last move)``: a `price_margin.MarginStart`, whose pick gives the loads), so where the try
    holds they need no round of their own. The model takes the counts as evenly spread within
    a bin, which a cluster of near-equal tokens is not: where the loads then miss the
    capacities by more than at ``p`` (the first round's loads), the rounds run again from ``p``
    with half the first window, at most `PAIR_TRIES` times in all. Returns (the prices (E,)
    float64, the collectives, the last move: what the prices are known to within, roughly; the
    margin's start at them, its counts summed, where the loads' miss did not grow; if it grew
    on every try, ``p`` itself, a last move of 0 and None)."""
    window, used, num_experts = PAIR_WINDOW, 0, s_parts[0].shape[0]
    for _ in range(PAIR_TRIES):
        q, step, before = _pair_rounds(s_parts, caps, k, red, p_E, window)
        first = margin(q, step)
        summed = red.sum(
            [
                torch.cat([torch.bincount(out.flatten(), minlength=num_experts), c])
                for (out, _), c in zip(first.picks, first.counts, strict=True)
            ]
        ).cpu()
        used += PAIR_ROUNDS + 2
        if int((summed[:num_experts] - capacities(caps, q).cpu()).abs().sum()) <= before:
            first.summed = summed[num_experts:]
            return q, used, step, first
        window /= 2
    return p_E.to(torch.float64), used, 0.0, None


def pick(s_ET: Tensor, p_E1: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Each token's K best experts under the prices (T, K) and its margin over the next (T,)."""
    vals, idx = torch.topk(s_ET - p_E1, k + 1, dim=0)
    return idx[:k].T.contiguous(), vals[k - 1] - vals[k]


def _pair_rounds(s_parts, caps, k, red, p_E, window) -> tuple[Tensor, float, int]:
    """One try of `pair_prices` from ``window``: (the agreed prices, the agreed last move, the
    loads' miss at ``p`` from the first round's counts)."""
    num_experts = s_parts[0].shape[0]
    dtype = s_parts[0].dtype
    p, step, before = p_E.to(torch.float64), 0.0, None
    for _ in range(PAIR_ROUNDS):
        p1 = p.to(dtype)[:, None]
        summed = red.sum([pair_counts(s, p1, k, window) for s in s_parts]).cpu().numpy().astype(np.int64)
        n = num_experts * num_experts * PAIR_BINS
        pairs = summed[:n].reshape(num_experts, num_experts, PAIR_BINS).astype(np.float64)
        excess = summed[n:] - capacities(caps, p).cpu().numpy()
        if before is None:
            before = int(np.abs(excess).sum())
        with solve_threads(("pair model", num_experts)):  # one thread where the other cores are busy
            move = model_move(pairs, excess, window)
        p = p + torch.from_numpy(move).to(p.device)
        step = float(np.abs(move).max())
        window /= PAIR_SHRINK
    last = torch.tensor([step], dtype=torch.float64, device=p.device)
    agreed = red.max([torch.cat([p, last]).to(s.device) for s in s_parts]).to(p.device)
    return agreed[:-1], float(agreed[-1]), before  # the last move agreed too: it sets the band
