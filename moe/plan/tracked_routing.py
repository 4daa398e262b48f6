"""The MoE loads of the tracked step (`moe.plan.memcheck`): the model routes by BASE's sync-free
solver with the extra slots on the lowest experts (`tracked_config`), so every rank sends loads
known on the host and nothing is read back from a fake tensor; ``routing="worst"`` puts every
token on one rank's experts instead. The two-level dispatch, which reads its splits on the
host, is told them for the same loads (`_routed`, `_two_level_splits`)."""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import torch

from ..models.llama import LlamaConfig

__all__ = ["ROUTINGS", "tracked_config"]

ROUTINGS = ("balanced", "worst")  # the MoE loads of the tracked step (see `_routed`)


def tracked_config(cfg: LlamaConfig) -> LlamaConfig:
    """The model the tracked step runs: ``cfg`` itself, its MoE layers routing by BASE's
    sync-free solver with the extra slots on the lowest experts. Every rank then sends the
    balanced loads, known on the host (``static_splits``), so nothing is read back from a fake
    tensor; the router's weights and every buffer are the same shapes as under the preset's
    router, and the loads are the balanced ones the planner assumes."""
    if cfg.moe is None:
        return cfg
    m = cfg.moe
    base = dataclasses.replace(m, router="base", router_options={"base_solver": "approx", "base_extras": "lowest"},
                               capacity_factor=None)  # fmt: skip
    return dataclasses.replace(cfg, moe=base)


def _sync_free(model) -> None:
    """BASE's routers of ``model`` read nothing back from the device. `parallelize_moe`'s static
    path sets this on the expert-parallel layers; a layer on one rank's experts (ep=1 without
    etp) is not given to it, and its router would check its input and report its stats on the
    host, which FakeTensorMode cannot answer. The layer itself reads nothing: its loads are
    the router's counts, used on the device."""
    from ..layer import MoE
    from ..routing.base import BaseRouter

    for m in model.modules():
        if isinstance(m, MoE) and isinstance(m.router, BaseRouter):
            m.router.sync_free = True


@contextlib.contextmanager
def _routed(model, routing: str, ep_rank: int):
    """The flat dispatchers of ``model`` send their rows in the order a GPU run does
    ("resort"); under ``routing="worst"`` every rank's K copies of every token go to the
    first expert of ep rank ``ep_rank`` (dropless routing's largest receive buffer, the experts'
    largest inputs: ep x T x K rows) instead of the balanced loads. The two-level dispatchers
    are given their splits on the host (`_two_level_splits`) for the same loads."""
    from ..layer import MoE
    from ..parallel.flat import FlatDispatcher
    from ..parallel.hierarchical import HierarchicalDispatcher

    for m in model.modules():
        if isinstance(m, MoE) and isinstance(m.dispatcher, FlatDispatcher):
            m.dispatcher.strategy = "resort"

    def splits(self, table, result):
        return _two_level_splits(self, result.expert_idx.shape, routing, ep_rank)

    def skewed(self, layer, counts_E, result):
        self.agreement.start([])
        rows, experts = result.expert_idx.numel(), layer.config.num_experts
        known = [0] * experts
        known[ep_rank * (experts // self.ep_size)] = rows
        return known

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(HierarchicalDispatcher, "read_splits", splits))
        if routing == "worst":
            stack.enter_context(mock.patch.object(FlatDispatcher, "known_counts", skewed))
        yield


def _tracked_expert_idx(shape: tuple[int, int], experts: int, nodes: int, routing: str, first: int = 0):
    """The (T, K) experts of the tracked step's slots on every rank, as the two-level dispatch is
    told them: under ``"balanced"`` BASE's balanced loads (`expert_capacities_list`, the extra
    slots on the lowest experts), slot i (token-major) on the i-th expert of the order that
    takes one expert of each node in turn (the extra slots last), so when E divides T K (every
    row of `CASES`) a token's K slots reach min(K, N) nodes: the most (token, node) pairs, the
    largest buffers between nodes, any routing has. Under ``"worst"`` every slot on expert
    ``first``."""
    from ..routing import expert_capacities_list

    tokens, k = shape
    if routing == "worst":
        return torch.full((tokens, k), first, dtype=torch.int64)
    interleaved = torch.arange(experts).view(nodes, experts // nodes).T.reshape(-1)  # one expert of each node
    caps = torch.tensor(expert_capacities_list(tokens, experts, k))
    rounds = [interleaved[caps[interleaved] > r] for r in range(int(caps.max()))]
    return torch.cat(rounds).view(tokens, k)


def _two_level_splits(dispatcher, shape: tuple[int, int], routing: str, ep_rank: int) -> list[int]:
    """`HierarchicalDispatcher.read_splits` answered on the host: every rank of the ep group
    routes its T tokens as `_tracked_expert_idx` says, so what each sends this rank's node is what
    this rank sends it, and the count exchange's table follows (`HierarchicalDispatcher.pairs`'s
    layout) from `node_slot_counts` of those experts, the real run's counting."""
    from torch.utils._python_dispatch import _disable_current_modes

    from ..parallel.hierarchical import node_slot_counts

    d, experts = dispatcher, dispatcher.num_experts
    with _disable_current_modes():  # real host tensors, neither fake nor tracked
        idx = _tracked_expert_idx(shape, experts, d.num_nodes, routing, ep_rank * (experts // d.ep_size))
        sent = node_slot_counts(idx, d.num_nodes, experts // d.num_nodes, d.chunks)[2]
        mine = sent[d.node]
        return [int(mine[0])] * d.ep_size + sent[:, 0].tolist() + (d.num_nodes * mine[1:]).tolist() * d.ranks_per_node
