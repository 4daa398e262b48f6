"""`balanced_assignment`: the exact solver, prices then exchange cycles with a certificate."""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import torch
from torch import Tensor

from ..exchange import _cancel
from .buffers import _Work
from .capacities import _Capacities, _check_extras
from .inputs import _normalise_unit, _nothing_to_solve
from .pick import _fill, _select
from .prices import _jacobi_prices, _prices
from .small import SMALL, _HostPrices, host_finish, host_prices
from .threads import solve_threads

MAX_ITERS = 6  # the price updates of a solve by default (`balanced_assignment`, `balanced_prices`)


def balanced_assignment(
    scores_TE: Tensor,
    k: int = 1,
    *,
    max_iters: int = MAX_ITERS,
    eps: float = 1e-6,
    max_cycles: int | None = None,
    extras: str = "best",
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
        extras: which experts take the extra slots when ``T*K % E = r > 0``. ``"best"``: the
            r that give the best total, optimised together with the assignment. ``"lowest"``:
            experts 0 .. r-1, loads known from (T, E, K) alone (`expert_capacities`; what the
            expert-parallel static path needs).

    Returns:
        expert_idx (T, K) int64. Every expert receives ``T*K // E`` tokens or one more, r of
        them one more (under ``"lowest"`` exactly ``expert_capacities(T, E, k)[e]``), and no
        token holds an expert twice. When the certificate passes (always, unless the cycle cap
        is reached, which raises a warning) the total score is within ``(2 * T * K + E) * eps
        * R`` of the optimum over all such loads (over the fixed loads under ``"lowest"``,
        within ``2 * T * K * eps * R``).

    Algorithm (docs/routing.md): estimate the E dual prices; every token picks its K best experts
    under them, full experts keep their highest-margin tokens and the dropped slots go to the
    best experts with room; then exchange cycles between experts remove every improvement, and
    a check of every token the final prices could fault certifies the result. Every loop is
    bounded, and the output is a deterministic function of the input. CPU problems at K = 1 with
    T * E <= 16384 run every step in numpy (`small`), where a pick that fills every expert
    exactly under the prices needs no cycles (the prices prove it optimal).

    Host syncs: none inside the price iterations; one for the normalisation, one or two to
    decide how many full price updates to run, two to list the pairs near each token's best and
    size their table, a few for the pick and the refill, a few copies of the candidates' scores
    and slots to the host (the refill and the exchange-cycle search run there, in numpy, on
    (E, C) and (E, E) arrays) and their slots back, and a few per certificate check (usually one check). A
    bounded number, whatever the input.
    """
    out, _, done, budget = _balanced(scores_TE, k, max_iters, eps, max_cycles, extras, with_prices=False)
    if not done:
        warnings.warn(
            f"balanced_assignment: the exchange-cycle budget (max_cycles={budget}) ran out before the "
            "optimality certificate passed; the assignment is balanced but may be suboptimal",
            RuntimeWarning,
            stacklevel=2,
        )
    return out


def balanced_prices(
    scores_TE: Tensor,
    k: int = 1,
    *,
    max_iters: int = MAX_ITERS,
    eps: float = 1e-6,
    max_cycles: int | None = None,
    extras: str = "best",
) -> tuple[Tensor, Tensor | None, bool]:
    """`balanced_assignment` (the same arguments, checks and assignment), with prices that
    certify it: under them every token holds K of its best experts less the prices, within the
    solver's tolerance. The exchange cycles' last search ends from the prices the tokens were
    picked under, so the prices are those raised only where a move needs it (what a group
    start, `moe.parallel.price_base`, takes from a rank's own tokens), not the search's
    distances from zero.

    Returns (expert_idx (T, K), prices (E,) float64 in the scores' units with mean zero, or
    None where there was no choice to make, where every token's scores are all equal, or where
    the scores' range exceeds float64's (fp64 scores near 1e308: in their units the prices
    would not be finite), certified: False where the cycle budget ran out first; then the
    prices are the last search's)."""
    out, prices, done, _ = _balanced(scores_TE, k, max_iters, eps, max_cycles, extras, with_prices=True)
    return out, prices, done


def _balanced(scores_TE, k, max_iters, eps, max_cycles, extras, with_prices):
    """(the assignment, the prices as `balanced_prices` returns them where ``with_prices``, else
    None, certified, the cycle budget)."""
    _check_extras(extras)
    trivial = _nothing_to_solve(scores_TE, k, max_iters, max_cycles, eps, check_finite=True)
    if trivial is not None:
        return trivial, None, True, max_cycles
    num_tokens, num_experts = scores_TE.shape
    device = scores_TE.device
    # cheaper per op than no_grad (the result is cloned out of it); on the CPU, on the thread
    # count measured faster for this size (`threads`: a busy core stalls every parallel op)
    with torch.inference_mode(), _threads_for(scores_TE, k):
        work = _Work(scores_TE, sync_ok=True)
        s, unit = _normalise_unit(scores_TE, jitter=eps / 2, work=work)
        caps = _Capacities(num_tokens, num_experts, k, extras, device, host=device.type == "cpu")
        budget = num_tokens * k + num_experts if max_cycles is None else max_cycles
        delta = max(eps, 8 * torch.finfo(s.dtype).eps)  # below this, gains are rounding noise
        if k == 1 and device.type == "cpu" and num_tokens * num_experts <= SMALL:
            out, done, p = _host_solve(s, caps, max_iters, delta, budget, with_prices)
        else:
            out, done, p = _solve(s, caps, k, max_iters, delta, budget, work, with_prices)
    prices = None
    if with_prices and 0 < unit < float("inf"):  # outside inference mode: a normal tensor
        prices = torch.as_tensor(p).to(device=device, dtype=torch.float64).reshape(-1) * unit
        prices = prices - prices.mean() if bool(prices.isfinite().all()) else None
    return out.clone(), prices, done, budget  # a normal tensor: an inference tensor cannot be saved for backward


def _solve(
    s: Tensor, caps: _Capacities, k: int, max_iters: int, delta: float, budget: int, work: _Work, with_prices: bool
) -> tuple[Tensor, bool, Tensor]:
    """The assignment (T, K), False if the cycle budget ran out before the certificate, and the
    cycles' final prices (E,) (their searches end from the pick's prices ``with_prices``)."""
    p, cap, out, margin = _start(s, caps, k, max_iters, work)
    # candidates for exchange cycles: tokens near a boundary under p, and those refilled
    near = (margin < 0.005) | (out < 0).any(dim=1)
    swapped = _fill(s, out, cap, p)
    if swapped:  # moved off their best experts by the fill's exchanges
        near[swapped] = True
    candidates = torch.nonzero(near).flatten()
    done, prices = _cancel(
        s, out, max_cycles=budget, delta=delta, candidates=candidates, basis=(p, margin), movable=caps.movable,
        start=p if with_prices else None,
    )  # fmt: skip
    return out, done, prices


def _start(s: Tensor, caps: _Capacities, k: int, max_iters: int, work: _Work) -> tuple[Tensor, ...]:
    """The prices (E, 1), the loads they aim at (E,), the pick under them (T, K; -1 where
    dropped) and every token's margin (T,)."""
    num_tokens, num_experts = s.shape[1], s.shape[0]
    p, pairs = _prices(s, caps, k, max_iters, work)
    cap = caps.at(p)  # the loads the pick and the fill aim at; the cycles may still move extras
    picked = None if pairs is None else pairs.select(p, cap)
    out, margin = _select(s, p, k, cap, work) if picked is None else picked
    for _ in range(3):  # many dropped slots (tie-heavy scores): the prices need more updates
        if int((out < 0).sum()) <= max(num_tokens * k // 100, num_experts):
            break
        p = _jacobi_prices(s, caps, k, max(max_iters, 2), p, work=work)[0]
        cap = caps.at(p)
        out, margin = _select(s, p, k, cap, work)
    return p, cap, out, margin


def _host_solve(
    s: Tensor, caps: _Capacities, max_iters: int, delta: float, budget: int, with_prices: bool
) -> tuple[Tensor, bool, np.ndarray]:
    """`_solve` for small CPU problems at K = 1 (`small`), every step in numpy. When every
    token's best expert under the prices is unique and every expert leads exactly its load, the
    pick meets the prices' bound (`assignment_bound`): it is optimal, with nothing to fill or
    exchange, and those prices certify it."""
    state = host_prices(_HostPrices(s.numpy(), caps), max_iters)
    out, margin = state.pick()
    for _ in range(3):  # as in `_start`
        if int((out < 0).sum()) <= max(s.shape[1] // 100, s.shape[0]):
            break
        state = host_prices(state, max(max_iters, 2))
        out, margin = state.pick()
    if state.balanced():
        done, prices = True, state.p
    else:
        done, prices = host_finish(state, out, margin, delta, budget, start=with_prices)
    return torch.from_numpy(out)[:, None], done, prices


def _threads_for(scores_TE: Tensor, k: int):
    if scores_TE.device.type != "cpu":
        return contextlib.nullcontext()
    num_tokens, num_experts = scores_TE.shape  # sizes within a factor of 2 share a choice
    return solve_threads((1 << max(num_tokens - 1, 0).bit_length(), num_experts, k, scores_TE.dtype))
