"""Sorting token slots by expert and combining expert outputs back per token.

Legend: T tokens, D model dim, K slots per token, E experts, M kept (non -1) slots.

permute is a gather (its backward a scatter-add over tokens); unpermute is a weighted
scatter-add (its backward a gather, and the row-wise dot product for the weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["PermuteInfo", "permute", "unpermute"]


@dataclass(frozen=True)
class PermuteInfo:
    """How the M kept slots were sorted by expert (stable: token order within an expert)."""

    slot: Tensor  # (M,) int64 flat slot index t*K + j of each sorted row
    token: Tensor  # (M,) int64 token of each sorted row
    counts: Tensor  # (E,) int64 rows per expert
    offsets: Tensor  # (E + 1,) int64 first row of each expert, then M
    num_tokens: int  # T
    top_k: int  # K


def permute(x_TD: Tensor, expert_idx_TK: Tensor, *, num_experts: int) -> tuple[Tensor, PermuteInfo]:
    """Rows of x repeated per kept slot and sorted by expert: (M, D) and the `PermuteInfo`.

    Slots with expert -1 (dropped) are skipped. Two host syncs (range check, M).
    """
    if not isinstance(x_TD, Tensor) or x_TD.dim() != 2:
        raise ValueError(f"x must be a (T, D) tensor, got {getattr(x_TD, 'shape', type(x_TD).__name__)}")
    idx = expert_idx_TK
    if not isinstance(idx, Tensor) or idx.dim() != 2 or idx.dtype != torch.int64 or idx.shape[0] != x_TD.shape[0]:
        raise ValueError(
            f"expert_idx must be a (T={x_TD.shape[0]}, K) int64 tensor, got {getattr(idx, 'shape', None)} "
            f"{getattr(idx, 'dtype', type(idx).__name__)}"
        )
    if idx.device != x_TD.device:
        raise ValueError(f"x and expert_idx must be on one device, got {x_TD.device} and {idx.device}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= num_experts):
        raise ValueError(f"expert_idx must lie in [-1, {num_experts}), got [{int(idx.min())}, {int(idx.max())}]")
    num_tokens, k = idx.shape
    key = torch.where(idx < 0, num_experts, idx).reshape(-1)  # dropped slots sort last
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    slot = order[: int(counts.sum())]
    token = slot // k
    offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    info = PermuteInfo(slot=slot, token=token, counts=counts, offsets=offsets, num_tokens=num_tokens, top_k=k)
    return x_TD[token], info


def unpermute(y_MD: Tensor, info: PermuteInfo, weights_TK: Tensor) -> Tensor:
    """(M, D) expert outputs -> (T, D): each token's weighted sum over its kept slots.

    Computed in fp32 (or wider), returned in y's dtype; a token with no kept slot gets zeros.
    """
    if not isinstance(y_MD, Tensor) or y_MD.dim() != 2 or y_MD.shape[0] != info.slot.shape[0]:
        raise ValueError(f"y must be (M={info.slot.shape[0]}, D), got {getattr(y_MD, 'shape', type(y_MD).__name__)}")
    if weights_TK.shape != (info.num_tokens, info.top_k):
        raise ValueError(f"weights must be (T, K) = {(info.num_tokens, info.top_k)}, got {tuple(weights_TK.shape)}")
    acc = torch.promote_types(y_MD.dtype, torch.float32)
    w_M = weights_TK.reshape(-1)[info.slot].to(acc)
    out = y_MD.new_zeros(info.num_tokens, y_MD.shape[1], dtype=acc)
    out = out.index_add(0, info.token, y_MD.to(acc) * w_M[:, None])
    return out.to(y_MD.dtype)
