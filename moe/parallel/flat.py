"""The flat expert-parallel dispatcher: every ep rank exchanges rows with every other, once out
and once back.

Legend: W ranks in the expert-parallel ("ep") group, E experts, Wt ranks in the
expert-tensor-parallel ("etp") group, T tokens routed together, K slots per token, M kept slots.
"""

from __future__ import annotations

from typing import NoReturn

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ..dispatchers import Dispatcher
from ..kernels import permute, unpermute
from ..layer import MoE
from ..routing import (
    BaseRouter,
    TopKRouter,
    balanced_assignment,
    balanced_assignment_approx,
    expert_capacities,
    expert_capacities_list,
)
from ..routing.common import check_seq_len, in_backward
from .agreement import Agreement, input_error
from .all_to_all import all_gather_rows, reduce_scatter_rows
from .dispatch import combine, dispatch, resolve_strategy, send_key
from .global_base import GroupBalance

__all__ = ["FlatDispatcher"]


class FlatDispatcher(Dispatcher):
    """The flat expert-parallel dispatcher, set as ``layer.dispatcher`` by `parallelize_moe`:
    each rank sorts its routed rows by where they go (`sort_key`), one exchange over the ep
    group takes them to the ranks of their experts and one brings the outputs back
    (`run_experts`, with `moe.parallel.dispatch`'s `dispatch` / `combine`); under etp the
    tokens routed together are the etp group's (`gather_tokens`, `scatter_tokens`).

    ``static_splits``: the caller's promise that every rank routes the same number of tokens in
    every call. BASE routing in training (per-rank balance) then sends exactly the balanced
    loads, known on the host, so the count exchange and its host sync are skipped (a W-value
    exchange checks the promise instead, `Agreement`).

    Failures: `check_input` starts every forward; a rank that cannot go on tells the others in
    the next status collective of the forward (`moe.parallel.agreement`), so every rank raises.
    """

    local = False

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
        if "global" in stages:  # the `GroupBalance` whose first collective carries the notices
            self.agreement.global_balance = layer.router.assign
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
        """The key the slots are sorted by: the order `dispatch` sends rows in."""
        return send_key(expert_idx, self.num_experts, self.ep_size, self.strategy)

    def _static(self, router) -> bool:
        return (
            self.static_splits
            and isinstance(router, BaseRouter)
            and router.training
            and router.assign in (balanced_assignment, balanced_assignment_approx)
            and router.config.base_extras == "lowest"
        )

    def __call__(self, layer: MoE, x_TD: Tensor, routing, gates_TK: Tensor) -> Tensor:
        """The routed tokens sorted in send order -> `run_experts` -> unpermuted with the gates."""
        cfg = layer.config
        keys = self.sort_key(routing.expert_idx)  # the order rows are sent in
        rows = self.known_rows(layer, routing)
        xs_MD, info = permute(x_TD, keys, num_experts=cfg.num_experts, backend=cfg.backend, num_rows=rows)
        ys_MD = self.run_experts(layer, xs_MD, info.counts, routing)
        return unpermute(ys_MD, info, gates_TK, backend=cfg.backend)

    def known_rows(self, layer: MoE, routing) -> int | None:
        """The number of rows this rank sends when it is known without reading the routing
        (the static path: BASE keeps every slot), else None."""
        return routing.expert_idx.numel() if self._static(layer.router) else None

    def run_experts(self, layer: MoE, xs_MD: Tensor, counts_E: Tensor, routing) -> Tensor:
        """Expert-sorted rows of the routed tokens -> the experts' outputs, in the same order."""
        known = self.known_counts(layer, counts_E, routing)
        x_local, counts_local, info = dispatch(
            xs_MD, counts_E, self.ep_group, known_counts=known, strategy=self.strategy
        )
        return combine(layer.experts(x_local, counts_local), info)

    def known_counts(self, layer: MoE, counts_E: Tensor, routing) -> list[int] | None:
        """Before the rows move: the last status collective's host-side part, and the rows per
        global expert every rank sends when they are known on the host (the static path), else
        None (the count exchange follows)."""
        if "static" in self.agreement.ahead:  # the static path, with a router that reads anyway
            self.agreement.static_sizes(routing.expert_idx.shape[0])
        self.agreement.start([])  # the count exchange, if any, is the last status collective
        if not self._static(layer.router):
            return None
        num_tokens, k = routing.expert_idx.shape
        known = expert_capacities_list(num_tokens, layer.config.num_experts, k)  # no tensor to read back
        expected = expert_capacities(num_tokens, layer.config.num_experts, k, device=counts_E.device)
        if self.strategy == "per_expert":  # the send order: by local expert, then by rank
            expected = expected.view(self.ep_size, -1).T.reshape(-1)
        torch._assert_async((counts_E == expected).all())  # the promise, checked without a host sync
        return known

    def fail(self, layer: MoE, err: Exception) -> NoReturn:
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
