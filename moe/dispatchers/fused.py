"""The one-device dispatcher with the permutation fused into the expert GEMMs
(`moe.kernels.fused`): no sorted copy of the tokens or of the outputs."""

from __future__ import annotations

from torch import Tensor, nn

from ..kernels import sort_slots
from .base import Dispatcher

__all__ = ["FusedDispatcher"]


class FusedDispatcher(Dispatcher):
    """The slots sorted by expert (``sort_slots``), then the experts read the tokens through
    that order and scatter their gate-weighted outputs back (``GroupedExperts.forward_fused``)."""

    def __call__(self, layer: nn.Module, x_TD: Tensor, routing, gates_TK: Tensor) -> Tensor:
        rows = self.known_rows(layer, routing)
        info = sort_slots(routing.expert_idx, num_experts=layer.config.num_experts, num_rows=rows)
        return layer.experts.forward_fused(x_TD, info, gates_TK)
