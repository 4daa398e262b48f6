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
from ..routing import (
    BaseRouter,
    TopKRouter,
    balanced_assignment,
    balanced_assignment_approx,
    expert_capacities,
)
from ..routing.common import check_seq_len, in_backward
from .agreement import Agreement, all_reduce_mesh, check_same_config, exchange_sizes, input_error
from .all_to_all import all_gather_rows, reduce_scatter_rows
from .dispatch import STRATEGIES, combine, dispatch, raise_if_peers_failed, resolve_strategy, send_key

__all__ = ["ExpertParallel", "GroupBalance", "parallelize_moe", "reduce_gradients"]


class GroupBalance:
    """`BaseRouter.assign` over a group: the scores of every rank are gathered, every rank solves
    the same balanced assignment over all of them and keeps its own rows, so each expert gets
    exactly its share of the group's tokens. Cost per call: the gather (each rank receives the
    group's (sum T, E) fp32 scores) and a solve over sum T tokens on every rank."""

    def __init__(self, group, solver) -> None:
        self.group, self.solver = group, solver
        self.agreement = None  # the layer's `Agreement`, told when the exchange has run

    def __call__(self, scores_TE: Tensor, k: int, **options) -> Tensor:
        sizes = exchange_sizes(scores_TE.shape[0], self.group, scores_TE.device)
        if self.agreement is not None:
            self.agreement.passed("global")
        raise_if_peers_failed(sizes, self.group, "exchange")
        rows = all_gather_rows(scores_TE.detach(), sizes, self.group)  # the same (sum T, E) everywhere
        idx = self.solver(rows, k, **options)
        start = sum(sizes[: dist.get_rank(self.group)])
        return idx[start : start + scores_TE.shape[0]]


class ExpertParallel:
    """The parallel steps of one layer, set as ``layer.parallel`` by `parallelize_moe`.

    ``static_splits``: the caller's promise that every rank routes the same number of tokens in
    every call. BASE routing in training (per-rank balance) then sends exactly the balanced
    loads, known on the host, so the count exchange and its host sync are skipped (a W-value
    exchange checks the promise instead, `Agreement`).

    Failures: `check_input` starts every forward; a rank that cannot go on tells the others in
    the next status collective of the forward (`moe.parallel.agreement`), so every rank raises.
    """

    def __init__(
        self,
        mesh: DeviceMesh,
        num_experts: int,
        *,
        ep: str = "ep",
        etp: str | None = None,
        static_splits: bool = False,
        strategy: str = "auto",
    ) -> None:
        self.static_splits = static_splits
        self.num_experts = num_experts
        self.device = torch.device(mesh.device_type)
        self.strategy = resolve_strategy(strategy, torch.device(mesh.device_type))
        self.ep_group = mesh.get_group(ep)
        self.ep_size = dist.get_world_size(self.ep_group)
        self.etp_group = mesh.get_group(etp) if etp is not None else None
        self.etp_size = dist.get_world_size(self.etp_group) if etp is not None else 1
        self.loss_scale = 1.0 / self.etp_size  # the etp ranks route the same tokens: count the loss once
        self.agreement = Agreement(mesh, self.ep_group, self.etp_group, num_experts)
        self._sizes: list[int] | None = None  # rows of each etp rank in the current forward
        self._seq_len: int | None = None  # the current forward's
        self._broken: Exception | None = None  # a failure no collective could carry (see fail)
        # the dtype the experts compute in, when it is not their parameters' own: FSDP2 with a
        # MixedPrecisionPolicy casts the sharded fp32 weights to its param_dtype in its pre-forward
        # hook, after the layer checks its input (set by `parallelize_llama`)
        self.compute_dtype: torch.dtype | None = None

    def _on_device(self, router) -> bool:
        """The static path with a router that reads nothing back: agreed before routing, on the device."""
        return self._static(router) and not router.host_syncs

    def _stages(self, layer: MoE) -> list[str]:
        """The status collectives of a forward, in order (the same on every rank)."""
        router = layer.router
        if self._on_device(router):
            return ["static", "etp"] if self.etp_group is not None else ["static"]
        stages = ["etp"] if self.etp_group is not None else []
        if isinstance(router, TopKRouter) and router.training and router.config.bias_update_rate > 0:
            stages += [] if in_backward() else ["bias"]  # a checkpointing re-run moves no bias
        if isinstance(router, BaseRouter) and router.training and isinstance(router.assign, GroupBalance):
            stages.append("global")
        return [*stages, "static" if self._static(router) else "counts"]

    def check_input(self, layer: MoE, x: Tensor, seq_len: int | None = None) -> None:
        """Start a forward: check ``x`` (and ``seq_len`` where the routed T is known) before any
        collective; a bad one raises ValueError here and, through the forward's first status
        collective, on every other rank."""
        if self._broken is not None:
            raise ValueError(
                "an earlier forward of this layer failed on this rank after the other ranks had gone on to "
                "exchange rows (see the error above); they wait for it until the group's timeout, so this "
                "layer cannot run again in this process group"
            ) from self._broken
        stages = self._stages(layer)
        self.agreement.start(stages)
        self._seq_len = seq_len
        cfg = layer.config
        err = input_error(x, cfg.dim, self.compute_dtype or layer.experts.w1.dtype, self.device.type)
        if err is None and (self.etp_group is None or self.static_splits):  # the routed T is known
            try:
                check_seq_len(layer.router.config, seq_len, x.numel() // cfg.dim * self.etp_size)
            except ValueError as seq_err:
                err = seq_err
        if self._on_device(layer.router):
            self.agreement.on_device(None if err else x.reshape(-1, cfg.dim), seq_len)
            if err is not None:
                raise err
        elif err is not None:
            self.agreement.relay(err)

    def gather_tokens(self, x_TD: Tensor) -> Tensor:
        """This rank's tokens -> the tokens routed together (the etp group's, in rank order)."""
        if self.etp_group is None:
            return x_TD
        n = x_TD.shape[0]
        if "etp" in self.agreement.ahead:
            self._sizes = self.agreement.etp_sizes(n, self._seq_len, static=self.static_splits)
        else:  # agreed on the device already: the static path with a router that reads nothing
            self._sizes = [n] * self.etp_size
        return all_gather_rows(x_TD, self._sizes, self.etp_group)

    def sort_key(self, expert_idx: Tensor) -> Tensor:
        """The key the layer sorts its slots by: the order `dispatch` sends rows in."""
        return send_key(expert_idx, self.num_experts, self.ep_size, self.strategy)

    def _static(self, router) -> bool:
        return (
            self.static_splits
            and isinstance(router, BaseRouter)
            and router.training
            and router.assign in (balanced_assignment, balanced_assignment_approx)
            and router.config.base_extras == "lowest"
        )

    def known_rows(self, layer: MoE, routing) -> int | None:
        """The number of rows the layer sends when it is known without reading the routing
        (the static path: BASE keeps every slot), else None."""
        return routing.expert_idx.numel() if self._static(layer.router) else None

    def run_experts(self, layer: MoE, xs_MD: Tensor, counts_E: Tensor, routing) -> Tensor:
        """Expert-sorted rows of the routed tokens -> the experts' outputs, in the same order."""
        if "static" in self.agreement.ahead:  # the static path, with a router that reads anyway
            self.agreement.static_sizes(routing.expert_idx.shape[0])
        self.agreement.start([])  # the count exchange, if any, is the last status collective
        known = None
        if self._static(layer.router):
            num_tokens, k = routing.expert_idx.shape
            known = expert_capacities(num_tokens, layer.config.num_experts, k).tolist()  # made on the host
            expected = expert_capacities(num_tokens, layer.config.num_experts, k, device=counts_E.device)
            if self.strategy == "per_expert":  # the send order: by local expert, then by rank
                expected = expected.view(self.ep_size, -1).T.reshape(-1)
            torch._assert_async((counts_E == expected).all())  # the promise, checked without a host sync
        x_local, counts_local, info = dispatch(
            xs_MD, counts_E, self.ep_group, known_counts=known, strategy=self.strategy
        )
        return combine(layer.experts(x_local, counts_local), info)

    def fail(self, layer: MoE, err: Exception) -> None:
        """This rank cannot route (e.g. NaN input), or learnt in a status collective that another
        rank cannot: run the forward's remaining status collectives with failure notices, so
        every rank raises, then raise ``err``. When none remains (the sync-free static path
        agreed before routing) the other ranks have gone on to exchange rows and wait until the
        timeout; this rank then refuses every later forward instead of meeting their exchange
        with another step's rows."""
        if not self.agreement.ahead:
            self._broken = err
        self.agreement.relay(err)

    def scatter_tokens(self, y_TD: Tensor) -> Tensor:
        """Outputs of the routed tokens (partial sums over F under etp) -> this rank's rows."""
        if self.etp_group is None:
            return y_TD
        return reduce_scatter_rows(y_TD, self._sizes, self.etp_group)

    def local_rows(self, t: Tensor) -> Tensor:
        """Rows of a per-routed-token tensor that belong to this rank's tokens."""
        if self.etp_group is None:
            return t
        rank = dist.get_rank(self.etp_group)
        start = sum(self._sizes[:rank])
        return t[start : start + self._sizes[rank]]


def _mesh_dim(mesh: DeviceMesh, name: str | None, arg: str) -> int | None:
    names = mesh.mesh_dim_names or ()
    if name is None:
        return None
    if name not in names:
        raise ValueError(f"{arg} must name a dimension of the mesh, whose dimensions are {names}; got {name!r}")
    return names.index(name)


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
    global_base: bool = False,
    dispatch_strategy: str = "auto",
) -> nn.Module:
    """Spread the experts of every `MoE` layer in ``module`` over ``mesh``; returns ``module``.

    Args:
        mesh: names its dimensions; the ``ep`` one shards the experts, the ``etp`` one (if
            given) shards each expert's hidden dim with sequence-parallel input, the others
            replicate the experts (data parallel).
        static_splits: every rank routes the same number of tokens in every call (fixed batch
            shape); BASE layers in training then skip the count exchange (see `ExpertParallel`).
        global_base: BASE layers balance over the whole ep group (`GroupBalance`) instead of
            per rank.
        dispatch_strategy: how rows reach their experts, see `moe.parallel.dispatch`
            ("auto", "resort" or "per_expert").

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
        "mesh": tuple(mesh.shape),
    }
    check_same_config(layers, mesh, options)  # first: the checks below then fail alike on every rank
    ep_dim, etp_dim = _mesh_dim(mesh, ep, "ep"), _mesh_dim(mesh, etp, "etp")
    if dispatch_strategy not in STRATEGIES:
        raise ValueError(f"dispatch_strategy must be one of {STRATEGIES}, got {dispatch_strategy!r}")
    if ep_dim == etp_dim:
        raise ValueError(f"ep and etp must name different mesh dimensions, got {ep!r} for both")
    if not layers:
        raise ValueError(f"module holds no MoE layer to parallelise ({type(module).__name__})")
    for name, layer in layers:
        if layer.parallel is not None:
            raise ValueError(f"MoE layer {name!r} is already parallelised")
    ep_size = mesh.size(ep_dim)
    etp_size = mesh.size(etp_dim) if etp_dim is not None else 1
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
        layer.parallel = ExpertParallel(
            mesh, layer.config.num_experts, ep=ep, etp=etp, static_splits=static_splits, strategy=dispatch_strategy
        )
        if global_base:
            layer.router.assign = GroupBalance(layer.parallel.ep_group, solver=layer.router.assign)
            layer.router.assign.agreement = layer.parallel.agreement
        elif static_splits and isinstance(layer.router, BaseRouter):
            layer.router.sync_free = True  # with the approx solver the static path reads nothing back
        if isinstance(layer.router, TopKRouter):
            layer.router.sum_over_ranks = layer.parallel.agreement.sum_loads
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
