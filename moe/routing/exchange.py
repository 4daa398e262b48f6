"""Exchange cycles between experts: improving and certifying a balanced assignment.

Legend: T tokens, E experts, K slots per token, C candidate tokens.

The edge a -> b of the exchange graph moves one token from expert a to expert b, with the best
score change over the tokens at a that do not hold b. A cycle a0 -> a1 -> ... -> a0 keeps every
load fixed and every token's experts distinct (a token moved along two edges leaves two experts
and joins two it did not hold), so applying a cycle of positive total gain keeps the assignment
feasible and improves it. A complete assignment with no positive cycle is optimal: that is the
optimality condition of the transportation problem (no negative cycle in the residual graph),
docs/routing.md.

The search is sequential and touches only the candidates' (E, C) scores and the (E, E) graph,
so it runs on the host in numpy: one copy of the candidates' scores and slots there, one copy of
the slots back. The certificate (every token against the final prices) runs where the scores are.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = ["cancel_cycles", "fill_passes", "held_mask", "violations"]


def held_mask(out_TK: Tensor, num_experts: int) -> Tensor:
    """(E, T) bool: which experts each token already holds (-1 slots hold nothing)."""
    held = torch.zeros(num_experts + 1, out_TK.shape[0], dtype=torch.bool, device=out_TK.device)
    held.scatter_(0, torch.where(out_TK < 0, num_experts, out_TK).T, True)
    return held[:num_experts]


def violations(s_ET: Tensor, prices_E: Tensor, out_TK: Tensor, band: float) -> Tensor:
    """Token indices whose best expert not held beats their worst held expert by more than
    ``band`` under ``prices`` (score minus price).

    With ``band = delta`` and prices from a converged Bellman-Ford, no violation means no move,
    hence no cycle, gains more than ``delta`` per move: the optimality certificate. With a
    negative band it lists the tokens near a boundary, the candidates for cycles.
    """
    num_experts = s_ET.shape[0]
    a = s_ET - prices_E.view(-1, 1)
    if out_TK.shape[1] == 1 and band >= 0:  # one held expert: the best expert overall decides
        return torch.nonzero(a.amax(dim=0) - a.gather(0, out_TK.T)[0] > band).flatten()
    held = held_mask(out_TK, num_experts)
    worst_held = torch.where(held, a, float("inf")).amin(dim=0)
    best_free = torch.where(held, float("-inf"), a).amax(dim=0)
    return torch.nonzero(best_free - worst_held > band).flatten()


class _Graph:
    """The (E, E) best-move gains over the C candidate tokens, kept up to date as tokens move.

    Holds the candidates' scores (E, C) and slots (C, K), and for each slot its expert (K, C) and
    the gain of moving it to every expert, as (E, K, C) so that each target expert's gains are
    contiguous. A move changes only the moved tokens' entries and the rows of the experts those
    tokens touch, so after a cycle only those are recomputed.
    """

    def __init__(self, s_EC: np.ndarray, out_CK: np.ndarray) -> None:
        self.s, self.out = s_EC, out_CK
        num_experts = s_EC.shape[0]
        self.expert_KC, self.gain_EKC = self._slot_gains(np.arange(out_CK.shape[0]))
        # every row at once: torch's scatter-max over the slots takes about half the time of _rows
        # here, while _rows is the faster one for the few rows a cycle touches (measured both ways)
        g = torch.from_numpy(self.gain_EKC.reshape(num_experts, -1))
        src = torch.from_numpy(self.expert_KC.reshape(1, -1)).expand(num_experts, -1)
        into = torch.full((num_experts, num_experts), -np.inf, dtype=g.dtype)  # into[b, a]: the edge a -> b
        self.gain = into.scatter_reduce_(1, src, g, reduce="amax").T.contiguous().numpy()

    def _slot_gains(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = self.s[:, pos]  # (E, P)
        expert = np.ascontiguousarray(self.out[pos].T)  # (K, P)
        cols = np.arange(pos.size)[None]  # broadcasts against expert
        gain = np.empty((s.shape[0], *expert.shape), dtype=s.dtype)  # (E, K, P), C order: see _rows
        np.subtract(s[:, None, :], s[expert, cols][None], out=gain)
        gain[expert, :, cols] = -np.inf  # no slot moves to an expert its token holds
        return expert, gain

    def _rows(self, mark: np.ndarray) -> None:
        """Recompute the rows of ``gain`` marked (bool, (E,)) from the slot gains."""
        num_experts = self.gain.shape[0]
        self.gain[mark] = -np.inf
        expert = self.expert_KC.ravel()
        pick = np.flatnonzero(mark[expert])
        if pick.size == 0:
            return
        pick = pick[np.argsort(expert[pick], kind="stable")]
        e = expert[pick]
        starts = np.flatnonzero(np.concatenate([[True], e[1:] != e[:-1]]))
        g = np.take(self.gain_EKC.reshape(num_experts, -1), pick, axis=1)  # (E, picked), C order
        self.gain[e[starts]] = np.maximum.reduceat(g, starts, axis=1).T

    def moved(self, pos: np.ndarray) -> None:
        """Candidates at positions ``pos`` changed their experts: refresh what depends on them."""
        touched = np.zeros(self.gain.shape[0], dtype=bool)
        touched[self.expert_KC[:, pos]] = True
        self.expert_KC[:, pos], self.gain_EKC[:, :, pos] = self._slot_gains(pos)
        touched[self.expert_KC[:, pos]] = True
        self._rows(touched)

    def movers(self, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For the moves a[i] -> b[i]: (candidate position, slot) of the lowest-index token with
        the best such move, each (N,)."""
        gain = self.gain[a, b][:, None, None]
        hit = (self.expert_KC[None] == a[:, None, None]) & (self.gain_EKC[b] == gain)  # (N, K, C)
        c = hit.any(axis=1).argmax(axis=1)  # first candidate (lowest token index) with a best move
        return c, hit[np.arange(c.size), :, c].argmax(axis=1)

    def cancel(self, delta: float, max_cycles: int) -> tuple[bool, int, np.ndarray]:
        """Apply positive cycles until none is left (True) or ``max_cycles`` ran out with one
        still found (False). Returns that flag, the cycles applied and the final distances."""
        applied = 0
        dist = np.zeros(self.gain.shape[0], dtype=self.gain.dtype)
        while True:
            cycles, dist = _find_cycles(self.gain, delta, dist)
            if not cycles:
                return True, applied, dist
            if applied >= max_cycles:
                return False, applied, dist
            cycles = cycles[: max_cycles - applied]
            applied += len(cycles)
            a = np.array([v for cycle in cycles for v in cycle])
            b = np.array([v for cycle in cycles for v in cycle[1:] + cycle[:1]])
            c, j = self.movers(a, b)  # disjoint cycles: all these moves are valid together
            self.out[c, j] = b
            self.moved(c)  # repeats are harmless


def _find_cycles(gain: np.ndarray, delta: float, start: np.ndarray) -> tuple[list[list[int]], np.ndarray]:
    """Node-disjoint cycles whose moves gain more than ``delta`` each on average, and the
    longest-path distances (E,): converged ones (prices) when there is no cycle, the ones
    reached so far otherwise (a warm start for the next call).

    Bellman-Ford for longest paths, from the distances ``start`` (any start is sound: a cycle of
    the parent pointers set here is always a positive cycle, and distances that no edge can
    raise prove that no positive cycle is left; starting from the last call's distances saves
    most rounds after a few tokens moved). The start is shifted so its largest value is 0: the
    distances only grow within a search, and in float32 large values would swallow gains of
    the order of ``delta``. Cycles of a functional graph never share a node.
    Converged distances are prices under which every move gains at most ``delta``. At most
    E + 1 rounds. (Measured and rejected: collecting more disjoint cycles after the first ones
    by taking their nodes out; the later cycles gain less and more cycles are applied in all.)
    """
    n = gain.shape[0]
    w_in = np.ascontiguousarray((gain - delta).T)  # w_in[b, a]: the edge a -> b, rows contiguous
    dist = start - start.max()  # a constant shift changes nothing but keeps the values small
    parent = np.full(n + 1, n, dtype=np.int64)  # n: no parent (a sink that points to itself)
    rows = np.arange(n)
    through = np.empty_like(w_in)
    steps = max(1, (n + 1).bit_length())
    for rnd in range(n + 1):
        np.add(w_in, dist, out=through)  # through[b, a] = dist[a] + w(a -> b)
        arg = through.argmax(axis=1)  # first maximal index on ties
        cand = through[rows, arg]
        changed = cand > dist
        if not changed.any():
            return [], dist
        dist = np.maximum(dist, cand)
        parent[:n] = np.where(changed, arg, parent[:n])
        if rnd % 2 == 0 and rnd < n:  # look for a parent cycle every other round (and the last)
            continue
        reach = parent
        for _ in range(steps):  # n + 1 steps along the pointers, by doubling
            reach = reach[reach]
        ends = reach[:n]  # n + 1 steps from anywhere end on a cycle or at the sink
        if ends.min() < n:
            return _parent_cycles(parent[:n].tolist(), ends[ends < n].tolist()), dist
    raise AssertionError("Bellman-Ford changed for E + 1 rounds without a parent cycle")  # impossible


def _parent_cycles(par: list[int], on_cycles: list[int]) -> list[list[int]]:
    """The cycles of the functional graph v -> par[v] through the nodes ``on_cycles`` (each
    node lies on a cycle; several may name the same one), each in move order a -> b."""
    seen, cycles = set(), []
    for start in on_cycles:
        if start in seen:
            continue
        cycle, v = [start], par[start]
        while v != start:
            cycle.append(v)
            v = par[v]
        seen.update(cycle)
        cycle.reverse()  # parent points backwards along the moves
        cycles.append(cycle)
    return cycles


def fill_passes(s_EN: np.ndarray, out_NK: np.ndarray, deficit_E: np.ndarray, p_E: np.ndarray) -> None:
    """The greedy passes of `balanced._fill` on the host, over N short tokens, in place: each
    pass gives every short token its best expert with room that it does not hold (prices
    ``p``); an expert keeps its ``deficit`` claimants with the largest margins over their next
    choice (ties: lowest token index). Stops when all are placed or a pass places nothing."""
    num_experts, n = s_EN.shape
    rows = np.arange(n)
    a = s_EN.T - p_E[None]  # (N, E)
    while True:
        short = np.flatnonzero((out_NK < 0).any(axis=1))
        if short.size == 0:
            return
        held = np.zeros((short.size, num_experts + 1), dtype=bool)
        held[np.arange(short.size)[:, None], out_NK[short]] = True  # -1 marks the extra column
        allowed = ~held[:, :num_experts] & (deficit_E > 0)[None]
        sub = np.where(allowed, a[short], -np.inf)
        best = sub.argmax(axis=1)  # first maximal index on ties
        top = sub[rows[: short.size], best]
        sub[rows[: short.size], best] = -np.inf
        ok = np.flatnonzero(np.isfinite(top))
        if ok.size == 0:
            return
        margin = top[ok] - sub[ok].max(axis=1)  # inf when only one expert is allowed
        order = ok[np.lexsort((ok, -margin, best[ok]))]  # by expert, margin down, token up
        e = best[order]
        first = np.flatnonzero(np.concatenate([[True], e[1:] != e[:-1]]))
        rank = np.arange(order.size) - np.repeat(first, np.diff(np.append(first, order.size)))
        win = order[rank < deficit_E[e]]
        tok = short[win]
        out_NK[tok, (out_NK[tok] < 0).argmax(axis=1)] = best[win]
        np.subtract.at(deficit_E, best[win], 1)


def _host(x: Tensor) -> np.ndarray:
    """A host numpy array of ``x`` (no copy on CPU): ``x`` must be a fresh tensor nothing else
    holds, or the array only read (bf16 and fp16 scores are normalised to fp32 before they get
    here)."""
    return x.detach().cpu().numpy()


def cancel_cycles(
    s_ET: Tensor,
    out_TK: Tensor,
    *,
    max_cycles: int,
    delta: float,
    candidates: Tensor | None = None,
    band: float = 0.005,
) -> bool:
    """Improve a complete balanced assignment ``out`` by positive exchange cycles, in place
    (cycles keep every load, so the capacities are those of ``out``).

    Cycles are searched among the ``candidates`` (sorted token indices; all tokens if None),
    typically the tokens within ``band`` of a boundary under some prices. When no cycle is left, the
    Bellman-Ford distances are prices that certify the candidates; every token is checked
    against them in one pass, and if any fails, the candidates become the tokens within twice
    the band of a boundary under those prices (the failing ones included) and the search goes on.
    Returns True when every token passes (the assignment is then optimal up to ``delta`` per
    move), False if ``max_cycles`` cycles were applied first. Scores must lie within [-1, 1].
    """
    if bool((out_TK < 0).any()):
        raise ValueError("cancel_cycles needs a complete assignment (found slots of -1)")
    tok = torch.arange(s_ET.shape[1], device=s_ET.device) if candidates is None else candidates
    band = max(band, 1e-3)
    applied = 0
    while True:
        graph = _Graph(_host(s_ET.index_select(1, tok)), _host(out_TK.index_select(0, tok)))
        done, n, dist = graph.cancel(delta, max_cycles - applied)
        applied += n
        out_TK[tok] = torch.from_numpy(graph.out).to(out_TK.device)
        if not done:
            return False
        prices = torch.from_numpy(dist).to(device=s_ET.device, dtype=s_ET.dtype)
        bad = violations(s_ET, prices, out_TK, delta)
        if bad.numel() == 0 or torch.isin(bad, tok).all():  # every token passes (candidates do by construction)
            return True
        band *= 2  # grow geometrically: a few rebuilds at most
        tok = torch.unique(torch.cat([tok, bad, violations(s_ET, prices, out_TK, -band)]))
