"""The two-level expert-parallel dispatcher: a token crosses between nodes once per destination
node, and each node sends back one sum per token.

Legend: W ranks in the expert-parallel ("ep") group, laid out as N nodes x P ranks per node
(ep rank r is local rank r % P of node r // P); E experts, El = E / W per rank (rank r owns
[r*El, (r+1)*El), as in the flat layout), En = E / N per node; T tokens routed on this rank,
K slots per token, R (token, node) pairs this rank receives.

A forward:
1. one count exchange over the whole ep group (so a failure notice reaches every rank, in the
   shape of the flat one: `Agreement.relay` meets it with -1 counts): each rank tells every
   rank of node n how many of its tokens choose at least one expert of node n.
2. stage 1, over the "node" group (local rank l of every node): each (token, destination node)
   pair goes once to local rank l of that node, the token vector with the gates of that node's
   slots beside it (one differentiable all-to-all), and the node-local expert ids of those
   slots (a small int64 one).
3. stage 2, inside the node (the "local" group): the received pairs are routed like tokens of a
   flat dispatcher over the node's P ranks (`dispatch` / `combine`, one row per (pair, slot)),
   the experts run, and `unpermute` sums each pair's gate-weighted outputs: the node's partial.
4. stage 1 reversed: one vector per (token, node) goes home, where the partials are added.

A token's own node is reached through stage 1 too (local rank l sends to itself or to a rank
of its own node), but that is no traffic between nodes: `last_internode_rows` counts the pairs
sent to other nodes only.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ..kernels import permute, unpermute
from ..layer import MoE
from .all_to_all import all_to_all
from .dispatch import combine, dispatch, raise_if_peers_failed, send_key
from .flat import FlatDispatcher

__all__ = ["HierarchicalDispatcher", "node_groups", "resolve_ranks_per_node"]


def resolve_ranks_per_node(ranks_per_node: int | None, ep_size: int) -> int:
    """``ranks_per_node`` checked against the ep size; None: the environment's
    ``LOCAL_WORLD_SIZE`` (capped at the ep size: a group inside one node), else the whole group."""
    if ranks_per_node is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            return ep_size
        try:
            ranks_per_node = min(int(env), ep_size)
        except ValueError:
            raise ValueError(f"LOCAL_WORLD_SIZE must be an int (ranks_per_node's default), got {env!r}") from None
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


class HierarchicalDispatcher(FlatDispatcher):
    """The two-level dispatcher (module docstring), set by ``parallelize_moe(...,
    dispatch="hierarchical")``. Everything but the row exchange is the flat dispatcher's
    (input checks, failure agreement, global BASE); no etp and no static splits.

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
        strategy: str = "auto",
    ) -> None:
        super().__init__(mesh, num_experts, ep=ep, strategy=strategy)
        self.ranks_per_node = ranks_per_node
        self.num_nodes = self.ep_size // ranks_per_node
        self.node_group, self.local_group = groups
        rank = dist.get_rank(self.ep_group)
        self.node, self.local_rank = divmod(rank, ranks_per_node)
        self.last_internode_rows: int | None = None

    def __call__(self, layer: MoE, x_TD: Tensor, routing, gates_TK: Tensor) -> Tensor:
        pair_token, send, recv, rows_SX, local_SK = self.pairs(x_TD, routing, gates_TK)
        num_tokens, dim = x_TD.shape
        k = routing.expert_idx.shape[1]
        per_node = self.num_experts // self.num_nodes
        rows_RX = all_to_all(rows_SX, recv, send, self.node_group)
        local_RK = all_to_all(local_SK.reshape(-1), [n * k for n in recv], [n * k for n in send], self.node_group)
        x_RD, g_RK = rows_RX[:, :dim], rows_RX[:, dim:]

        # stage 2: the received pairs over the node's ranks, as a flat dispatcher routes tokens
        cfg = layer.config
        keys = send_key(local_RK.view(-1, k), per_node, self.ranks_per_node, self.strategy)
        xs_MD, info = permute(x_RD, keys, num_experts=per_node, backend=cfg.backend)
        x_local, counts_local, sent_info = dispatch(xs_MD, info.counts, self.local_group, strategy=self.strategy)
        ys_MD = combine(layer.experts(x_local, counts_local), sent_info)
        partial_RD = unpermute(ys_MD, info, g_RK, backend=cfg.backend)  # one sum per (token, node)

        # stage 1 back: each node's partial goes home, where they are added
        partial_SD = all_to_all(partial_RD, send, recv, self.node_group)
        return x_TD.new_zeros(num_tokens, dim).index_add(0, pair_token, partial_SD)

    def pairs(self, x_TD: Tensor, routing, gates_TK: Tensor):
        """The (token, node) pairs this rank sends, sorted by node then token, after the count
        exchange: (pair_token (S,), send (N,) pairs to each node, recv (N,) pairs from each
        node, rows_SX (S, D + K) each pair's token and its gates for that node's slots,
        local_SK (S, K) the node-local expert of each slot there, -1 elsewhere)."""
        self.agreement.start([])  # the count exchange below is the forward's last status collective
        num_tokens = x_TD.shape[0]
        per_node, per_rank = self.num_experts // self.num_nodes, self.num_experts // self.ep_size
        idx_TK = routing.expert_idx
        node_TK = torch.where(idx_TK >= 0, torch.div(idx_TK, per_node, rounding_mode="floor"), -1)
        # pairs (token, node) with at least one slot on the node, sorted by node then token
        hit_NT = torch.zeros(self.num_nodes + 1, num_tokens, dtype=torch.bool, device=x_TD.device)
        tokens_TK = torch.arange(num_tokens, device=x_TD.device).unsqueeze(1).expand_as(node_TK)
        hit_NT[node_TK.where(node_TK >= 0, self.num_nodes), tokens_TK] = True  # dropped slots: the extra row
        hit_NT = hit_NT[: self.num_nodes]
        pair_node, pair_token = hit_NT.nonzero(as_tuple=True)  # (S,) each; a host sync
        pairs_N = hit_NT.sum(dim=1)

        # the count exchange, over the whole ep group in the flat one's shape (El values per rank)
        sent_WL = torch.zeros(self.ep_size, per_rank, dtype=torch.int64, device=x_TD.device)
        sent_WL[:, 0] = pairs_N.repeat_interleave(self.ranks_per_node)
        got_WL = all_to_all(sent_WL.view(-1), [per_rank] * self.ep_size, [per_rank] * self.ep_size, self.ep_group)
        got_WL = got_WL.view(self.ep_size, per_rank)
        send = pairs_N.tolist()
        got = got_WL.tolist()  # host sync: the sizes
        raise_if_peers_failed([min(row) for row in got], self.ep_group, "dispatch")
        recv = [got[n * self.ranks_per_node + self.local_rank][0] for n in range(self.num_nodes)]
        self.last_internode_rows = sum(send) - send[self.node]

        # stage 1: each pair's vector once, its gates for that node's slots beside it
        on_node_SK = node_TK[pair_token] == pair_node.unsqueeze(1)
        local_SK = torch.where(on_node_SK, idx_TK[pair_token] - pair_node.unsqueeze(1) * per_node, -1)
        gates_SK = gates_TK[pair_token].masked_fill(~on_node_SK, 0)
        rows_SX = torch.cat([x_TD[pair_token], gates_SK], dim=1)
        return pair_token, send, recv, rows_SX, local_SK
