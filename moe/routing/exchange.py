"""Exchange cycles between experts: improving and certifying a balanced assignment.

Legend: T tokens, E experts, K slots per token, C candidate tokens.

The edge a -> b of the exchange graph moves one token from expert a to expert b, with the best
score change over the tokens at a that do not hold b. A cycle a0 -> a1 -> ... -> a0 keeps every
load fixed and every token's experts distinct (a token moved along two edges leaves two experts
and joins two it did not hold), so applying a cycle of positive total gain keeps the assignment
feasible and improves it. A complete assignment with no positive cycle is optimal: that is the
optimality condition of the transportation problem (no negative cycle in the residual graph),
docs/routing.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["cancel_cycles", "held_mask", "violations"]


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
    held = held_mask(out_TK, num_experts)
    worst_held = a.masked_fill(~held, float("inf")).amin(dim=0)
    best_free = a.masked_fill(held, float("-inf")).amax(dim=0)
    return torch.nonzero(best_free - worst_held > band).flatten()


class _Graph:
    """The (E, E) best-move gains over the candidate tokens, kept up to date as tokens move.

    Holds, for the C candidates and each of their K slots, the slot's expert (K, C) and the gain
    of moving that slot to every expert (K, C, E). A move changes only the moved tokens' entries
    and the rows of the experts those tokens touch, so after a cycle only those are recomputed.
    """

    def __init__(self, s_ET: Tensor, out_TK: Tensor, tok: Tensor) -> None:
        self.s, self.out, self.tok = s_ET, out_TK, tok
        num_experts = s_ET.shape[0]
        self.expert_KC, self.gain_KCE = self._slot_gains(tok)
        self.gain = s_ET.new_full((num_experts, num_experts), float("-inf"))
        self._rows(torch.arange(num_experts, device=s_ET.device))

    def _slot_gains(self, tok: Tensor) -> tuple[Tensor, Tensor]:
        s = self.s[:, tok]
        expert = self.out[tok].T  # (K, C)
        cur = s.gather(0, expert)  # (K, C) score of each slot's current expert
        held = held_mask(self.out[tok], s.shape[0])
        gain = (s[None] - cur[:, None]).masked_fill(held[None], float("-inf")).transpose(1, 2)
        return expert, gain.contiguous()  # (K, C), (K, C, E)

    def _rows(self, rows: Tensor) -> None:
        """Recompute gain[rows] from the slot gains."""
        self.gain[rows] = float("-inf")
        pick = torch.isin(self.expert_KC, rows).flatten()
        expert = self.expert_KC.flatten()[pick]
        g = self.gain_KCE.flatten(0, 1)[pick]
        self.gain.scatter_reduce_(0, expert[:, None].expand_as(g), g, reduce="amax")

    def moved(self, pos: Tensor) -> None:
        """Candidates at positions ``pos`` changed their experts: refresh what depends on them."""
        before = self.expert_KC[:, pos]
        self.expert_KC[:, pos], self.gain_KCE[:, pos] = self._slot_gains(self.tok[pos])
        self._rows(torch.unique(torch.cat([before.flatten(), self.expert_KC[:, pos].flatten()])))

    def mover(self, a: int, b: int) -> tuple[int, int]:
        """(candidate position, slot) of the lowest-index token with the best a -> b move."""
        g = torch.where(self.expert_KC == a, self.gain_KCE[:, :, b], float("-inf"))  # (K, C)
        hit = (g == self.gain[a, b]).any(dim=0)
        c = int(hit.int().argmax())  # first candidate (lowest token index) with a best move
        return c, int((g[:, c] == self.gain[a, b]).int().argmax())


def _find_cycles(gain: Tensor, delta: float) -> tuple[list[list[int]], Tensor]:
    """Node-disjoint cycles whose moves gain more than ``delta`` each on average, and the
    longest-path distances (E,) when there is none.

    Bellman-Ford for longest paths from a virtual source joined to every node, stopping early when
    nothing changes; every cycle of the parent pointers is a positive cycle, and cycles of a
    functional graph never share a node. Converged distances are prices under which every move
    gains at most ``delta``. One host sync per round, at most E + 1 rounds.
    """
    n = gain.shape[0]
    w = gain - delta
    dist = gain.new_zeros(n)
    parent = torch.full((n,), -1, dtype=torch.int64, device=gain.device)
    for rnd in range(n + 1):
        cand, arg = (dist[:, None] + w).max(dim=0)
        changed = cand > dist
        if not bool(changed.any()):
            return [], dist
        dist = torch.where(changed, cand, dist)
        parent = torch.where(changed, arg, parent)
        if rnd % 4 == 3 or rnd == n:
            cycles = _parent_cycles(parent.tolist())
            if cycles:
                return cycles, dist
    raise AssertionError("Bellman-Ford changed for E + 1 rounds without a parent cycle")  # impossible


def _parent_cycles(par: list[int]) -> list[list[int]]:
    """All cycles of the functional graph v -> par[v], each in move order a -> b."""
    state = [0] * len(par)  # 0 new, 1 on the current walk, 2 done
    cycles = []
    for start in range(len(par)):
        path, v = [], start
        while v >= 0 and state[v] == 0:
            state[v] = 1
            path.append(v)
            v = par[v]
        if v >= 0 and state[v] == 1:
            cycle = path[path.index(v) :]
            cycle.reverse()  # parent points backwards along the moves
            cycles.append(cycle)
        for u in path:
            state[u] = 2
    return cycles


def cancel_cycles(
    s_ET: Tensor,
    out_TK: Tensor,
    cap_E: Tensor,
    *,
    max_cycles: int,
    delta: float,
    candidates: Tensor | None = None,
    band: float = 0.005,
) -> bool:
    """Improve a complete balanced assignment ``out`` by positive exchange cycles, in place.

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
    graph = _Graph(s_ET, out_TK, tok)
    applied = 0
    while True:
        cycles, dist = _find_cycles(graph.gain, delta)
        if not cycles:
            bad = violations(s_ET, dist, out_TK, delta)
            if torch.isin(bad, tok).all():  # every token passes (candidates pass by construction)
                return True
            band *= 2  # grow geometrically: a few rebuilds at most
            tok = torch.unique(torch.cat([tok, bad, violations(s_ET, dist, out_TK, -band)]))
            graph = _Graph(s_ET, out_TK, tok)
            continue
        if applied >= max_cycles:
            return False
        moves = []
        for cycle in cycles[: max_cycles - applied]:  # disjoint: all moves were valid together
            moves += [(graph.mover(a, b), b) for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True)]
            applied += 1
        for (c, j), b in moves:
            out_TK[tok[c], j] = b
        graph.moved(torch.tensor(sorted({c for (c, _), _ in moves}), device=s_ET.device))
