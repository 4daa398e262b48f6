"""The interface every dispatcher of the MoE layer has, and its one-device defaults.

Legend: T tokens routed together, D model dim, K slots per token, E experts.

A forward calls, in order: ``check_input`` (before anything else), ``gather_tokens`` (the
tokens routed together), the router (``fail`` if it raises), the dispatcher itself (the
experts' gate-weighted outputs for the routed tokens), then ``scatter_tokens`` and
``local_rows`` (back to this rank's own tokens) and ``loss_scale``. On one device the tokens
routed are the layer's own and nothing needs agreeing with other ranks, so every step but the
call itself is the identity; an expert-parallel dispatcher overrides them. A dispatcher holds
no parameters or buffers (the layer's state_dict is the same whichever it has) and keeps no
reference to its layer: each step is handed the layer.
"""

from __future__ import annotations

import abc
from typing import NoReturn

from torch import Tensor, nn

from ..routing.expert_choice import expert_choice_capacity

__all__ = ["Dispatcher"]


class Dispatcher(abc.ABC):
    """Takes a layer's routed tokens to its experts and back: ``(x_TD, routing, gates_TK) -> y_TD``."""

    local = True  # every row stays on this device, no process group (the layer's ``parallel`` is None)
    loss_scale = 1.0  # the router's losses are multiplied by it (ranks routing the same tokens count them once)

    @abc.abstractmethod
    def __call__(self, layer: nn.Module, x_TD: Tensor, routing, gates_TK: Tensor) -> Tensor:
        """The experts' outputs for the routed tokens ``x_TD: (T, D)``, each token's sum over its
        kept slots of gate times expert output: (T, D) in x's dtype. ``routing`` is the router's
        `RoutingResult` for ``x_TD``; ``gates_TK: (T, K)`` its weights in x's dtype."""

    def check_input(self, layer: nn.Module, x, seq_len: int | None = None) -> None:
        """Start a forward, before any collective (the layer then checks x's shape itself)."""
        return None  # one device: nothing to agree on

    def gather_tokens(self, x_TD: Tensor) -> Tensor:
        """This rank's tokens -> the tokens routed together."""
        return x_TD

    def fail(self, layer: nn.Module, err: Exception) -> NoReturn:
        """The router raised ``err``: raise it (after telling the other ranks, where there are any)."""
        raise err

    def known_rows(self, layer: nn.Module, routing) -> int | None:
        """The number of kept slots when the router fixes it: T*K when it keeps every slot
        (dropless top-k, BASE, Sinkhorn), E*C for expert choice (each expert takes exactly C
        tokens); else None. Knowing it saves permute its host reads, which a compiled graph
        cannot make."""
        cfg = layer.config
        if cfg.router in ("base", "sinkhorn") or (cfg.router == "topk" and cfg.capacity_factor is None):
            return routing.expert_idx.numel()
        if cfg.router == "expert_choice":
            capacity = expert_choice_capacity(routing.num_tokens, cfg.num_experts, cfg.top_k, cfg.capacity_factor)
            return cfg.num_experts * capacity
        return None

    def scatter_tokens(self, y_TD: Tensor) -> Tensor:
        """Outputs of the routed tokens -> this rank's rows."""
        return y_TD

    def local_rows(self, t: Tensor) -> Tensor:
        """Rows of a per-routed-token tensor that belong to this rank's tokens."""
        return t
