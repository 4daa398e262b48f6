"""The chunked expert-parallel dispatcher: the flat exchange cut into C chunks, so the rows of
one chunk travel while another chunk's experts compute.

Legend: W ranks in the ep group, E experts, El = E / W per rank, C chunks, M rows this rank
sends (sorted by global expert, so by destination rank j, then local expert e), n_je the rows
for (j, e), M_c the rows of chunk c.

The chunks: chunk c takes rows ``[n*c // C, n*(c+1) // C)`` of every (destination, expert)
block of n rows, on the sending and on the receiving side alike. So the chunks' splits follow
from the one count exchange (or the static path's known counts) on the host: no more host syncs
than the flat dispatcher's, and every rank cuts its chunks the same way whatever its own
number of rows (a block of fewer than C rows leaves some chunks empty; every rank still takes
part in every chunk's exchange).

A forward (``s`` issues an exchange, ``w`` waits for it, X the grouped experts):

    s(d0) | w(d0) s(d1) X0 s(b0) | w(d1) s(d2) X1 s(b1) | ... | w(b0) ... w(b_{C-1})

d_c is chunk c's rows going out, b_c its outputs coming back: d_{c+1} is in flight while chunk
c's experts compute, and b_c while chunk c+1's do. The backward runs the same pairs in reverse
(`moe.parallel.async_all_to_all`): the gradients of b_c go out before chunk c's experts'
backward needs them, and d_c's gradient travels back during chunk c-1's. The expert weights'
gradients are sums over the chunks (equal to C=1 up to rounding).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ..layer import MoE
from .async_all_to_all import InFlightPair, start, wait
from .dispatch import exchange_counts, expert_major_order, row_ranges
from .flat import FlatDispatcher

__all__ = ["ChunkedDispatcher", "chunk_major", "cut"]


def cut(n: int, chunks: int) -> list[int]:
    """Rows of each chunk in a block of ``n``: ``n*(c+1) // C - n*c // C``."""
    return [n * (c + 1) // chunks - n * c // chunks for c in range(chunks)]


def chunk_major(sizes: list[int], chunks: int) -> list[tuple[int, int]]:
    """The (start, rows) segments that lay rows out chunk by chunk: of blocks of ``sizes[n]``
    rows in turn, chunk c takes rows ``[n*c // C, n*(c+1) // C)`` of each (`row_ranges`)."""
    starts = [sum(sizes[:n]) for n in range(len(sizes))]
    return [
        (starts[n] + sizes[n] * c // chunks, cut(sizes[n], chunks)[c]) for c in range(chunks) for n in range(len(sizes))
    ]


class ChunkedDispatcher(FlatDispatcher):
    """The flat dispatcher with its row exchange in ``chunks`` overlapped chunks (module
    docstring), set by ``parallelize_moe(..., chunks=C)`` for C > 1. Rows are sent sorted by
    global expert (the "resort" order); routing, checks, failure agreement, etp and the static
    path are the flat dispatcher's."""

    def __init__(self, mesh: DeviceMesh, num_experts: int, *, chunks: int, **options) -> None:
        super().__init__(mesh, num_experts, strategy="resort", **options)
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
            raise ValueError(f"chunks must be a positive int, got {chunks!r}")
        self.chunks = chunks

    def run_experts(self, layer: MoE, xs_MD: Tensor, counts_E: Tensor, routing) -> Tensor:
        """Expert-sorted rows -> the experts' outputs in the same order, chunk by chunk."""
        known = self.known_counts(layer, counts_E, routing)
        send, recv = exchange_counts(counts_E, xs_MD.shape[0], self.ep_group, known_counts=known)
        C, device = self.chunks, xs_MD.device
        send_c = [[[cut(n, C)[c] for n in row] for row in send] for c in range(C)]  # (C, W, El)
        recv_c = [[[cut(n, C)[c] for n in row] for row in recv] for c in range(C)]
        # the send rows laid out chunk by chunk, each chunk by (destination, expert)
        by_chunk, back = row_ranges(chunk_major([n for row in send for n in row], C), device)
        xs_MD = xs_MD.index_select(0, by_chunk)
        reorder = len(send[0]) > 1 and len(send) > 1  # received (source, expert) -> (expert, source)

        offsets = [0]
        for c in range(C):
            offsets.append(offsets[-1] + sum(map(sum, send_c[c])))
        out_links, back_links = [], []
        for c in range(C):
            sent, got = [sum(r) for r in send_c[c]], [sum(r) for r in recv_c[c]]
            out_links.append(InFlightPair(got, sent, self.ep_group))
            back_links.append(InFlightPair(sent, got, self.ep_group))
        going = start(xs_MD[offsets[0] : offsets[1]], out_links[0])
        coming: list[Tensor] = []
        for c in range(C):
            x_recv = wait(going, out_links[c])
            if c + 1 < C:  # in flight while this chunk's experts compute
                going = start(xs_MD[offsets[c + 1] : offsets[c + 2]], out_links[c + 1])
            counts_local = torch.tensor([sum(col) for col in zip(*recv_c[c], strict=True)], dtype=torch.int64)
            if reorder:
                order, inverse = expert_major_order(recv_c[c], device)
                y_local = layer.experts(x_recv.index_select(0, order), counts_local).index_select(0, inverse)
            else:
                y_local = layer.experts(x_recv, counts_local)
            coming.append(start(y_local, back_links[c]))  # in flight while the next chunk's experts compute
        ys = torch.cat([wait(y, link) for y, link in zip(coming, back_links, strict=True)])
        return ys.index_select(0, back)
