"""Exchange cycles between experts: completing and certifying a balanced assignment.

Legend: T tokens, E experts, K slots per token, C candidate tokens, N = E + 1 graph nodes.

Node e < E is an expert; node E is the *pool* of slots not yet assigned. An edge a -> b moves one
token from a to b, with the best score change over all tokens that can make that move:
a token held by the pool is placed at b; an edge e -> pool is an empty seat of an expert with
room. A cycle keeps every load fixed and every token's experts distinct, so applying a cycle of
positive total gain keeps the assignment feasible and improves it (or places a pooled slot).
A complete assignment with no positive cycle is optimal: that is the optimality condition of the
transportation problem (no negative cycle in the residual graph), docs/routing.md.
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
    ``band`` under ``prices`` (score minus price), and tokens with an open slot.

    With ``band = delta`` and prices from a converged Bellman-Ford, no violation means no move,
    hence no cycle, gains more than ``delta`` per move: the optimality certificate. With a
    negative band it lists the tokens near a boundary, the candidates for cycles.
    """
    num_experts = s_ET.shape[0]
    a = s_ET - prices_E.view(-1, 1)
    held = held_mask(out_TK, num_experts)
    worst_held = a.masked_fill(~held, float("inf")).amin(dim=0)
    best_free = a.masked_fill(held, float("-inf")).amax(dim=0)
    bad = (best_free - worst_held > band) | (out_TK < 0).any(dim=1)
    return torch.nonzero(bad).flatten()


class _Graph:
    """The (N, N) best-move gains over the candidate tokens, kept up to date as tokens move.

    Holds, for the C candidates and each of their K slots, the slot's node (K, C) and the gain
    of moving that slot to every expert (K, C, E). A move changes only the moved tokens' entries
    and the rows of the nodes those tokens touch, so after a cycle only those are recomputed.
    """

    def __init__(self, s_ET: Tensor, out_TK: Tensor, tok: Tensor, pool_value: float) -> None:
        self.s, self.out, self.tok, self.pool_value = s_ET, out_TK, tok, pool_value
        self.num_experts = s_ET.shape[0]
        self.node_KC, self.gain_KCE = self._slot_gains(tok)
        n = self.num_experts + 1
        self.gain = s_ET.new_full((n, n), float("-inf"))
        self._rows(torch.arange(n, device=s_ET.device))

    def _slot_gains(self, tok: Tensor) -> tuple[Tensor, Tensor]:
        e = self.num_experts
        s = self.s[:, tok]
        out = self.out[tok]
        held = held_mask(out, e)
        node = torch.where(out < 0, e, out).T  # (K, C); the pool is node E
        cur = s.gather(0, node.clamp(max=e - 1))  # (K, C) score of each slot's current expert
        cur = torch.where(node == e, self.pool_value, cur)
        gain = (s[None] - cur[:, None]).masked_fill(held[None], float("-inf")).transpose(1, 2)
        return node, gain.contiguous()  # (K, C), (K, C, E)

    def _rows(self, rows: Tensor) -> None:
        """Recompute gain[rows, :E] from the slot gains."""
        e = self.num_experts
        self.gain[rows, :e] = float("-inf")
        pick = torch.isin(self.node_KC, rows).flatten()
        node = self.node_KC.flatten()[pick]
        g = self.gain_KCE.flatten(0, 1)[pick]
        self.gain[:, :e].scatter_reduce_(0, node[:, None].expand_as(g), g, reduce="amax")

    def moved(self, pos: Tensor) -> None:
        """Candidates at positions ``pos`` changed their experts: refresh what depends on them."""
        before = self.node_KC[:, pos]
        self.node_KC[:, pos], self.gain_KCE[:, pos] = self._slot_gains(self.tok[pos])
        self._rows(torch.unique(torch.cat([before.flatten(), self.node_KC[:, pos].flatten()])))

    def set_room(self, deficit_E: Tensor) -> None:
        """Empty seats: an expert with room may pass one to the pool at no cost."""
        self.gain[: self.num_experts, self.num_experts] = torch.where(deficit_E > 0, 0.0, float("-inf"))

    def mover(self, a: int, b: int) -> tuple[int, int]:
        """(candidate position, slot) of the lowest-index token with the best a -> b move."""
        g = torch.where(self.node_KC == a, self.gain_KCE[:, :, b], float("-inf"))  # (K, C)
        hit = (g == self.gain[a, b]).any(dim=0)
        c = int(hit.int().argmax())  # first candidate (lowest token index) with a best move
        return c, int((g[:, c] == self.gain[a, b]).int().argmax())


def _find_cycles(gain: Tensor, delta: float) -> tuple[list[list[int]], Tensor]:
    """Node-disjoint cycles whose moves gain more than ``delta`` each on average, and the
    longest-path distances (N,) when there is none.

    Bellman-Ford for longest paths from a virtual source joined to every node, stopping early when
    nothing changes; every cycle of the parent pointers is a positive cycle, and cycles of a
    functional graph never share a node. Converged distances are prices under which every move
    gains at most ``delta``. One host sync per round, at most N + 1 rounds.
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
    raise AssertionError("Bellman-Ford changed for N + 1 rounds without a parent cycle")  # impossible


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
    prices_E: Tensor | None = None,
    band: float = 0.005,
) -> int:
    """Complete ``out`` (slots -1 are pooled) and improve it by positive cycles, in place.

    Cycles are searched among candidate tokens: with ``prices`` given, those within ``band`` of
    a boundary under them (`violations`), else all tokens. When no cycle is left, the
    Bellman-Ford distances are prices that certify the candidates; every token is checked
    against them in one pass, and if any fails, the candidates become the tokens within twice
    the band of a boundary under those prices (the failing ones included) and the search goes on.
    Stops when all tokens pass (the assignment is then optimal up to ``delta`` per move) or after
    ``max_cycles`` cycles. Scores must lie in [-1, 0] (see `moe.routing.balanced`).
    Returns the number of cycles applied.
    """
    num_experts, num_tokens = s_ET.shape
    if prices_E is None:
        tok = torch.arange(num_tokens, device=s_ET.device)
    else:
        tok = violations(s_ET, prices_E, out_TK, -band)
    pool_value = -float(num_experts + 2)  # below any path of real moves (each loses at most 1)
    graph = _Graph(s_ET, out_TK, tok, pool_value)
    applied = 0
    while applied < max_cycles:
        graph.set_room(cap_E - torch.bincount(out_TK[out_TK >= 0], minlength=num_experts))
        cycles, dist = _find_cycles(graph.gain, delta)
        if not cycles:
            prices = dist[:num_experts]
            bad = violations(s_ET, prices, out_TK, delta)
            if torch.isin(bad, tok).all():  # every token passes (candidates pass by construction)
                break
            band *= 2  # grow geometrically: a few rebuilds at most
            grown = torch.cat([tok, bad, violations(s_ET, prices, out_TK, -band)])
            tok = torch.unique(grown)  # sorted: lowest token index first on ties
            graph = _Graph(s_ET, out_TK, tok, pool_value)
            continue
        moves = []
        for cycle in cycles[: max_cycles - applied]:  # disjoint: all moves were valid together
            for i, a in enumerate(cycle):
                b = cycle[(i + 1) % len(cycle)]
                if b != num_experts:  # an edge into the pool is an empty seat: nothing moves
                    moves.append((graph.mover(a, b), b))
            applied += 1
        for (c, j), b in moves:
            out_TK[tok[c], j] = b
        graph.moved(torch.tensor(sorted({c for (c, _), _ in moves}), device=s_ET.device))
    return applied
