"""Loads of an exactly balanced assignment: the capacities, the score, a feasible start.

Legend: T tokens, E experts, K experts per token; T * K = b * E + r with 0 <= r < E.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch
from torch import Tensor

from ..common import bincount
from .inputs import _check


def _split(num_tokens: int, num_experts: int, k: int) -> tuple[int, int]:
    """``divmod(T * K, E)`` of checked arguments (see `expert_capacities`)."""
    for name, value in (("num_tokens", num_tokens), ("num_experts", num_experts), ("k", k)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    num_tokens, num_experts, k = int(num_tokens), int(num_experts), int(k)
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if not 1 <= k <= num_experts:
        raise ValueError(f"k must be in [1, num_experts={num_experts}] (a token's experts are distinct), got {k}")
    return divmod(num_tokens * k, num_experts)


def expert_capacities(num_tokens: int, num_experts: int, k: int = 1, *, device=None) -> Tensor:
    """Tokens per expert under exact balance: (E,) int64.

    ``T*K`` slots are split as evenly as possible; when ``T*K % E = r > 0`` the experts with the
    lowest indices, ``0 .. r-1``, receive one slot more than the others. Made on the device (a
    tensor built from a host list would be a blocking copy on CUDA). This is the rule of
    ``extras="lowest"``, which fixes the loads from (T, E, K) alone; under ``extras="best"`` the
    solvers choose which r experts take the extra slot (`_Capacities`).

    Every argument is an int (a bool is not), ``num_tokens >= 0`` and ``1 <= k <= num_experts``
    (a token holds distinct experts), so no expert is given more than T tokens.
    """
    base, extra = _split(num_tokens, num_experts, k)
    caps = torch.full((num_experts,), base, dtype=torch.int64, device=device)
    return caps + (torch.arange(num_experts, device=device) < extra)


def expert_capacities_list(num_tokens: int, num_experts: int, k: int = 1) -> list[int]:
    """`expert_capacities` as a Python list, made on the host: for split sizes known without
    reading a tensor back (also under FakeTensorMode)."""
    base, extra = _split(num_tokens, num_experts, k)
    return [base + (e < extra) for e in range(num_experts)]


def assignment_score(scores_TE: Tensor, expert_idx_TK: Tensor) -> Tensor:
    """Total score of an assignment (dropped slots, ``-1``, count zero): scalar in float64."""
    valid = expert_idx_TK >= 0
    picked = scores_TE.gather(1, expert_idx_TK.clamp(min=0)).double()  # no float64 copy of every score
    return (picked * valid).sum()


def assignment_bound(
    scores_TE: Tensor, prices_E: Tensor, k: int = 1, *, extras: str = "best", block: int = 1 << 16
) -> Tensor:
    """An upper bound on the total score (`assignment_score`) of every exactly balanced
    assignment of ``scores_TE``: K distinct experts per token, the loads of
    `expert_capacities` under ``extras`` ("best": any r experts take the extra slots).

    From any prices (E,): every token's K best ``s - p`` summed, plus the loads times the prices
    (under "best", the r extra slots at the r highest prices). That is weak duality of the
    transportation problem: no balanced assignment scores more, whatever the prices. At the
    prices of an optimal assignment the bound equals its score up to the solver's tolerance,
    so ``bound - score`` small proves an assignment optimal without a second solve (and one
    that is not optimal cannot pass it with any prices). Reads the scores ``block`` tokens at a
    time; float64 scalar.
    """
    _check_extras(extras)
    _check(scores_TE, k, "scores_TE")
    num_tokens, num_experts = scores_TE.shape
    if not isinstance(prices_E, Tensor) or tuple(prices_E.shape) != (num_experts,):
        got = tuple(prices_E.shape) if isinstance(prices_E, Tensor) else type(prices_E).__name__
        raise ValueError(f"prices_E must be a tensor of shape (E={num_experts},), got {got}")
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"block must be an int >= 1, got {block!r}")
    base, spare = _split(num_tokens, num_experts, k)
    p = prices_E.to(device=scores_TE.device, dtype=torch.float64)
    total = p.new_zeros(())
    for x in scores_TE.split(block):
        total += (x.double() - p).topk(k, dim=1).values.sum()
    if extras == "lowest":
        return total + (expert_capacities(num_tokens, num_experts, k, device=p.device) * p).sum()
    return total + base * p.sum() + p.topk(spare).values.sum()


def _round_robin(num_tokens: int, num_experts: int, k: int, device) -> Tensor:
    """A feasible balanced assignment: slot i (token-major) goes to expert i mod E."""
    return (torch.arange(num_tokens * k, device=device) % num_experts).view(num_tokens, k)


def _loads(out_TK: Tensor, num_experts: int) -> Tensor:
    """(E,) slots each expert holds (-1 slots hold none), without a host sync."""
    return bincount(torch.where(out_TK < 0, num_experts, out_TK), num_experts + 1)[:num_experts]


EXTRAS = ("best", "lowest")


def _check_extras(extras: str) -> None:
    if extras not in EXTRAS:
        raise ValueError(f"extras must be one of {EXTRAS}, got {extras!r}")


class _Capacities:
    """The loads one solve aims at, from the prices (E, 1) as they settle.

    ``"lowest"``, or no remainder (r = 0): `expert_capacities`, whatever the prices. ``"best"``:
    every expert takes b and the r experts with the highest prices one more (ties: the lowest
    index, so prices all 0 give the lowest rule). That is the dual of the optional slots
    (docs/routing.md): at the optimum the holder of the unused slots holds the E - r experts
    with the lowest prices. No host sync, unless ``host`` (a CPU solve that may read its
    values: the ranking then runs in numpy, a few microseconds against tens for torch's ops).
    """

    def __init__(self, num_tokens: int, num_experts: int, k: int, extras: str, device, host: bool = False) -> None:
        _check_extras(extras)
        self.host = host
        self.base, self.spare = divmod(num_tokens * k, num_experts)
        self.fixed = expert_capacities(num_tokens, num_experts, k, device=device)
        self.movable = extras == "best" and self.spare > 0
        # an upper bound of every expert's load, for sizing tables
        self.upper = self.fixed if not self.movable else torch.full_like(self.fixed, self.base + 1)

    def at(self, p: Tensor | None) -> Tensor:
        """(E,) int64 capacities under prices ``p`` (None: before any price is known)."""
        if not self.movable or p is None:
            return self.fixed
        if self.host:
            return torch.from_numpy(self.at_host(p.numpy().ravel()))
        order = torch.sort(p.view(-1), descending=True, stable=True).indices
        return self.fixed.new_full(self.fixed.shape, self.base).index_fill_(0, order[: self.spare], self.base + 1)

    def at_host(self, p_E: np.ndarray) -> np.ndarray:
        """`at` in numpy, from the prices on the host."""
        cap = np.full(p_E.shape[0], self.base, dtype=np.int64)
        cap[np.argsort(-p_E, kind="stable")[: self.spare]] += 1
        return cap
