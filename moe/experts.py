"""Expert FFNs over expert-sorted rows, and the dense shared experts.

Legend: M rows sorted by expert, D model dim, F expert hidden dim, E experts.

    swiglu:  y = (silu(x @ w1[e]) * (x @ w3[e])) @ w2[e]
    gelu / relu:  y = act(x @ w1[e]) @ w2[e]

with w1, w3: (E, D, F) and w2: (E, F, D), each product one `grouped_mm` over all experts; on
CPU, SwiGLU experts with large hidden activations run one expert at a time instead
(`moe.kernels.expert_ffn`), with the same results bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from .kernels import PermuteInfo, gather_grouped_mm, grouped_mm, grouped_mm_scatter, swiglu, swiglu_ffn
from .kernels.expert_ffn import use_swiglu_ffn
from .kernels.grouped_mm import resolve_backend

__all__ = ["GroupedExperts", "SharedExperts"]

_ACT = {"gelu": F.gelu, "relu": F.relu}  # swiglu: `swiglu`


class GroupedExperts(nn.Module):
    """E expert FFNs applied to rows grouped by expert: (M, D), counts (E,) -> (M, D)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, activation: str = "swiglu", backend: str = "auto"):
        super().__init__()
        self.activation, self.backend = activation, backend
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))  # (E, D, F)
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim)) if activation == "swiglu" else None
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))  # (E, F, D)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # N(0, 0.02) for every projection, as Mixtral's and Llama's initialisers do
        for w in (self.w1, self.w3, self.w2):
            if w is not None:
                nn.init.normal_(w, std=0.02)

    def forward(self, x_MD: Tensor, counts_E: Tensor) -> Tensor:
        """``counts_E`` has one entry per expert held here: all E, or this rank's shard of them
        once `moe.parallel.parallelize_moe` has made the weights DTensors (their local shards
        are used; a hidden-dim shard gives a partial sum of the output)."""
        w1, w3, w2 = (_local(w) for w in (self.w1, self.w3, self.w2))
        if w3 is not None and use_swiglu_ffn(x_MD, w1, resolve_backend(self.backend, x_MD)):
            return swiglu_ffn(x_MD, w1, w3, w2, counts_E)
        h = grouped_mm(x_MD, w1, counts_E, backend=self.backend)
        up = grouped_mm(x_MD, w3, counts_E, backend=self.backend) if w3 is not None else None
        return grouped_mm(_activate(self.activation, h, up), w2, counts_E, backend=self.backend)

    def forward_fused(self, x_TD: Tensor, info: PermuteInfo, gates_TK: Tensor) -> Tensor:
        """The experts on the tokens themselves: the gather of the permutation runs inside the
        first GEMMs and the gate-weighted scatter inside the last, (T, D) -> (T, D)."""
        w1, w3, w2 = (_local(w) for w in (self.w1, self.w3, self.w2))
        h = gather_grouped_mm(x_TD, w1, info, backend=self.backend)
        up = gather_grouped_mm(x_TD, w3, info, backend=self.backend) if w3 is not None else None
        return grouped_mm_scatter(_activate(self.activation, h, up), w2, info, gates_TK, backend=self.backend)


def _activate(activation: str, h: Tensor, up: Tensor | None) -> Tensor:
    """The hidden activations: ``swiglu(h, up)`` with an up projection, else ``act(h)``."""
    return swiglu(h, up) if up is not None else _ACT[activation](h)


def _local(w: Tensor | None) -> Tensor | None:
    return w.to_local() if isinstance(w, DTensor) else w


class SharedExperts(nn.Module):
    """``num`` dense experts every token goes through, fused into one FFN of width num * F."""

    def __init__(self, dim: int, hidden_dim: int, num: int, activation: str = "swiglu"):
        super().__init__()
        self.activation = activation
        width = hidden_dim * num
        self.w1 = nn.Linear(dim, width, bias=False)
        self.w3 = nn.Linear(dim, width, bias=False) if activation == "swiglu" else None
        self.w2 = nn.Linear(width, dim, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.w1, self.w3, self.w2):
            if lin is not None:
                nn.init.normal_(lin.weight, std=0.02)

    def forward(self, x_TD: Tensor) -> Tensor:
        up = self.w3(x_TD) if self.w3 is not None else None
        return self.w2(_activate(self.activation, self.w1(x_TD), up))
