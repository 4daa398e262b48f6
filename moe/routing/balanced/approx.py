"""`balanced_assignment_approx`: exact balance with no host sync, near-optimal.

Legend: T tokens, E experts, K experts per token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..common import drop_by_score
from ..exchange import held_mask
from .buffers import _Work
from .capacities import _Capacities, _check_extras, _loads, _round_robin
from .inputs import _normalise_nosync, _nothing_to_solve
from .pick import _select
from .prices import _jacobi_prices

_APPROX_WIDTHS = (1.0, 1.0, 0.25, 0.1, 0.05, 0.03)  # price-update windows of the sync-free solver


def balanced_assignment_approx(
    scores_TE: Tensor, k: int = 1, *, max_iters: int = 12, eps: float = 1e-6, extras: str = "best"
) -> Tensor:
    """`balanced_assignment` without a single host sync: exact balance, near-optimal.

    The same balance as `balanced_assignment` and K distinct experts per token. ``extras``: as
    there; under ``"best"`` the r experts with the highest final prices take the extra slots
    (the dual's choice, not certified like the rest), under ``"lowest"`` the loads are
    ``expert_capacities(T, E, k)``. Every shape is fixed by (T, E, K) and no value is read
    back, so on CUDA the host never waits for the device (what the expert-parallel static path
    needs: docs/parallel.md). The price is optimality: the prices from ``max_iters`` damped Jacobi
    updates give the pick, rounds of bids place the dropped slots with the best experts that
    still have room, and `_complete` places the rest. No exchange cycles, so no certificate: the
    gap to the optimum is measured in docs/benchmarks.md. NaN and Inf are not detected here
    (that needs a sync; the routers check their input): NaN counts as the lowest score, +-Inf
    as the largest finite ones, and the result is still a balanced assignment.
    """
    _check_extras(extras)
    trivial = _nothing_to_solve(scores_TE, k, max_iters, None, eps, check_finite=False)
    if trivial is not None:
        return trivial
    num_tokens, num_experts = scores_TE.shape
    device = scores_TE.device
    with torch.no_grad():
        work = _Work(scores_TE)
        s = _normalise_nosync(scores_TE, jitter=eps / 2, work=work)
        caps = _Capacities(num_tokens, num_experts, k, extras, device)
        # ever finer windows as the prices settle (measured: half the gap of width 1)
        p = _jacobi_prices(s, caps, k, max_iters, None, work=work, widths=_APPROX_WIDTHS)[0]
        cap = caps.at(p)
        out, margin = _select(s, p, k, cap, work)
        out = _bids(work.shifted(s, p), out, cap, rounds=k + 2)
        return _complete(out, cap, margin)[0]


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
