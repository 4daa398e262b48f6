"""The two-level dispatcher with its exchange between nodes in C overlapped chunks.

Legend: N nodes x P ranks per node, En = E / N experts per node, Ep = En / P per rank, C chunks,
K slots per token; S (token, node) pairs this rank sends, R it receives, R_c those of chunk c.

As `HierarchicalDispatcher` (same pairs, same count exchange over the ep group), then:
- chunk c takes pairs ``[n*c // C, n*(c+1) // C)`` of the n this rank sends to each node (and,
  alike, of those it receives from each node), so every chunk's splits follow on the host;
- the count exchange carries every chunk's slots per expert (`HierarchicalDispatcher.pairs`),
  so each chunk's splits inside the node are on the host after its one read, as unchunked;
- the node-local expert ids of every pair travel first, all chunks in one small exchange;
- chunk c+1's pairs cross between nodes while chunk c goes through the node (its exchange
  inside the node, the experts, the way back) and chunk c's partial sums cross back while
  chunk c+1's are computed. The exchanges between nodes are `moe.parallel.async_all_to_all`
  pairs, so the backward overlaps the same way; inside the node (the fast links) they are
  plain differentiable all-to-alls.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import permute, unpermute
from ..layer import MoE
from .all_to_all import all_to_all
from .async_all_to_all import InFlightPair, start, wait
from .chunked import chunk_major, cut
from .dispatch import expert_major_order, row_ranges
from .hierarchical import HierarchicalDispatcher

__all__ = ["ChunkedHierarchicalDispatcher"]


class ChunkedHierarchicalDispatcher(HierarchicalDispatcher):
    """``parallelize_moe(..., dispatch="hierarchical", chunks=C)`` for C > 1 (module docstring)."""

    def __init__(self, mesh, num_experts: int, *, chunks: int, **options) -> None:
        super().__init__(mesh, num_experts, strategy="resort", chunks=chunks, **options)

    def __call__(self, layer: MoE, x_TD: Tensor, routing, gates_TK: Tensor) -> Tensor:
        plan = self.pairs(x_TD, routing, gates_TK)
        send, recv, C, device = plan.send, plan.recv, self.chunks, x_TD.device
        num_tokens, dim = x_TD.shape
        k = plan.local_SK.shape[1]
        per_node, P = self.num_experts // self.num_nodes, self.ranks_per_node
        # every pair's ids at once, then laid out chunk by chunk on both sides
        local_RK = all_to_all(plan.local_SK.reshape(-1), [n * k for n in recv], [n * k for n in send], self.node_group)
        by_chunk_S, back_S = row_ranges(chunk_major(send, C), device)
        by_chunk_R, _ = row_ranges(chunk_major(recv, C), device)
        rows_SX = plan.rows_SX.index_select(0, by_chunk_S)
        local_RK = local_RK.view(-1, k).index_select(0, by_chunk_R)
        sent_rows = [sum(cut(n, C)[c] for n in send) for c in range(C)]
        got_rows = [sum(cut(n, C)[c] for n in recv) for c in range(C)]
        send_CPL, recv_CPL = plan.node_send, plan.node_recv  # each chunk's rows per expert inside the node

        cfg = layer.config
        offsets_S = [sum(sent_rows[:c]) for c in range(C + 1)]
        offsets_R = [sum(got_rows[:c]) for c in range(C + 1)]
        out_links = [
            InFlightPair([cut(n, C)[c] for n in recv], [cut(n, C)[c] for n in send], self.node_group) for c in range(C)
        ]
        back_links = [InFlightPair(link.ins, link.outs, self.node_group) for link in out_links]
        going = start(rows_SX[offsets_S[0] : offsets_S[1]], out_links[0])
        coming = []
        for c in range(C):
            rows_RX = wait(going, out_links[c])
            if c + 1 < C:  # in flight while this chunk goes through the node
                going = start(rows_SX[offsets_S[c + 1] : offsets_S[c + 2]], out_links[c + 1])
            x_RD, g_RK = rows_RX[:, :dim], rows_RX[:, dim:].contiguous()  # a view would keep rows_RX for backward
            send_c, recv_c = send_CPL[c], recv_CPL[c]
            kept = sum(map(sum, send_c))
            ids_RK = local_RK[offsets_R[c] : offsets_R[c + 1]]
            xs_MD, info = permute(x_RD, ids_RK, num_experts=per_node, backend=cfg.backend, num_rows=kept)
            sent, got = [sum(r) for r in send_c], [sum(r) for r in recv_c]
            x_recv = all_to_all(xs_MD, got, sent, self.local_group)
            counts_local = torch.tensor([sum(col) for col in zip(*recv_c, strict=True)], dtype=torch.int64)
            if per_node > P > 1:  # received (source, expert) -> (expert, source) and back
                order, inverse = expert_major_order(recv_c, device)
                y_recv = layer.experts(x_recv.index_select(0, order), counts_local).index_select(0, inverse)
            else:
                y_recv = layer.experts(x_recv, counts_local)
            ys_MD = all_to_all(y_recv, sent, got, self.local_group)
            partial_RD = unpermute(ys_MD, info, g_RK, backend=cfg.backend)  # one sum per (token, node)
            coming.append(start(partial_RD, back_links[c]))  # in flight while the next chunk is computed
        partial_SD = torch.cat([wait(p, link) for p, link in zip(coming, back_links, strict=True)])
        partial_SD = partial_SD.index_select(0, back_S)
        # index_put keeps only the indices for backward (index_add would keep partial_SD)
        return x_TD.new_zeros(num_tokens, dim).index_put((plan.pair_token,), partial_SD, accumulate=True)
