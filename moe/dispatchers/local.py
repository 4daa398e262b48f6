"""The one-device dispatcher: a sorted copy of the tokens through the grouped experts and back."""

from __future__ import annotations

from torch import Tensor, nn

from ..kernels import permute, unpermute
from .base import Dispatcher

__all__ = ["LocalDispatcher"]


class LocalDispatcher(Dispatcher):
    """``permute`` the tokens by expert -> the grouped experts -> ``unpermute`` with the gates."""

    def __call__(self, layer: nn.Module, x_TD: Tensor, routing, gates_TK: Tensor) -> Tensor:
        cfg = layer.config
        rows = self.known_rows(layer, routing)
        xs_MD, info = permute(x_TD, routing.expert_idx, num_experts=cfg.num_experts, backend=cfg.backend, num_rows=rows)
        ys_MD = layer.experts(xs_MD, info.counts)
        return unpermute(ys_MD, info, gates_TK, backend=cfg.backend)
