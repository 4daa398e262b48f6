"""Expert-parallel dispatch: send rows to the ranks that own their experts, and back.

Legend: W ranks in the expert-parallel group, E experts, El = E / W experts per rank (rank r owns
experts [r*El, (r+1)*El)), M rows on this rank, M' rows this rank's experts get.

The per-expert counts are exchanged first (one small all-to-all), so every rank knows how many
rows it receives from each rank for each of its experts. The rows then travel so that each
local expert's rows arrive contiguous (expert-major, then by source rank), ready for the grouped
GEMM. Two ways to get there (``strategy``):

- "resort": the rows are sent sorted by global expert (so by destination rank), one all-to-all
  moves them, and a local gather re-sorts them from (source rank, expert) to (expert, source
  rank) order. One collective per direction plus one extra pass over the rows in memory.
- "per_expert": the rows are sent sorted by (local expert index, destination rank), and El
  all-to-alls, one per local expert index, write each expert's rows straight into place. No
  re-sort pass, El collectives per direction.
- "auto": "per_expert" off CUDA, where a pass over memory costs about as much as the loopback
  all-to-all itself (docs/benchmarks.md); "resort" on CUDA, where it is cheap next to the
  interconnect and one collective beats El.

`send_key` gives the sort key of each slot for a strategy; sort by it (``moe.kernels.permute``)
before `dispatch`. `combine` undoes `dispatch`. Both are differentiable. Host syncs: one, to read
the exchanged counts; none when the counts are known in advance (``known_counts``: BASE's static
splits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .all_to_all import all_to_all

__all__ = [
    "STRATEGIES",
    "DispatchInfo",
    "PeerFailedError",
    "combine",
    "dispatch",
    "exchange_counts",
    "expert_major_order",
    "raise_if_peers_failed",
    "resolve_strategy",
    "row_ranges",
    "send_key",
    "send_rows",
]

STRATEGIES = ("auto", "resort", "per_expert")


class PeerFailedError(ValueError):
    """Another rank of the group failed before an exchange (it sent negative counts)."""


def raise_if_peers_failed(sent: list[int], group, what: str) -> None:
    """Raise PeerFailedError naming the ranks of ``group`` whose number in ``sent`` (one per
    rank) is negative: a rank that could not go on sends -1 (`FlatDispatcher.fail`)."""
    failed = [dist.get_global_rank(group, j) for j, n in enumerate(sent) if n < 0]
    if failed:
        raise PeerFailedError(f"expert-parallel ranks {failed} failed before the {what} (see their errors)")


@dataclass(frozen=True)
class DispatchInfo:
    strategy: str  # "resort" or "per_expert"
    send: list[list[int]]  # (W, El): rows sent to rank j for its local expert e
    recv: list[list[int]]  # (W, El): rows received from rank j for local expert e
    inverse: Tensor | None  # resort: local row of each received row; None when it is the identity
    group: object  # the process group


def resolve_strategy(strategy: str, device: torch.device) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if strategy == "auto":
        return "resort" if device.type == "cuda" else "per_expert"
    return strategy


def send_key(expert_idx: Tensor, num_experts: int, world: int, strategy: str) -> Tensor:
    """The key to sort slots by before `dispatch` ("auto" resolved for ``expert_idx``'s device):
    the global expert for "resort", ``local index * W + owner rank`` for "per_expert".
    Dropped slots (-1) stay -1."""
    if resolve_strategy(strategy, expert_idx.device) == "resort":
        return expert_idx
    per_rank = num_experts // world
    key = (expert_idx % per_rank) * world + torch.div(expert_idx, per_rank, rounding_mode="floor")
    return torch.where(expert_idx >= 0, key, expert_idx)


def _move_blocks(x: Tensor, send_by_e: list[list[int]], recv_by_e: list[list[int]], group) -> Tensor:
    """One all-to-all per local expert index e: block e of ``x`` (rows for local expert e of
    each rank, by rank) goes out, block e of the result (rows from each rank) comes in."""
    out = x.new_empty(sum(map(sum, recv_by_e)), *x.shape[1:])
    src = dst = 0
    for ins, outs in zip(send_by_e, recv_by_e, strict=True):
        n_in, n_out = sum(ins), sum(outs)
        dist.all_to_all_single(out[dst : dst + n_out], x[src : src + n_in], outs, ins, group=group)
        src, dst = src + n_in, dst + n_out
    return out


class _ExpertBlocks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_by_e, recv_by_e, group):
        ctx.splits, ctx.group = (send_by_e, recv_by_e), group
        return _move_blocks(x.contiguous(), send_by_e, recv_by_e, group)

    @staticmethod
    def backward(ctx, grad):
        send_by_e, recv_by_e = ctx.splits
        return _move_blocks(grad.contiguous(), recv_by_e, send_by_e, ctx.group), None, None, None


def _transpose(m: list[list[int]]) -> list[list[int]]:
    return [list(col) for col in zip(*m, strict=True)]


def row_ranges(segments: list[tuple[int, int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """The rows ``start, ..., start + n - 1`` of each ``(start, n)`` in turn, and the inverse of
    that permutation (when the segments cover the rows): made on the host from the sizes, so
    nothing is read back from the device."""
    order = torch.cat([torch.arange(s, s + n) for s, n in segments] or [torch.zeros(0, dtype=torch.int64)])
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    return order.to(device, non_blocking=True), inverse.to(device, non_blocking=True)


def expert_major_order(recv: list[list[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """Received rows are laid out by source rank j, then local expert e (``recv[j][e]`` rows
    each); the order that lays them out by expert, then source (for the grouped GEMM), and its
    inverse."""
    starts, pos = [], 0
    for row in recv:
        starts.append([pos + sum(row[:e]) for e in range(len(row))])
        pos += sum(row)
    return row_ranges([(starts[j][e], recv[j][e]) for e in range(len(recv[0])) for j in range(len(recv))], device)


def exchange_counts(
    counts_E: Tensor, num_rows: int, group, *, known_counts: list[int] | None = None, strategy: str = "resort"
) -> tuple[list[list[int]], list[list[int]]]:
    """The splits of `dispatch`'s row exchange, on the host: (send, recv), each (W, El) lists,
    rows sent to (received from) rank j for local expert e. One all-to-all of the counts and
    one host sync, none with ``known_counts`` (see `dispatch`); a rank that failed (negative
    counts) raises PeerFailedError on every rank. ``strategy`` ("resort" or "per_expert") is
    the order ``counts_E`` (rows per sort key) is in."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    num_experts = counts_E.numel()
    if num_experts % world:
        raise ValueError(f"the {num_experts} experts must split evenly over the {world} ranks of the group")
    per_rank = num_experts // world
    if known_counts is not None:
        if len(known_counts) != num_experts or sum(known_counts) != num_rows:
            raise ValueError(
                f"known_counts must hold {num_experts} counts summing to the {num_rows} rows, got {known_counts}"
            )
        send = [list(known_counts[j * per_rank : (j + 1) * per_rank]) for j in range(world)]
        return send, [send[rank]] * world
    c = counts_E.to(torch.int64)
    send_WE = c.view(world, per_rank) if strategy == "resort" else c.view(per_rank, world).T.contiguous()
    recv_WE = torch.empty_like(send_WE)  # counts need no autograd: the in-place collective is cheaper
    dist.all_to_all_single(recv_WE, send_WE, group=group)
    send, recv = send_WE.tolist(), recv_WE.tolist()  # host sync: the sizes
    raise_if_peers_failed([min(row) for row in recv], group, "dispatch")
    return send, recv


def dispatch(
    x_MD: Tensor,
    counts_E: Tensor,
    group=None,
    *,
    known_counts: list[int] | None = None,
    strategy: str = "auto",
) -> tuple[Tensor, Tensor, DispatchInfo]:
    """Rows sorted by `send_key` on this rank -> rows of this rank's experts, sorted by local
    expert: returns x_local (M', D), local counts (El,) on the host (`moe.kernels.grouped_mm`
    then reads them without a sync), and the info `combine` needs.

    ``counts_E``: rows per key (E,), as `moe.kernels.permute` returns them for the sorted keys.
    ``known_counts``: the (E,) rows per global expert when every rank of the group is known to
    send exactly these (BASE's balanced loads with the same number of tokens on every rank).
    The splits then follow on the host: no count exchange and no device-to-host sync. It is
    the caller's contract that they hold on every rank; ``counts_E`` is not read.
    """
    group = group or dist.group.WORLD
    strategy = resolve_strategy(strategy, x_MD.device)
    send, recv = exchange_counts(counts_E, x_MD.shape[0], group, known_counts=known_counts, strategy=strategy)
    return send_rows(x_MD, send, recv, group, strategy=strategy)


def send_rows(
    x_MD: Tensor, send: list[list[int]], recv: list[list[int]], group, *, strategy: str = "auto"
) -> tuple[Tensor, Tensor, DispatchInfo]:
    """`dispatch` with its splits already on the host: ``send`` / ``recv`` (W, El), rows sent
    to (received from) rank j for local expert e, as `exchange_counts` gives them. No host
    sync; the caller vouches that every rank's ``recv`` is what the others ``send`` it."""
    world = dist.get_world_size(group)
    strategy = resolve_strategy(strategy, x_MD.device)
    per_rank = len(send[0])
    counts_local = torch.tensor([sum(col) for col in zip(*recv, strict=True)], dtype=torch.int64)  # on the host
    if strategy == "per_expert":
        x_local = _ExpertBlocks.apply(x_MD, _transpose(send), _transpose(recv), group)
        return x_local, counts_local, DispatchInfo(strategy, send, recv, None, group)
    x_recv = all_to_all(x_MD, [sum(row) for row in recv], [sum(row) for row in send], group)
    if per_rank == 1 or world == 1:  # (source, expert) order is already (expert, source) order
        return x_recv, counts_local, DispatchInfo(strategy, send, recv, None, group)
    # received layout: by source rank, then expert; local layout: by expert, then source rank
    order, inverse = expert_major_order(recv, x_MD.device)
    return x_recv.index_select(0, order), counts_local, DispatchInfo(strategy, send, recv, inverse, group)


def combine(y_local: Tensor, info: DispatchInfo) -> Tensor:
    """The inverse of `dispatch` for the experts' outputs: (M', D) local rows -> (M, D) in this
    rank's send order."""
    if info.strategy == "per_expert":
        return _ExpertBlocks.apply(y_local, _transpose(info.recv), _transpose(info.send), info.group)
    y_recv = y_local if info.inverse is None else y_local.index_select(0, info.inverse)
    return all_to_all(y_recv, [sum(row) for row in info.send], [sum(row) for row in info.recv], info.group)
