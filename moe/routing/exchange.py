"""Exchange cycles between experts: improving and certifying a balanced assignment.

Legend: T tokens, E experts, K slots per token, C candidate tokens.

The edge a -> b of the exchange graph moves one token from expert a to expert b, with the best
score change over the tokens at a that do not hold b. A cycle a0 -> a1 -> ... -> a0 keeps every
load fixed and every token's experts distinct (a token moved along two edges leaves two experts
and joins two it did not hold), so applying a cycle of positive total gain keeps the assignment
feasible and improves it. A complete assignment with no positive cycle is optimal: that is the
optimality condition of the transportation problem (no negative cycle in the residual graph),
docs/routing.md.

Movable extra slots (``movable=True`` in `cancel_cycles`): when T * K = b * E + r with r > 0, any
loads with r experts at b + 1 and the others at b are allowed. That is the fixed-load problem
with one more token, the holder, that takes the E - r slots left unused: every expert has room
for b + 1, the holder holds exactly the experts at b, and its score is 0 everywhere. A move of
the holder, a -> c from an expert at b to one at b + 1, gains 0; a cycle through it carries real
tokens along a path from c to a, so a ends at b + 1 and c at b. The holder belongs to every
candidate set, so the certificate covers the choice of the r experts too.

The search is sequential and touches only the candidates' (E, C) scores and the (E, E) graph,
so it runs on the host in numpy: one copy of the candidates' scores and slots there, one copy of
the slots back. The certificate (the tokens the final prices could fault, against them) runs
where the scores are.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .cycle_graph import _Graph

__all__ = ["cancel_cycles", "fill_passes", "held_mask", "keep_top_claims", "violations"]

FILL_BLOCK = 1 << 21  # values of ``s - p`` a fill pass makes at a time (`fill_passes`)


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


def fill_passes(s_EN: np.ndarray, out_NK: np.ndarray, deficit_E: np.ndarray, p_E: np.ndarray) -> None:
    """The greedy passes of `balanced._fill` on the host, over N short tokens, in place: each
    pass gives every short token its best expert with room that it does not hold (prices
    ``p``); an expert keeps its ``deficit`` claimants with the largest margins over their next
    choice (ties: lowest token index). Stops when all are placed or a pass places nothing.
    Reads ``s - p`` (numpy's promotion: float64 with float64 prices) ``FILL_BLOCK`` values at a
    time: with a group's margin (millions of rows) the whole (N, E) of it and its masked copy
    would hold several times the scores' own memory at once."""
    num_experts = s_EN.shape[0]
    rows_per = max(1, FILL_BLOCK // max(num_experts, 1))
    while True:
        short = (out_NK < 0).any(axis=1).nonzero()[0]
        if short.size == 0:
            return
        allowed_E = deficit_E > 0
        best = np.empty(short.size, dtype=np.int64)
        top = np.empty(short.size, dtype=np.result_type(s_EN.dtype, p_E.dtype))
        second = np.empty_like(top)
        for r0 in range(0, short.size, rows_per):
            tok = short[r0 : r0 + rows_per]
            n = tok.size
            held = np.zeros((n, num_experts + 1), dtype=bool)
            held[np.arange(n)[:, None], out_NK[tok]] = True  # -1 marks the extra column
            allowed = ~held[:, :num_experts] & allowed_E[None]
            sub = np.where(allowed, s_EN[:, tok].T - p_E[None], -np.inf)
            at = sub.argmax(axis=1)  # first maximal index on ties
            rows = np.arange(n)
            best[r0 : r0 + n] = at
            top[r0 : r0 + n] = sub[rows, at]
            sub[rows, at] = -np.inf
            second[r0 : r0 + n] = sub.max(axis=1)
        ok = np.flatnonzero(np.isfinite(top))
        if ok.size == 0:
            return
        margin = top[ok] - second[ok]  # inf when only one expert is allowed
        win = ok[keep_top_claims(best[ok], margin, deficit_E)]
        tok = short[win]
        out_NK[tok, (out_NK[tok] < 0).argmax(axis=1)] = best[win]
        deficit_E -= np.bincount(best[win], minlength=num_experts)


def keep_top_claims(expert_N: np.ndarray, score_N: np.ndarray, room_E: np.ndarray) -> np.ndarray:
    """(N,) bool: which of N claims each expert keeps, its ``room`` ones with the highest score
    (ties: the earlier claim). The numpy counterpart of `moe.routing.common.drop_by_score`."""
    order = np.lexsort((-score_N, expert_N))  # by expert, score down, position up (stable)
    expert = expert_N[order]
    rank = np.arange(order.size) - np.searchsorted(expert, expert)  # place among its expert's claims
    keep = np.zeros(order.size, dtype=bool)
    keep[order] = rank < room_E[expert]
    return keep


def _host(x: Tensor) -> np.ndarray:
    """A host numpy array of ``x``: on CPU x's own memory (writes to it reach x), elsewhere a
    copy (bf16 and fp16 scores are normalised to fp32 before they get here)."""
    return x.detach().cpu().numpy()


def cancel_cycles(
    s_ET: Tensor,
    out_TK: Tensor,
    *,
    max_cycles: int,
    delta: float,
    candidates: Tensor | None = None,
    band: float = 0.005,
    basis: tuple[Tensor, Tensor] | None = None,
    movable: bool = False,
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

    ``basis = (prices (E,), margin (T,))`` says how the candidates were chosen: every other token
    holds its K best experts under ``prices``, ahead of the rest by at least ``margin[t]``. Under
    new prices such a token is still ahead unless its margin is below the spread of the price
    changes (the largest minus the smallest), so the first check reads only those tokens.

    ``movable``: the extra slots may change experts (module docstring): the loads must then be b
    or b + 1 with b = T * K // E, and the result is optimal among all such loads.
    """
    return _cancel(
        s_ET, out_TK, max_cycles=max_cycles, delta=delta, candidates=candidates, band=band, basis=basis, movable=movable
    )[0]


def _cancel(
    s_ET: Tensor,
    out_TK: Tensor,
    *,
    max_cycles: int,
    delta: float,
    candidates: Tensor | None = None,
    band: float = 0.005,
    basis: tuple[Tensor, Tensor] | None = None,
    movable: bool = False,
    start: Tensor | None = None,
) -> tuple[bool, Tensor]:
    """`cancel_cycles`, returning also the prices (E,) of its last search, which certify the
    result where it passes. ``start`` (E,): prices every search ends from once it finds no
    cycle (`_Graph.cancel`), so the prices rise from them only where a move needs it; None:
    from zeros."""
    if bool((out_TK < 0).any()):
        raise ValueError("cancel_cycles needs a complete assignment (found slots of -1)")
    num_experts, num_tokens = s_ET.shape
    base, spare = divmod(out_TK.numel(), num_experts)
    movable = movable and spare > 0  # without spare slots the loads are fixed anyway
    if movable:
        loads = torch.bincount(out_TK.flatten(), minlength=num_experts)
        if not bool(((loads == base) | (loads == base + 1)).all()):
            raise ValueError(f"cancel_cycles(movable=True) needs loads of {base} or {base + 1}, got {loads.tolist()}")
    tok = torch.arange(num_tokens, device=s_ET.device) if candidates is None else candidates
    is_candidate = torch.zeros(num_tokens, dtype=torch.bool, device=s_ET.device).index_fill_(0, tok, True)
    band = max(band, 1e-3)
    applied = 0
    first = None if start is None else _host(start.reshape(-1).to(s_ET.dtype))  # the searches only read it
    while True:
        extra = _host(torch.bincount(out_TK.flatten(), minlength=num_experts) > base).copy() if movable else None
        graph = _Graph(_host(s_ET.index_select(1, tok)), _host(out_TK.index_select(0, tok)), delta, extra)
        done, n, dist = graph.cancel(max_cycles - applied, first)
        applied += n
        out_TK[tok] = torch.from_numpy(graph.out).to(out_TK.device)
        prices = torch.from_numpy(dist).to(device=s_ET.device, dtype=s_ET.dtype)
        if not done:
            return False, prices
        if basis is None:
            bad = violations(s_ET, prices, out_TK, delta)
        else:
            shift = prices - basis[0].view(-1)
            reach = float(shift.max() - shift.min()) + delta + 1e-5  # 1e-5: far above rounding in [-1, 1]
            near = torch.nonzero((basis[1] < reach) & ~is_candidate).flatten()
            bad = near[violations(s_ET.index_select(1, near), prices, out_TK.index_select(0, near), delta)]
        if bad.numel() == 0 or bool(is_candidate[bad].all()):  # candidates pass by construction
            return True, prices
        band *= 2  # grow geometrically: a few rebuilds at most
        tok = torch.unique(torch.cat([tok, bad, violations(s_ET, prices, out_TK, -band)]))
        is_candidate.index_fill_(0, tok, True)
        basis = None  # the new candidates come from these prices: check every token from now on
