"""The MoE layer: route -> dispatch (permute -> grouped experts -> unpermute) -> combine (+ shared experts).

Legend: T tokens, D model dim, K slots per token, E experts.

The layer holds no process group: the steps between routing and combining belong to its
dispatcher (`moe.dispatchers`), local or fused on one device; `moe.parallel.parallelize_moe`
swaps in an expert-parallel one from outside, which also gathers the tokens to route and
scatters the outputs back.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from . import dispatchers
from .config import MoEConfig
from .experts import GroupedExperts, SharedExperts
from .kernels import workspace
from .routing import RoutingResult, build_router
from .routing import release_work_buffers as _release_routing_buffers
from .routing.common import in_backward

__all__ = ["MoE", "aux_loss", "release_work_buffers"]


class MoE(nn.Module):
    """A Mixture-of-Experts FFN: ``forward(x)`` maps (..., D) to (..., D).

    - Router: ``config.router`` ("base", "topk", "sinkhorn", "expert_choice"), math in fp32.
      BASE balances exactly in training and routes greedily in eval.
    - Experts: E grouped FFNs (``config.activation``), plus ``num_shared_experts`` dense ones.
    - Combine: "weighted" sums each token's expert outputs times their gates; "sigmoid_residual"
      (top-1, BASE) gives ``alpha * expert(x) + (1 - alpha) * x`` with alpha the gate.
    - Losses: the router's aux and z losses (already weighted by their coefficients), summed
      over the forwards, wait on the module until `aux_loss` collects them; ``last_routing``
      keeps a detached copy of the last `RoutingResult` for inspection. Neither keeps an
      autograd graph past `aux_loss`. An activation-checkpointing re-run (a forward inside a
      backward) adds nothing to that sum; its losses wait apart, for `aux_loss` called in the
      same backward, and are dropped when the backward ends (see `aux_loss`).
    - torch.compile: on one device the forward traces with ``fullgraph=True`` for every router
      (dropless, or expert choice); see docs/training.md for what changes while it traces.
    """

    def __init__(self, config: MoEConfig) -> None:
        if not isinstance(config, MoEConfig):
            raise ValueError(f"config must be a moe.MoEConfig, got {type(config).__name__}")
        super().__init__()
        self.config = config
        self.router = build_router(config.router_config())
        self.experts = GroupedExperts(
            config.dim, config.hidden_dim, config.num_experts, config.activation, config.backend
        )
        self.shared = None
        if config.num_shared_experts:
            width = config.shared_hidden_dim or config.hidden_dim
            self.shared = SharedExperts(config.dim, width, config.num_shared_experts, config.activation)
        self.last_routing: RoutingResult | None = None
        self._pending_loss: Tensor | None = None
        self._rerun_loss: Tensor | None = None  # losses of the re-runs in the current backward
        # no parameters or buffers: the state_dict is the same whichever dispatcher is set
        self.dispatcher: dispatchers.Dispatcher = dispatchers.for_config(config)

    def reset_parameters(self) -> None:
        """Re-initialise every parameter and buffer (e.g. after building on the meta device)."""
        for module in (self.router, self.experts, self.shared):
            if module is not None:
                module.reset_parameters()

    @property
    def parallel(self) -> dispatchers.Dispatcher | None:
        """The expert-parallel dispatcher `moe.parallel.parallelize_moe` set, or None on one device."""
        return None if self.dispatcher.local else self.dispatcher

    def forward(self, x: Tensor, *, seq_len: int | None = None) -> Tensor:
        cfg, dispatcher = self.config, self.dispatcher
        dispatcher.check_input(self, x, seq_len)  # before any collective: a bad x on one rank fails every rank
        if not isinstance(x, Tensor) or x.dim() == 0 or x.shape[-1] != cfg.dim:
            raise ValueError(f"x must have shape (..., D={cfg.dim}), got {_shape_of(x)}")
        x_TD = x.reshape(-1, cfg.dim)
        x_in = dispatcher.gather_tokens(x_TD)  # the tokens routed together
        try:
            res = self.router(x_in, seq_len=seq_len)  # raises on NaN / Inf input
        except ValueError as err:
            dispatcher.fail(self, err)  # raises; any other ranks raise too instead of waiting for this one
        gates = res.weights.to(x_in.dtype)
        y_TD = dispatcher(self, x_in, res, gates)  # the experts' gate-weighted outputs of the routed tokens
        y_TD, gates = dispatcher.scatter_tokens(y_TD), dispatcher.local_rows(gates)
        loss = _loss_sum(res.aux_loss, res.z_loss)
        if dispatcher.loss_scale != 1.0:
            loss = loss * dispatcher.loss_scale
        if cfg.combine == "sigmoid_residual":
            y_TD = y_TD + (1 - gates.sum(dim=1, keepdim=True)) * x_TD
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD)
        if not in_backward():
            pending = self._pending_loss  # every forward since the last aux_loss counts
            self._pending_loss = loss if pending is None else pending + loss
            self.last_routing = dataclasses.replace(
                res, weights=res.weights.detach(), aux_loss=res.aux_loss.detach(), z_loss=res.z_loss.detach()
            )
        else:  # an activation-checkpointing re-run: the first forward has counted this loss already
            self._keep_rerun_loss(loss)
        return y_TD.view(x.shape)

    def _keep_rerun_loss(self, loss: Tensor) -> None:
        """Hold a re-run's losses for `aux_loss` called in this backward: code that attaches the
        losses to the output inside the checkpointed region (the adapters' aux-loss scalers)
        then does the same in the re-run as in the first forward. Under reentrant
        checkpointing (Megatron's recompute) the first forward ran without autograd, so the
        re-run's attachment is the only way they reach the gradients; under non-reentrant
        checkpointing the re-run runs the same ops as the first forward, as selective
        checkpointing requires. Dropped when the backward ends, so no graph outlives it."""
        if self._rerun_loss is None:
            torch.autograd.Variable._execution_engine.queue_callback(self._drop_rerun_loss)
            self._rerun_loss = loss
        else:
            self._rerun_loss = self._rerun_loss + loss

    def _drop_rerun_loss(self) -> None:
        self._rerun_loss = None

    def __getstate__(self) -> dict:
        # copy.deepcopy (EMA and eval copies) and pickling: the pending loss belongs to the
        # autograd graph of this layer's forwards (a non-leaf tensor cannot be deep-copied, and
        # a copy has run no forward), so the copy starts with none
        state = super().__getstate__()
        state["_pending_loss"] = None
        state["_rerun_loss"] = None
        return state

    def extra_repr(self) -> str:
        cfg = self.config
        return f"router={cfg.router}, experts={cfg.num_experts}, top_k={cfg.top_k}, combine={cfg.combine}"


def _loss_sum(aux: Tensor, z: Tensor) -> Tensor:
    """``aux + z``, leaving out a term that is a constant zero (its coefficient 0). Both come
    from the same logits, so a term without a gradient while the other has one is that zero.
    Compiled by inductor, ``0 + z`` folds to ``z``, the buffer `last_routing`'s detached z loss
    is returned as too; an output returned twice then gets no gradient in the backward ("expected
    Tensor() for op: input"), while a loss that is ``z`` itself is an alias torch.compile handles."""
    if aux.requires_grad != z.requires_grad:
        return aux if aux.requires_grad else z
    return aux + z


def _shape_of(x: object) -> str:
    return str(tuple(x.shape)) if isinstance(x, Tensor) else type(x).__name__


def aux_loss(model: nn.Module) -> Tensor:
    """Sum of the aux and z losses of every forward of every `MoE` layer in ``model`` since the
    last call (two forwards of one layer both count).

    Add it to the training loss; each layer's pending loss is cleared, so nothing is counted
    twice or kept alive into the next step. A scalar zero when no layer has a loss.

    Called during a backward (inside an activation-checkpointed region that the backward
    re-runs), it returns instead the losses of the re-runs since the last such call, and leaves
    the forwards' sum alone: the re-run of ``y = attach(layer(x), aux_loss(layer))`` attaches
    the same losses as the first forward did, while ``aux_loss`` after the forward still counts
    each forward once.
    """
    rerun = in_backward()
    attr = "_rerun_loss" if rerun else "_pending_loss"
    total = None
    for module in model.modules():
        if isinstance(module, MoE) and getattr(module, attr) is not None:
            total = getattr(module, attr) if total is None else total + getattr(module, attr)
            setattr(module, attr, None)
    if total is None:
        param = next(model.parameters(), None)
        return torch.zeros((), device=param.device if param is not None else None)
    return total


def release_work_buffers() -> None:
    """Free the CPU memory this thread keeps between steps: the blocks of
    `moe.kernels.workspace` (the layer's large results, up to its limit: by default a quarter of
    the machine's memory, at least 2 GiB) and the BASE solver's work buffers
    (`moe.routing.release_work_buffers`). Later steps make and keep new ones;
    `moe.kernels.workspace.set_limit(0)` stops the keeping."""
    workspace.release()
    _release_routing_buffers()
