"""Global BASE: one balanced assignment over the tokens of a whole group of ranks.

Legend: T tokens on this rank, E experts, K slots per token.
"""

from __future__ import annotations

import hashlib
import struct
import warnings
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..routing.balanced import balanced_assignment
from ..routing.common import in_backward
from .agreement import exchange_sizes
from .all_to_all import all_gather_rows
from .dispatch import raise_if_peers_failed
from .price_base import agree, fail_agreement, price_balanced_assignment
from .reduction import GroupReduce

__all__ = ["GroupBalance", "METHODS"]

METHODS = ("prices", "gather")
# forwards a re-run can find: more than the micro-batches a pipeline schedule keeps in flight
KEEP = 256
# the newest forwards that keep their routes (older ones their start alone: their re-runs solve)
KEEP_ROUTES = 64
_HASH_BITS = 50  # a rank's fingerprint in the header's float64 slot, with the re-run bit


@dataclass(eq=False)
class _Forward:
    """What a forward of the price method leaves for its activation-checkpointing re-run."""

    key: tuple[int, ...]  # every rank's `_fingerprint` of its scores, in group order: the same on every rank
    start: Tensor | None  # the prices it started from (the same on every rank)
    routes: Tensor | None  # its (T, K) experts in the narrowest integer type, once re-runs are seen


def _fingerprint(scores_TE: Tensor, k: int) -> int:
    """A `_HASH_BITS`-bit hash of k, the shape and three integer sums of the scores' bits (all
    of them; by row, weighted by the row's place; by column, likewise): a re-run's recomputed
    scores are the forward's bit for bit. Integer sums wrap the same in any order, so it does not
    depend on how the device reduces. Two passes over the scores, no (T, E) temporary, one host
    sync."""
    x = scores_TE.detach().contiguous()
    dtype = {1: torch.uint8, 2: torch.int16}.get(x.element_size(), torch.int32)
    bits = x.view(dtype).reshape(x.shape[0], x.shape[1] * x.element_size() // dtype.itemsize)
    rows, cols = bits.sum(dim=1, dtype=torch.int64), bits.sum(dim=0, dtype=torch.int64)
    place = [torch.arange(n, dtype=torch.int64, device=x.device).mul_(2).add_(1) for n in (rows.numel(), cols.numel())]
    sums = torch.stack([rows.sum(), (rows * place[0]).sum(), (cols * place[1]).sum()]).tolist()
    digest = hashlib.blake2b(struct.pack("<6q", k, *x.shape, *sums), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - _HASH_BITS)


def _narrow(idx_TK: Tensor, num_experts: int) -> Tensor:
    dtype = torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 2**15 else torch.int32
    return idx_TK.to(dtype)


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
    ``base_round_bytes``), the same on every rank. An activation-checkpointing re-run with
    ``"prices"`` routes as its forward did, from the routes or the start that forward kept
    (`_by_prices`)."""

    def __init__(self, group, solver, method: str = "prices", round_bytes: float = 0.0) -> None:
        if method not in METHODS:
            raise ValueError(f"global_base method must be one of {METHODS}, got {method!r}")
        self.group, self.solver, self.round_bytes = group, solver, round_bytes
        self.method = method if solver is balanced_assignment else "gather"
        self.agreement = None  # the layer's `Agreement`, told when the exchange has run
        self.prices: Tensor | None = None  # (E,) the last call's, the next call's start
        self._start: Tensor | None = None  # what the last forward started from
        self._kept: deque[_Forward] = deque(maxlen=KEEP)  # the last forwards, for their re-runs (oldest first)
        self._reruns = False  # a re-run has come: forwards keep their routes
        self.stats = None  # the last solve's `PriceStats` (a re-run that takes its routes solves none)

    @classmethod
    def around(cls, router, group, method: str = "prices") -> GroupBalance:
        """A `GroupBalance` over ``group`` around ``router``'s own solve, at its config's price
        of a round (``base_round_bytes``); the caller sets it as ``router.assign``."""
        return cls(group, solver=router.assign, method=method, round_bytes=router.config.base_round_bytes)

    def __call__(self, scores_TE: Tensor, k: int, **options) -> Tensor:
        if self.method == "prices":
            return self._by_prices(scores_TE.detach(), k, options)
        sizes = self._exchange(scores_TE.shape[0], scores_TE.device)
        rows = all_gather_rows(scores_TE.detach(), sizes, self.group)  # the same (sum T, E) everywhere
        idx = self.solver(rows, k, **options)
        start = sum(sizes[: dist.get_rank(self.group)])
        return idx[start : start + scores_TE.shape[0]]

    def _exchange(self, n: int, device: torch.device) -> list[int]:
        """The "global" stage of the gathered path: every rank's ``n`` (-1 where a rank failed:
        every rank raises)."""
        sent = exchange_sizes(n, self.group, device)
        self._passed()
        raise_if_peers_failed(sent, self.group, "exchange")
        return sent

    def _passed(self) -> None:
        if self.agreement is not None:
            self.agreement.passed("global")

    def fail(self, device: torch.device) -> None:
        """This rank failed before the "global" stage: run the stage's collective with a failure
        notice, so every other rank raises there (`Agreement.relay`)."""
        if self.method == "prices":
            fail_agreement(GroupReduce(self.group), device)
        else:
            exchange_sizes(-1, self.group, device)

    def _by_prices(self, scores_TE: Tensor, k: int, options: dict) -> Tensor:
        """The solve's header is the "global" stage: it carries each rank's failure notice and
        its tag, so a call takes no round beside the solve's. An activation-checkpointing re-run
        routes as its forward did, whatever ran between them and in whatever order the re-runs
        come (a pipeline schedule runs several micro-batches' forwards before their backwards;
        one backward of summed losses re-runs them last first): each rank's tag is its scores'
        fingerprint and whether it re-runs, so every rank reads the group's fingerprints and
        finds the same kept forward by them. A re-run takes that forward's routes where it kept
        them (no more rounds), else solves again from its start."""
        rerun = in_backward()
        kwargs = {key: options[key] for key in ("extras", "eps", "max_cycles") if key in options}
        red = GroupReduce(self.group)
        tag = 2 * _fingerprint(scores_TE, k) + rerun
        # declared before the start is known (alike on every rank: the same history), so the
        # solve checks the other options against the header
        given = (self._start if rerun else self.prices) is not None
        try:
            header = agree([scores_TE], k, red, tags=[tag], prices_given=given, round_bytes=self.round_bytes, **kwargs)
        finally:
            if red.rounds:  # it ran (else an option was refused first: the relay runs it)
                self._passed()
        raise_if_peers_failed([-int(j in header.failed) for j in range(red.world)], self.group, "exchange")
        if len({t % 2 for t in header.tags}) > 1:
            ranks = dist.get_process_group_ranks(self.group)
            raise ValueError(
                f"global BASE: the ranks {ranks} disagree on whether this call is an activation-checkpointing "
                f"re-run (in a backward: {[bool(t % 2) for t in header.tags]}); they must run the same schedule"
            )
        key = tuple(t // 2 for t in header.tags)
        if rerun:
            self._reruns = True
            found = next((f for f in self._kept if f.key == key), None)
            if found is not None:
                self._kept.remove(found)  # by identity (`_Forward` compares as objects)
            if found is not None and found.routes is not None:
                return found.routes.to(torch.int64)
            if found is None:
                warnings.warn(
                    "global BASE: an activation-checkpointing re-run's scores match none of the last "
                    f"{KEEP} forwards' (more micro-batches in flight, or scores recomputed otherwise); it solves "
                    "from the last forward's start, which may route tied tokens otherwise",
                    RuntimeWarning,
                    stacklevel=2,
                )
            start = self._start if found is None else found.start
        else:
            start = self.prices
        if start is not None and start.numel() != scores_TE.shape[-1]:
            start = None
        (idx,), prices, self.stats = price_balanced_assignment(
            [scores_TE], k, red, prices=start, round_bytes=self.round_bytes, header=header, **kwargs
        )
        if not rerun:
            self._start, self.prices = start, None if prices is None else prices.to(torch.float64).cpu()
            routes = _narrow(idx, scores_TE.shape[-1]) if self._reruns else None
            self._kept.append(_Forward(key, start, routes))
            if len(self._kept) > KEEP_ROUTES:
                self._kept[-KEEP_ROUTES - 1].routes = None
        return idx
