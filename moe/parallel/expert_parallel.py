"""`parallelize_moe`: spread the experts of built `MoE` layers over a DeviceMesh, from outside.

Legend: W ranks in the expert-parallel ("ep") group, E experts, El = E / W per rank, F expert
hidden dim, Wt ranks in the expert-tensor-parallel ("etp") group, T tokens on this rank.

Layouts (docs/parallel.md):
- ep: rank r of the ep group owns experts [r*El, (r+1)*El); the expert weights become DTensors
  with ``Shard(0)`` on the ep dimension. Tokens stay data-parallel: each rank routes its own
  and the dispatcher sends their rows to the owning ranks and back (`dispatch` / `combine`).
- etp: each expert's F is sharded too (w1, w3 ``Shard(2)``, w2 ``Shard(1)``). The input is in
  sequence-parallel layout: each etp rank holds a contiguous block of the group's tokens. They
  are gathered over etp, routed together (the same routing on every etp rank), the experts
  give partial sums over F, and a reduce-scatter over etp sums them and hands each rank its
  block back.
- Any other mesh dimension is data parallel: experts are replicated over it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ..layer import MoE
from ..routing import BaseRouter, TopKRouter
from .agreement import all_reduce_mesh, check_same_config
from .chunked import ChunkedDispatcher
from .dispatch import STRATEGIES
from .flat import FlatDispatcher
from .global_base import GroupBalance
from .hierarchical import HierarchicalDispatcher, node_groups, resolve_ranks_per_node
from .hierarchical_chunked import ChunkedHierarchicalDispatcher

DISPATCHES = ("flat", "hierarchical", "auto")

# ExpertParallel: the flat dispatcher's name from before the layer had a dispatcher of its own
ExpertParallel = FlatDispatcher

__all__ = ["ExpertParallel", "GroupBalance", "parallelize_moe", "reduce_gradients"]


def _mesh_dim(mesh: DeviceMesh, name: str | None, arg: str) -> int | None:
    names = mesh.mesh_dim_names or ()
    if name is None:
        return None
    if name not in names:
        raise ValueError(f"{arg} must name a dimension of the mesh, whose dimensions are {names}; got {name!r}")
    return names.index(name)


def _nodes(mesh: DeviceMesh, ep: str, ranks_per_node: int | None, dispatch: str) -> int | str:
    """The ep ranks per node this rank finds (`resolve_ranks_per_node`), or why it cannot: the
    default comes from each rank's environment and its own ep group, so the ranks agree on
    it before anything uses it. The flat dispatch has no use for the default."""
    try:
        ranks = dist.get_process_group_ranks(mesh.get_group(ep))
        if dispatch == "flat" and ranks_per_node is None:
            return len(ranks)
        return resolve_ranks_per_node(ranks_per_node, ranks)
    except (ValueError, KeyError, RuntimeError) as err:  # a bad mesh or ep name: raised in its own check
        return str(err)


@torch.no_grad()
def _broadcast(t: Tensor, mesh: DeviceMesh) -> None:
    """Give every rank the value at mesh coordinate (0, ..., 0)."""
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        dist.broadcast(t, dist.get_global_rank(group, 0), group=group)


def parallelize_moe(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    ep: str = "ep",
    etp: str | None = None,
    static_splits: bool = False,
    global_base: bool | str = False,
    dispatch_strategy: str = "auto",
    dispatch: str = "flat",
    ranks_per_node: int | None = None,
    chunks: int = 1,
) -> nn.Module:
    """Spread the experts of every `MoE` layer in ``module`` over ``mesh``; returns ``module``.

    Args:
        mesh: names its dimensions; the ``ep`` one shards the experts, the ``etp`` one (if
            given) shards each expert's hidden dim with sequence-parallel input, the others
            replicate the experts (data parallel).
        static_splits: every rank routes the same number of tokens in every call (fixed batch
            shape); BASE layers in training then skip the count exchange (see `FlatDispatcher`).
        global_base: BASE layers balance over the whole ep group (`GroupBalance`) instead of
            per rank. True: the ranks agree through the experts' prices (`price_balanced_assignment`,
            nothing like the scores travels); ``"gather"``: every rank gathers the group's scores
            and solves the whole problem (the reference; its traffic grows with the group).
        dispatch_strategy: how rows reach their experts, see `moe.parallel.dispatch`
            ("auto", "resort" or "per_expert").
        dispatch: "flat" (every ep rank exchanges rows with every other, `FlatDispatcher`),
            "hierarchical" (nodes x ranks per node: a token crosses between nodes once per
            destination node, `HierarchicalDispatcher`; no static_splits) or "auto"
            (hierarchical when the ep group spans more than one node and static_splits is not
            asked for, else flat).
        ranks_per_node: the ep ranks per node (ep rank r is on node r // ranks_per_node); must
            divide the ep size. Default: from the environment's ``LOCAL_WORLD_SIZE`` (torchrun's),
            the ep ranks on ep rank 0's node (so tp ranks in the node are not counted), else
            the whole group is one node (`resolve_ranks_per_node`).
        chunks: C > 1 cuts each forward's row exchange into C chunks, each chunk's rows in
            flight while another's experts compute, forward and backward (`ChunkedDispatcher`;
            with dispatch="hierarchical", the exchange between nodes in C chunks,
            `ChunkedHierarchicalDispatcher`; the "resort" send order). 1: one exchange each way.

    Every rank must call this with the same model and options (checked: a ValueError on every
    rank otherwise). The MoE layers' other parameters and buffers are broadcast from the mesh's
    first rank and the expert weights scattered from it, so all ranks start from its values.
    Gradients: see `reduce_gradients`.
    """
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    layers = [(name, m) for name, m in module.named_modules() if isinstance(m, MoE)]
    options = {
        "ep": ep,
        "etp": etp,
        "static_splits": static_splits,
        "global_base": global_base,
        "dispatch_strategy": dispatch_strategy,
        "dispatch": dispatch,
        "ranks_per_node": _nodes(mesh, ep, ranks_per_node, dispatch),  # as resolved, or why not: agreed
        "chunks": chunks,
        "mesh": tuple(mesh.shape),
    }
    if global_base not in (False, True, "gather"):
        raise ValueError(f"global_base must be False, True or 'gather', got {global_base!r}")
    check_same_config(layers, mesh, options)  # first: the checks below then fail alike on every rank
    ep_dim, etp_dim = _mesh_dim(mesh, ep, "ep"), _mesh_dim(mesh, etp, "etp")
    if dispatch_strategy not in STRATEGIES:
        raise ValueError(f"dispatch_strategy must be one of {STRATEGIES}, got {dispatch_strategy!r}")
    if dispatch not in DISPATCHES:
        raise ValueError(f"dispatch must be one of {DISPATCHES}, got {dispatch!r}")
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"chunks must be a positive int, got {chunks!r}")
    if chunks > 1 and dispatch_strategy == "per_expert":
        raise ValueError(
            "chunks > 1 sends each chunk's rows in one all-to-all: use dispatch_strategy 'resort' or 'auto'"
        )
    if ep_dim == etp_dim:
        raise ValueError(f"ep and etp must name different mesh dimensions, got {ep!r} for both")
    if not layers:
        raise ValueError(f"module holds no MoE layer to parallelise ({type(module).__name__})")
    for name, layer in layers:
        if layer.parallel is not None:
            raise ValueError(f"MoE layer {name!r} is already parallelised")
    ep_size = mesh.size(ep_dim)
    etp_size = mesh.size(etp_dim) if etp_dim is not None else 1
    ranks_per_node = options["ranks_per_node"]
    if isinstance(ranks_per_node, str):
        raise ValueError(ranks_per_node)
    if dispatch == "auto":
        multi_node = ranks_per_node < ep_size
        dispatch = "hierarchical" if multi_node and not static_splits else "flat"
    if dispatch == "hierarchical" and static_splits:
        raise ValueError(
            "dispatch='hierarchical' has no static path (the pairs each node receives follow the routing, so "
            "its count exchange stays); got static_splits=True: use dispatch='flat' or 'auto'"
        )
    for name, layer in layers:
        cfg = layer.config
        if cfg.num_experts % ep_size:
            raise ValueError(
                f"layer {name!r}: num_experts={cfg.num_experts} must be divisible by the ep size, {ep_size}"
            )
        if cfg.hidden_dim % etp_size:
            raise ValueError(
                f"layer {name!r}: hidden_dim={cfg.hidden_dim} must be divisible by the etp size, {etp_size}"
            )
        if global_base and cfg.router != "base":
            raise ValueError(f"global_base=True needs BASE routers; layer {name!r} has router={cfg.router!r}")
        extras = getattr(layer.router.config, "base_extras", "lowest")
        if static_splits and not global_base and isinstance(layer.router, BaseRouter) and extras != "lowest":
            raise ValueError(
                f"static_splits=True needs base_extras='lowest' in BASE layers (the loads sent must follow from "
                f"the token count alone; router_options={{'base_extras': 'lowest'}}); layer {name!r} got {extras!r}"
            )
    groups = node_groups(mesh, ep, ranks_per_node) if dispatch == "hierarchical" else None  # once, for every layer
    for _, layer in layers:
        for name, t in [*layer.named_parameters(), *layer.named_buffers()]:
            if not name.startswith("experts."):
                _broadcast(t.data, mesh)
        ex = layer.experts
        for wname, hidden in (("w1", 2), ("w3", 2), ("w2", 1)):
            w = getattr(ex, wname)
            if w is None:
                continue
            placements = [Replicate()] * mesh.ndim
            placements[ep_dim] = Shard(0)
            if etp_dim is not None:
                placements[etp_dim] = Shard(hidden)
            shard = distribute_tensor(w.detach(), mesh, placements)
            setattr(ex, wname, nn.Parameter(shard, requires_grad=w.requires_grad))
        if groups is not None and chunks > 1:
            dispatcher = ChunkedHierarchicalDispatcher(
                mesh, layer.config.num_experts, chunks=chunks, ranks_per_node=ranks_per_node, groups=groups, ep=ep,
                etp=etp,
            )  # fmt: skip
        elif groups is not None:
            dispatcher = HierarchicalDispatcher(
                mesh, layer.config.num_experts, ranks_per_node=ranks_per_node, groups=groups, ep=ep, etp=etp,
                strategy=dispatch_strategy,
            )  # fmt: skip
        elif chunks > 1:
            dispatcher = ChunkedDispatcher(
                mesh, layer.config.num_experts, chunks=chunks, ep=ep, etp=etp, static_splits=static_splits
            )
        else:
            dispatcher = FlatDispatcher(
                mesh, layer.config.num_experts, ep=ep, etp=etp, static_splits=static_splits, strategy=dispatch_strategy
            )
        layer.dispatcher = dispatcher
        if global_base:
            method = "gather" if global_base == "gather" else "prices"
            layer.router.assign = GroupBalance.around(layer.router, dispatcher.ep_group, method)
            layer.router.assign.agreement = dispatcher.agreement
        elif static_splits and isinstance(layer.router, BaseRouter):
            layer.router.sync_free = True  # with the approx solver the static path reads nothing back
        if isinstance(layer.router, TopKRouter):
            layer.router.sum_over_ranks = dispatcher.agreement.sum_loads
    return module


@torch.no_grad()
def reduce_gradients(module: nn.Module, mesh: DeviceMesh, *, op: str = "avg") -> None:
    """Reduce the gradients of a model parallelised by `parallelize_moe` over ``mesh``.

    The rule: every rank's loss covers its own tokens, and the target is the gradient of the sum
    (``op="sum"``) or the mean (``op="avg"``) of the ranks' losses.
    - Expert weights (DTensors on ``mesh``): each rank's shard already holds the gradient from
      every token its experts received, so it is summed only over the mesh dimensions that
      replicate it (data parallel), never over ep or etp.
    - Every other parameter is replicated: summed over the whole mesh.
    - "avg" then divides both by the number of ranks in the mesh.
    A parameter without a gradient on some ranks counts as zero there, so all ranks take part in
    every reduction; one without a gradient on every rank keeps ``grad = None`` (so an optimizer
    skips it, as it would on one device).
    """
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    params = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    for name, p in params:
        if isinstance(p, DTensor) and p.device_mesh != mesh:
            raise ValueError(f"parameter {name!r} is a DTensor on another mesh ({p.device_mesh}); reduce it there")
    has_grad = torch.tensor([float(p.grad is not None) for _, p in params], device=mesh.device_type)
    all_reduce_mesh(has_grad, mesh, dist.ReduceOp.MAX)
    for (_, p), anywhere in zip(params, has_grad.tolist(), strict=True):
        if not anywhere:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        g = p.grad
        if isinstance(g, DTensor):
            dims = [d for d, pl in enumerate(g.placements) if pl.is_replicate()]
            g = g.to_local()
        else:
            dims = range(mesh.ndim)
        for dim in dims:
            dist.all_reduce(g, group=mesh.get_group(dim))
        if op == "avg":
            g.div_(mesh.size())
