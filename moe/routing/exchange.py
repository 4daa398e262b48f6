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

__all__ = ["cancel_cycles", "held_mask"]


def held_mask(out_TK: Tensor, num_experts: int) -> Tensor:
    """(E, T) bool: which experts each token already holds (-1 slots hold nothing)."""
    held = torch.zeros(num_experts + 1, out_TK.shape[0], dtype=torch.bool, device=out_TK.device)
    held.scatter_(0, torch.where(out_TK < 0, num_experts, out_TK).T, True)
    return held[:num_experts]


def _graph(s_ET: Tensor, out_TK: Tensor, tok: Tensor, deficit_E: Tensor, pool_value: float) -> tuple[Tensor, list]:
    """(N, N) best gain per move over the candidate tokens ``tok``; also the per-slot gains."""
    num_experts = s_ET.shape[0]
    n = num_experts + 1
    s = s_ET[:, tok]
    out = out_TK[tok]
    held = held_mask(out, num_experts)
    gain = s.new_full((n, n), float("-inf"))
    per_slot = []
    for j in range(out.shape[1]):
        a = torch.where(out[:, j] < 0, num_experts, out[:, j])
        cur = torch.where(a == num_experts, pool_value, s.gather(0, a.clamp(max=num_experts - 1)[None])[0])
        g_CE = (s - cur).masked_fill(held, float("-inf")).T
        per_slot.append((a, g_CE))
        gain[:, :num_experts].scatter_reduce_(0, a[:, None].expand_as(g_CE), g_CE, reduce="amax")
    gain[:num_experts, num_experts] = torch.where(deficit_E > 0, 0.0, float("-inf"))
    return gain, per_slot


def _find_cycles(gain: Tensor, delta: float) -> list[list[int]]:
    """Node-disjoint cycles whose moves gain more than ``delta`` each on average ([] if none).

    Bellman-Ford for longest paths from a virtual source joined to every node, stopping early when
    nothing changes; every cycle of the parent pointers is a positive cycle, and cycles of a
    functional graph never share a node. One host sync per round, at most N + 1 rounds.
    """
    n = gain.shape[0]
    w = gain - delta
    dist = gain.new_zeros(n)
    parent = torch.full((n,), -1, dtype=torch.int64, device=gain.device)
    for rnd in range(n + 1):
        cand, arg = (dist[:, None] + w).max(dim=0)
        changed = cand > dist
        if not bool(changed.any()):
            return []
        dist = torch.where(changed, cand, dist)
        parent = torch.where(changed, arg, parent)
        if rnd % 4 == 3 or rnd == n:
            cycles = _parent_cycles(parent.tolist())
            if cycles:
                return cycles
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


def _apply(out_TK: Tensor, tok: Tensor, per_slot: list, gain: Tensor, cycle: list[int]) -> None:
    """Move the lowest-index best token along each edge of ``cycle`` (in place)."""
    num_experts = gain.shape[0] - 1
    for i, a in enumerate(cycle):
        b = cycle[(i + 1) % len(cycle)]
        if b == num_experts:  # an empty seat of a leaves for the pool: nothing moves
            continue
        best, pick = None, None
        for j, (a_C, g_CE) in enumerate(per_slot):
            g = torch.where(a_C == a, g_CE[:, b], float("-inf"))
            c = int(g.argmax())  # first index among equal maxima
            if g[c] == gain[a, b] and (best is None or c < best):
                best, pick = c, j
        out_TK[tok[best], pick] = b


def cancel_cycles(
    s_ET: Tensor, out_TK: Tensor, cap_E: Tensor, *, max_cycles: int, delta: float, candidates: Tensor | None = None
) -> int:
    """Complete ``out`` (slots -1 are pooled) and improve it by positive cycles, in place.

    The search first uses only the ``candidates`` tokens (cheap), then all tokens; it stops when
    no positive cycle is left among all tokens (the assignment is then optimal up to ``delta``
    per move) or after ``max_cycles`` cycles. Scores must lie in [-1, 0] (see `_normalise`).
    Returns the number of cycles applied.
    """
    num_experts, num_tokens = s_ET.shape
    all_tok = torch.arange(num_tokens, device=s_ET.device)
    tok = all_tok if candidates is None else candidates
    pool_value = -float(num_experts + 2)  # below any path of real moves (each loses at most 1)
    applied = 0
    while applied < max_cycles:
        loads = torch.bincount(out_TK[out_TK >= 0], minlength=num_experts)
        gain, per_slot = _graph(s_ET, out_TK, tok, cap_E - loads, pool_value)
        cycles = _find_cycles(gain, delta)
        if not cycles:
            if tok is all_tok:
                break
            tok = all_tok  # certify on every token
            continue
        for cycle in cycles[: max_cycles - applied]:  # disjoint: all moves were valid together
            _apply(out_TK, tok, per_slot, gain, cycle)
            applied += 1
    return applied
