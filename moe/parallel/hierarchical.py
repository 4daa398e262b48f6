"""The two-level expert-parallel dispatcher: a token crosses between nodes once per destination
node, and each node sends back one sum per token.

Legend: W ranks in the expert-parallel ("ep") group, laid out as N nodes x P ranks per node
(ep rank r is local rank r % P of node r // P); E experts, El = E / W per rank (rank r owns
[r*El, (r+1)*El), as in the flat layout), En = E / N per node; T tokens routed on this rank,
K slots per token, R (token, node) pairs this rank receives.

A forward:
1. one count exchange over the whole ep group, and one host read: each rank tells every rank
   of node n how many of its tokens choose at least one expert of node n, and how many of
   its slots go to each expert of node n (per chunk, when the exchange between nodes runs in
   chunks). That gives every split of the forward, inside the node too; a failure notice
   (`Agreement.relay`, -1 counts) reaches every rank in it.
2. stage 1, over the "node" group (local rank l of every node): each (token, destination node)
   pair goes once to local rank l of that node, the token vector with the gates of that node's
   slots beside it (one differentiable all-to-all), and the node-local expert ids of those
   slots (a small int64 one).
3. stage 2, inside the node (the "local" group): the received pairs are routed like tokens of a
   flat dispatcher over the node's P ranks (`send_rows` / `combine`, one row per (pair, slot)),
   the experts run, and `unpermute` sums each pair's gate-weighted outputs: the node's partial.
4. stage 1 reversed: one vector per (token, node) goes home, where the partials are added.

A token's own node is reached through stage 1 too (local rank l sends to itself or to a rank
of its own node), but that is no traffic between nodes: `last_internode_rows` counts the pairs
sent to other nodes only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ..kernels import permute, unpermute
from ..layer import MoE
from .all_to_all import all_to_all
from .dispatch import combine, raise_if_peers_failed, send_key, send_rows
from .flat import FlatDispatcher

__all__ = ["HierarchicalDispatcher", "node_groups", "node_slot_counts", "resolve_ranks_per_node"]


def resolve_ranks_per_node(ranks_per_node: int | None, ep_ranks: list[int]) -> int:
    """``ranks_per_node`` checked against the ep group (its members' global ranks, in ep rank
    order). None: found from the environment's ``LOCAL_WORLD_SIZE`` L, where global rank g is
    on node g // L (torchrun's numbering): the ep ranks that share ep rank 0's node, so a
    layout with tp or other dimensions inside the node counts only the ep ranks there. The ep
    group must then be whole nodes of consecutive ep ranks. Without ``LOCAL_WORLD_SIZE``, the
    whole group is one node."""
    ep_size = len(ep_ranks)
    if ranks_per_node is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            return ep_size
        try:
            local = int(env)
        except ValueError:
            raise ValueError(f"LOCAL_WORLD_SIZE must be an int (ranks_per_node's default), got {env!r}") from None
        if local < 1:
            raise ValueError(f"LOCAL_WORLD_SIZE must be positive (ranks_per_node's default), got {local}")
        nodes = [g // local for g in ep_ranks]
        ranks_per_node = nodes.count(nodes[0])
        blocks = [nodes[i : i + ranks_per_node] for i in range(0, ep_size, ranks_per_node)]
        if any(len(set(b)) != 1 or len(b) != ranks_per_node for b in blocks) or len({b[0] for b in blocks}) != len(
            blocks
        ):
            raise ValueError(
                f"the ep group's ranks {ep_ranks} are not whole nodes of consecutive ep ranks (LOCAL_WORLD_SIZE="
                f"{local} puts them on nodes {nodes}): pass ranks_per_node, or use dispatch='flat'"
            )
    if not isinstance(ranks_per_node, int) or isinstance(ranks_per_node, bool) or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
    if ep_size % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} must divide the ep size, {ep_size}")
    return ranks_per_node


def node_groups(mesh: DeviceMesh, ep: str, ranks_per_node: int) -> tuple[object, object]:
    """The (node, local) process groups of this rank's ep group: ep rank r is local rank
    r % P of node r // P. The ep dimension is unflattened into (nodes, P) on the DeviceMesh
    (a slice of a larger mesh included), so every rank creates every group in the same order:
    call it on every rank of the mesh's root, once for all layers."""
    nodes = mesh.size(mesh.mesh_dim_names.index(ep)) // ranks_per_node
    split = mesh._unflatten(ep, (nodes, ranks_per_node), (f"{ep}_node", f"{ep}_local"))
    return split.get_group(f"{ep}_node"), split.get_group(f"{ep}_local")


def node_slot_counts(idx_TK: Tensor, num_nodes: int, per_node: int, chunks: int) -> tuple[Tensor, Tensor, Tensor]:
    """What a rank tells each node in the count exchange, from its slots' experts ``idx_TK``
    (T, K; -1 dropped), experts in ``num_nodes`` blocks of ``per_node``: which (node, token)
    pairs exist (N, T) bool (a token with at least one slot on the node), each slot's node (T, K)
    (N for a dropped slot), and per destination node its pairs, then its slots by (chunk,
    node-local expert) (N, 1 + C En): the j-th of the n pairs to a node is in chunk
    (C (j + 1) - 1) // n, as `moe.parallel.chunked.cut` splits them."""
    num_tokens, device, N = idx_TK.shape[0], idx_TK.device, num_nodes
    node_TK = torch.where(idx_TK >= 0, torch.div(idx_TK, per_node, rounding_mode="floor"), N)  # dropped: N
    # pairs (token, node) with at least one slot on the node; dropped slots mark the extra row
    hit_NT = torch.zeros(N + 1, num_tokens, dtype=torch.bool, device=device)
    tokens_TK = torch.arange(num_tokens, device=device).unsqueeze(1).expand_as(node_TK)
    hit_NT[node_TK, tokens_TK] = True
    hit_NT = hit_NT[:N]
    pairs_N = hit_NT.sum(dim=1)
    j_NT = hit_NT.cumsum(dim=1) - 1
    kept = node_TK < N
    node_k = node_TK.where(kept, 0)
    j_TK, n_TK = j_NT[node_k, tokens_TK], pairs_N[node_k]
    chunk_TK = torch.div(chunks * (j_TK + 1) - 1, n_TK.clamp(min=1), rounding_mode="floor")
    width = 1 + chunks * per_node  # per destination node: its pairs, then slots by (chunk, expert)
    slot_TK = node_k * width + 1 + chunk_TK * per_node + idx_TK - node_k * per_node
    sent_NX = torch.zeros(N * width + 1, dtype=torch.int64, device=device)
    sent_NX.index_add_(0, slot_TK.where(kept, N * width).reshape(-1), torch.ones_like(slot_TK).reshape(-1))
    sent_NX = sent_NX[: N * width].view(N, width)
    sent_NX[:, 0] = pairs_N
    return hit_NT, node_TK, sent_NX


@dataclass(frozen=True)
class Pairs:
    """What a forward sends (`HierarchicalDispatcher.pairs`): the token of each pair (S,);
    pairs sent to (received from) each node, (N,) on the host; each pair's row, its token's
    vector and its gates for that node's slots (S, D + K); the node-local expert of each
    slot there, -1 elsewhere (S, K); and per chunk, the rows sent to (received from) each
    rank of the node for each of its experts inside the node, (P, Ep) on the host."""

    pair_token: Tensor
    send: list[int]
    recv: list[int]
    rows_SX: Tensor
    local_SK: Tensor
    node_send: list[list[list[int]]]
    node_recv: list[list[list[int]]]


class HierarchicalDispatcher(FlatDispatcher):
    """The two-level dispatcher (module docstring), set by ``parallelize_moe(...,
    dispatch="hierarchical")``. Everything but the row exchange is the flat dispatcher's
    (input checks, failure agreement, global BASE, etp's token gather and partial sums); no
    static splits (the pairs per node follow the routing, so the count exchange stays).

    ``last_internode_rows``: the (token, node) pairs this rank sent to other nodes in the last
    forward (each one token vector out and one back), or None before any."""

    def __init__(
        self,
        mesh: DeviceMesh,
        num_experts: int,
        *,
        ranks_per_node: int,
        groups: tuple[object, object],
        ep: str = "ep",
        etp: str | None = None,
        strategy: str = "auto",
        chunks: int = 1,
    ) -> None:
        super().__init__(mesh, num_experts, ep=ep, etp=etp, strategy=strategy)
        self.ranks_per_node = ranks_per_node
        self.num_nodes = self.ep_size // ranks_per_node
        self.chunks = chunks
        # the count exchange (`pairs`): per destination node, its pairs and its slots by (chunk, expert)
        self.agreement.count_width = 1 + chunks * num_experts // self.num_nodes
        self.node_group, self.local_group = groups
        rank = dist.get_rank(self.ep_group)
        self.node, self.local_rank = divmod(rank, ranks_per_node)
        self.last_internode_rows: int | None = None

    def __call__(self, layer: MoE, x_TD: Tensor, routing, gates_TK: Tensor) -> Tensor:
        plan = self.pairs(x_TD, routing, gates_TK)
        num_tokens, dim = x_TD.shape
        k = routing.expert_idx.shape[1]
        per_node = self.num_experts // self.num_nodes
        rows_RX = all_to_all(plan.rows_SX, plan.recv, plan.send, self.node_group)
        local_RK = all_to_all(
            plan.local_SK.reshape(-1), [n * k for n in plan.recv], [n * k for n in plan.send], self.node_group
        )
        x_RD, g_RK = rows_RX[:, :dim], rows_RX[:, dim:].contiguous()  # a view would keep rows_RX for backward

        # stage 2: the received pairs over the node's ranks, as a flat dispatcher routes tokens
        cfg = layer.config
        send_c, recv_c = plan.node_send[0], plan.node_recv[0]
        keys = send_key(local_RK.view(-1, k), per_node, self.ranks_per_node, self.strategy)
        rows = sum(map(sum, send_c))
        xs_MD, info = permute(x_RD, keys, num_experts=per_node, backend=cfg.backend, num_rows=rows)
        x_local, counts_local, sent_info = send_rows(xs_MD, send_c, recv_c, self.local_group, strategy=self.strategy)
        ys_MD = combine(layer.experts(x_local, counts_local), sent_info)
        partial_RD = unpermute(ys_MD, info, g_RK, backend=cfg.backend)  # one sum per (token, node)

        # stage 1 back: each node's partial goes home, where they are added
        partial_SD = all_to_all(partial_RD, plan.send, plan.recv, self.node_group)
        # index_put keeps only the indices for backward (index_add would keep partial_SD)
        return x_TD.new_zeros(num_tokens, dim).index_put((plan.pair_token,), partial_SD, accumulate=True)

    def pairs(self, x_TD: Tensor, routing, gates_TK: Tensor) -> Pairs:
        """The (token, node) pairs this rank sends, sorted by node then token, and every split
        of the forward on the host, from one count exchange over the ep group and one host read.

        Each rank sends every rank of node n the pairs it has for node n and, for each of the
        ``chunks`` of them (`moe.parallel.chunked.cut`), its slots per expert of node n.
        So rank l of node n knows what it receives from each node (the pairs of local rank l of
        every node) and, summing over the nodes, the slots per expert it relays inside the node
        and those it is relayed."""
        self.agreement.start([])  # the count exchange below is the forward's last status collective
        num_tokens, k = routing.expert_idx.shape
        N, P, chunks = self.num_nodes, self.ranks_per_node, self.chunks
        per_node = self.num_experts // N
        per_rank = per_node // P
        hit_NT, node_TK, sent_NX = node_slot_counts(routing.expert_idx, N, per_node, chunks)
        width = sent_NX.shape[1]

        # the count exchange, over the whole ep group (`Agreement.relay` meets it with -1s)
        sent_WX = sent_NX.repeat_interleave(P, dim=0)
        got_WX = all_to_all(sent_WX.view(-1), [width] * self.ep_size, [width] * self.ep_size, self.ep_group)
        got_NPX = got_WX.view(N, P, width)
        # per local rank l, chunk and node-local expert: the slots l relays, summed over the nodes
        relayed_PCE = got_NPX[:, :, 1:].sum(dim=0).view(P, chunks, per_node)
        heads = [got_NPX[:, :, 0].reshape(-1), sent_NX[:, 0], relayed_PCE.reshape(-1)]
        table = self.read_splits(torch.cat(heads), routing)  # the one host sync: every split
        W = self.ep_size
        raise_if_peers_failed(table[:W], self.ep_group, "dispatch")  # a failed rank sends -1 everywhere
        send = table[W : W + N]
        recv = [table[n * P + self.local_rank] for n in range(N)]
        self.last_internode_rows = sum(send) - send[self.node]
        relayed = [table[W + N + r * chunks * per_node :][: chunks * per_node] for r in range(P)]

        def block(rank: int, c: int, dest: int) -> list[int]:  # slots relayed by rank, chunk c, to dest
            start = c * per_node + dest * per_rank
            return relayed[rank][start : start + per_rank]

        node_send = [[block(self.local_rank, c, r) for r in range(P)] for c in range(chunks)]
        node_recv = [[block(r, c, self.local_rank) for r in range(P)] for c in range(chunks)]

        # stage 1: each pair's vector once, its gates for that node's slots beside it
        pair_node, pair_token = torch.nonzero_static(hit_NT, size=sum(send)).unbind(1)  # no sync: the size is known
        idx_TK = routing.expert_idx
        on_node_SK = node_TK[pair_token] == pair_node.unsqueeze(1)
        local_SK = torch.where(on_node_SK, idx_TK[pair_token] - pair_node.unsqueeze(1) * per_node, -1)
        gates_SK = gates_TK[pair_token].masked_fill(~on_node_SK, 0)
        rows_SX = torch.cat([x_TD[pair_token], gates_SK], dim=1)
        return Pairs(pair_token, send, recv, rows_SX, local_SK, node_send, node_recv)

    def read_splits(self, table: Tensor, routing) -> list[int]:
        """The forward's one host read (`pairs`): the count exchange's table as a list, its
        layout W pairs received (by source rank), N pairs sent (by node), then per local rank,
        chunk and node-local expert the slots relayed. A method of its own for a caller that
        knows the answer without reading a tensor: the tracked step of `moe.plan.memcheck`,
        under FakeTensorMode, answers it for the loads it imposes."""
        return table.tolist()
