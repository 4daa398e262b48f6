"""The few collectives a distributed solver agrees through, behind one small interface with two
implementations that run the same solver code.

Legend: W ranks, n values of a reduced tensor, R rows of C values.

A solver written against `Reduction` holds a list of *local shards* (their group ranks in
``ranks``) and calls ``sum``, ``max`` and ``gather`` with one tensor per local shard:

- `GroupReduce`: one shard, this rank's, and the calls are torch.distributed collectives over a
  process group (gloo or NCCL): ``all_reduce`` for the sums and maxima, the rows by
  `all_gather_rows`.
- `ShardReduce`: W shards in one process, standing in for W ranks: the calls reduce over the
  list. The same code then simulates a solve at cluster scale on one machine.

Both count what travels: ``rounds`` (collectives), ``values`` and ``bytes`` (what each rank
receives: n per reduction of n values, every rank's rows for a gather; a ring all-reduce sends
about 2n).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .all_to_all import all_gather_rows

__all__ = ["GroupReduce", "Reduction", "ShardReduce"]


class Reduction:
    """``ranks``: the group ranks of the local shards; ``world``: W. Subclasses implement
    `_sum`, `_max` and `_gather`; the public calls count the traffic."""

    ranks: list[int]
    world: int

    def __init__(self) -> None:
        self.rounds = 0
        self.values = 0  # elements received per rank, over all calls
        self.bytes = 0  # and their bytes
        self.log: list[tuple[str, int, int]] = []  # (kind, values, bytes) per call

    def _count(self, kind: str, values: int, itemsize: int) -> None:
        size = values * itemsize
        self.rounds += 1
        self.values += values
        self.bytes += size
        self.log.append((kind, values, size))

    def sum(self, parts: Sequence[Tensor]) -> Tensor:
        """The sum over every rank of one tensor per local shard (integers sum exactly)."""
        self._count("sum", parts[0].numel(), parts[0].element_size())
        return self._sum(parts)

    def max(self, parts: Sequence[Tensor]) -> Tensor:
        """The elementwise maximum over every rank (finite values: NaN is not agreed)."""
        self._count("max", parts[0].numel(), parts[0].element_size())
        return self._max(parts)

    def gather(self, parts: Sequence[Tensor], sizes: Sequence[int]) -> Tensor:
        """Every rank's rows (``sizes[j]`` from rank j, known to all), stacked in rank order."""
        width = parts[0].shape[1] if parts[0].dim() > 1 else 1
        self._count("gather", sum(sizes) * width, parts[0].element_size())
        return self._gather(parts, sizes)


class ShardReduce(Reduction):
    """W ranks simulated in one process: every shard is local, the reductions run over the list."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world, self.ranks = world, list(range(world))

    def _sum(self, parts):
        return torch.stack(list(parts)).sum(0)

    def _max(self, parts):
        return torch.stack(list(parts)).amax(0)

    def _gather(self, parts, sizes):
        return torch.cat(list(parts))


class GroupReduce(Reduction):
    """This rank's shard, reduced over a torch.distributed process group."""

    def __init__(self, group=None) -> None:
        super().__init__()
        self.group = group or dist.group.WORLD
        self.world, self.ranks = dist.get_world_size(self.group), [dist.get_rank(self.group)]

    def _reduce(self, parts, op):
        (t,) = parts
        t = t.clone()
        dist.all_reduce(t, op=op, group=self.group)
        return t

    def _sum(self, parts):
        return self._reduce(parts, dist.ReduceOp.SUM)

    def _max(self, parts):
        return self._reduce(parts, dist.ReduceOp.MAX)

    def _gather(self, parts, sizes):
        (t,) = parts
        return all_gather_rows(t, list(sizes), self.group)
