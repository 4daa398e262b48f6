"""Differentiable all-to-all with uneven splits.

Rank r sends ``x[sum(input_splits[:j]) : ...]`` (``input_splits[j]`` rows) to rank j and receives
``output_splits[j]`` rows from rank j, stacked in rank order. The backward is the all-to-all of
the gradient with the splits swapped. Zero-length splits are allowed; any dtype the backend
carries (gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

__all__ = ["all_gather_rows", "all_to_all", "reduce_scatter_rows"]


def _splits(name: str, splits: Sequence[int], world: int) -> list[int]:
    out = [int(s) for s in splits]
    if len(out) != world or any(s < 0 for s in out):
        raise ValueError(f"{name} must hold {world} non-negative sizes (one per rank of the group), got {out}")
    return out


def all_to_all(x: Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group=None) -> Tensor:
    """Exchange the rows of ``x`` (first dimension) between the ranks of ``group``.

    Args:
        x: (N, ...) with N = sum(input_splits).
        output_splits: rows received from each rank; their sum is the result's first dimension.
        input_splits: rows sent to each rank.
        group: a process group (default: the world).

    The splits are checked locally (a ValueError, before any communication); that every rank's
    output_splits match the senders' input_splits is the caller's contract (the dispatcher
    exchanges counts first), as in ``torch.distributed.all_to_all_single``.
    """
    group = group or dist.group.WORLD
    world = dist.get_world_size(group)
    ins = _splits("input_splits", input_splits, world)
    outs = _splits("output_splits", output_splits, world)
    if sum(ins) != x.shape[0]:
        raise ValueError(f"input_splits must sum to x's first dimension {x.shape[0]}, got {ins} (sum {sum(ins)})")
    return wait_tensor(all_to_all_single_autograd(x.contiguous(), outs, ins, group))


def all_gather_rows(x: Tensor, sizes: Sequence[int], group=None) -> Tensor:
    """Every rank's rows, stacked in rank order: ``sizes[j]`` rows from rank j (uneven allowed;
    this rank's must be ``x.shape[0]``). Differentiable: the backward sums each rank's gradient
    for this rank's rows (`reduce_scatter_rows`)."""
    group = group or dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(sizes) != world or sizes[rank] != x.shape[0]:
        raise ValueError(f"sizes must hold {world} row counts with this rank's {x.shape[0]} at {rank}, got {sizes}")
    sent = x.unsqueeze(0).expand(world, *x.shape).reshape(world * x.shape[0], *x.shape[1:])
    return all_to_all(sent, sizes, [x.shape[0]] * world, group)


def reduce_scatter_rows(y: Tensor, sizes: Sequence[int], group=None) -> Tensor:
    """Sum ``y`` (rows of every rank, ``sizes[j]`` for rank j, stacked) over the ranks and keep
    this rank's rows. Differentiable: the backward is `all_gather_rows` of the gradient."""
    group = group or dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(sizes) != world or sum(sizes) != y.shape[0]:
        raise ValueError(f"sizes must hold {world} row counts summing to {y.shape[0]}, got {sizes}")
    mine = sizes[rank]
    parts = all_to_all(y, [mine] * world, list(sizes), group)
    return parts.view(world, mine, *y.shape[1:]).sum(0)
