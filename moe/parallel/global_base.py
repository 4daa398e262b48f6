"""Global BASE: one balanced assignment over the tokens of a whole group of ranks.

Legend: T tokens on this rank, E experts, K slots per token.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from .agreement import exchange_sizes
from .all_to_all import all_gather_rows
from .dispatch import raise_if_peers_failed

__all__ = ["GroupBalance"]


class GroupBalance:
    """`BaseRouter.assign` over a group: the scores of every rank are gathered, every rank solves
    the same balanced assignment over all of them and keeps its own rows, so each expert gets
    exactly its share of the group's tokens. Cost per call: the gather (each rank receives the
    group's (sum T, E) fp32 scores) and a solve over sum T tokens on every rank."""

    def __init__(self, group, solver) -> None:
        self.group, self.solver = group, solver
        self.agreement = None  # the layer's `Agreement`, told when the exchange has run

    def __call__(self, scores_TE: Tensor, k: int, **options) -> Tensor:
        sizes = exchange_sizes(scores_TE.shape[0], self.group, scores_TE.device)
        if self.agreement is not None:
            self.agreement.passed("global")
        raise_if_peers_failed(sizes, self.group, "exchange")
        rows = all_gather_rows(scores_TE.detach(), sizes, self.group)  # the same (sum T, E) everywhere
        idx = self.solver(rows, k, **options)
        start = sum(sizes[: dist.get_rank(self.group)])
        return idx[start : start + scores_TE.shape[0]]
