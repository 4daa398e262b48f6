"""Global BASE: one balanced assignment over the tokens of a whole group of ranks.

Legend: T tokens on this rank, E experts, K slots per token.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..routing.balanced import balanced_assignment
from ..routing.common import in_backward
from .agreement import exchange_sizes
from .all_to_all import all_gather_rows
from .dispatch import raise_if_peers_failed
from .price_base import price_balanced_assignment
from .reduction import GroupReduce

__all__ = ["GroupBalance", "METHODS"]

METHODS = ("prices", "gather")


class GroupBalance:
    """`BaseRouter.assign` over a group, so each expert gets exactly its share of the group's
    tokens, the group's optimum (each rank keeps its own rows).

    ``method="prices"`` (with the exact solver): `price_balanced_assignment`, the ranks agree
    through the experts' prices, a few counts and the rows at the margin (docs/parallel.md); the
    prices of this layer's previous call are the start of the next, and the first call starts
    from the median of each rank's prices for its own tokens. ``"gather"``, and always with
    another solver (the sync-free approx one): the scores of every rank are gathered and every
    rank solves the whole problem with ``solver``. Its cost per call: each rank receives the
    group's (sum T, E) fp32 scores and solves over sum T tokens. ``round_bytes``: what a round
    of collectives costs, in bytes (`price_balanced_assignment`; the router config's
    ``base_round_bytes``), the same on every rank."""

    def __init__(self, group, solver, method: str = "prices", round_bytes: float = 0.0) -> None:
        if method not in METHODS:
            raise ValueError(f"global_base method must be one of {METHODS}, got {method!r}")
        self.group, self.solver, self.round_bytes = group, solver, round_bytes
        self.method = method if solver is balanced_assignment else "gather"
        self.agreement = None  # the layer's `Agreement`, told when the exchange has run
        self.prices: Tensor | None = None  # (E,) the last call's, the next call's start
        self._start: Tensor | None = None  # what the last forward started from (for a re-run)
        self.stats = None  # the last call's `PriceStats`

    @classmethod
    def around(cls, router, group, method: str = "prices") -> GroupBalance:
        """A `GroupBalance` over ``group`` around ``router``'s own solve, at its config's price
        of a round (``base_round_bytes``); the caller sets it as ``router.assign``."""
        return cls(group, solver=router.assign, method=method, round_bytes=router.config.base_round_bytes)

    def __call__(self, scores_TE: Tensor, k: int, **options) -> Tensor:
        sizes = exchange_sizes(scores_TE.shape[0], self.group, scores_TE.device)
        if self.agreement is not None:
            self.agreement.passed("global")
        raise_if_peers_failed(sizes, self.group, "exchange")
        if self.method == "prices":
            return self._by_prices(scores_TE.detach(), k, options)
        rows = all_gather_rows(scores_TE.detach(), sizes, self.group)  # the same (sum T, E) everywhere
        idx = self.solver(rows, k, **options)
        start = sum(sizes[: dist.get_rank(self.group)])
        return idx[start : start + scores_TE.shape[0]]

    def _by_prices(self, scores_TE: Tensor, k: int, options: dict) -> Tensor:
        # an activation-checkpointing re-run starts where its forward did, so it routes the same
        rerun = in_backward()
        start = self._start if rerun else self.prices
        if start is not None and start.numel() != scores_TE.shape[-1]:
            start = None
        kwargs = {key: options[key] for key in ("extras", "eps", "max_cycles") if key in options}
        (idx,), prices, self.stats = price_balanced_assignment(
            [scores_TE], k, GroupReduce(self.group), prices=start, round_bytes=self.round_bytes, **kwargs
        )
        if not rerun:
            self._start, self.prices = start, None if prices is None else prices.to(torch.float64).cpu()
        return idx
