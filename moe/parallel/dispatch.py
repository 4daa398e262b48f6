"""Expert-parallel dispatch: send expert-sorted rows to the ranks that own the experts, and back.

Legend: W ranks in the expert-parallel group, E experts, El = E / W experts per rank (rank r owns
experts [r*El, (r+1)*El)), M rows sorted by expert on this rank, M' rows this rank's experts get.

dispatch: the per-expert counts are exchanged first (one small all-to-all), so every rank knows
how many rows it receives from each rank for each of its experts; the rows then travel with one
all-to-all and are re-sorted from (source rank, expert) to (expert, source rank) order, so each
local expert's rows are contiguous for the grouped GEMM. combine undoes both steps. Both are
differentiable. Host syncs: one, to read the exchanged counts; none when the counts are known
in advance (``known_counts``: BASE's static splits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .all_to_all import all_to_all

__all__ = ["DispatchInfo", "combine", "dispatch"]


@dataclass(frozen=True)
class DispatchInfo:
    send_splits: list[int]  # (W,) rows sent to each rank
    recv_splits: list[int]  # (W,) rows received from each rank
    local_order: Tensor  # (M',) received row of each local row (expert-major order)
    group: object  # the process group


def dispatch(
    x_MD: Tensor, counts_E: Tensor, group=None, *, known_counts: list[int] | None = None
) -> tuple[Tensor, Tensor, DispatchInfo]:
    """Rows sorted by (global) expert on this rank -> rows of this rank's experts, sorted by local
    expert: returns x_local (M', D), local counts (El,), and the info `combine` needs.

    ``known_counts``: the (E,) per-expert row counts when every rank of the group is known to
    send exactly these (BASE's balanced loads with the same number of tokens on every rank). The
    splits then follow on the host: no count exchange and no device-to-host sync. It is the
    caller's contract that they hold on every rank; ``counts_E`` is not read.
    """
    group = group or dist.group.WORLD
    world = dist.get_world_size(group)
    num_experts = counts_E.numel()
    if num_experts % world:
        raise ValueError(f"the {num_experts} experts must split evenly over the {world} ranks of the group")
    per_rank = num_experts // world
    if known_counts is not None:
        if len(known_counts) != num_experts or sum(known_counts) != x_MD.shape[0]:
            raise ValueError(
                f"known_counts must hold {num_experts} counts summing to the {x_MD.shape[0]} rows, got {known_counts}"
            )
        rank = dist.get_rank(group)
        send = [list(known_counts[j * per_rank : (j + 1) * per_rank]) for j in range(world)]
        recv = [list(known_counts[rank * per_rank : (rank + 1) * per_rank])] * world
        recv_WE = torch.tensor(recv, dtype=torch.int64).to(x_MD.device, non_blocking=True)
    else:
        send_E = counts_E.to(torch.int64)
        recv_WE = all_to_all(send_E, [per_rank] * world, [per_rank] * world, group).view(world, per_rank)
        send, recv = send_E.view(world, per_rank).tolist(), recv_WE.tolist()  # host sync: the sizes
    send_splits, recv_splits = [sum(row) for row in send], [sum(row) for row in recv]
    x_recv = all_to_all(x_MD, recv_splits, send_splits, group)
    # received layout: by source rank, then expert; local layout: by expert, then source rank
    total = sum(recv_splits)
    flat = recv_WE.reshape(-1)
    lens = recv_WE.T.reshape(-1)  # (El * W,) expert-major
    starts = (torch.cumsum(flat, 0) - flat).view(world, per_rank).T.reshape(-1)
    seg_start = torch.cumsum(lens, 0) - lens
    offset = torch.arange(total, device=x_MD.device) - torch.repeat_interleave(seg_start, lens, output_size=total)
    local_order = torch.repeat_interleave(starts, lens, output_size=total) + offset
    info = DispatchInfo(send_splits, recv_splits, local_order, group)
    return x_recv[local_order], recv_WE.sum(0), info


def combine(y_local: Tensor, info: DispatchInfo) -> Tensor:
    """The inverse of `dispatch` for the experts' outputs: (M', D) local rows -> (M, D) in this
    rank's original expert-sorted order."""
    y_recv = torch.zeros_like(y_local).index_copy(0, info.local_order, y_local)
    return all_to_all(y_recv, info.send_splits, info.recv_splits, info.group)
