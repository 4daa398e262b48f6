"""Loads of an exactly balanced assignment: the capacities, the score, a feasible start."""

from __future__ import annotations

import torch
from torch import Tensor

from ..common import bincount


def expert_capacities(num_tokens: int, num_experts: int, k: int = 1, *, device=None) -> Tensor:
    """Tokens per expert under exact balance: (E,) int64.

    ``T*K`` slots are split as evenly as possible; when ``T*K % E = r > 0`` the experts with the
    lowest indices, ``0 .. r-1``, receive one slot more than the others. Made on the device (a
    tensor built from a host list would be a blocking copy on CUDA).
    """
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if num_tokens < 0 or k < 1:
        raise ValueError(f"num_tokens must be >= 0 and k >= 1, got num_tokens={num_tokens}, k={k}")
    base, extra = divmod(num_tokens * k, num_experts)
    caps = torch.full((num_experts,), base, dtype=torch.int64, device=device)
    return caps + (torch.arange(num_experts, device=device) < extra)


def assignment_score(scores_TE: Tensor, expert_idx_TK: Tensor) -> Tensor:
    """Total score of an assignment (dropped slots, ``-1``, count zero): scalar in float64."""
    valid = expert_idx_TK >= 0
    picked = scores_TE.double().gather(1, expert_idx_TK.clamp(min=0))
    return (picked * valid).sum()


def _round_robin(num_tokens: int, num_experts: int, k: int, device) -> Tensor:
    """A feasible balanced assignment: slot i (token-major) goes to expert i mod E."""
    return (torch.arange(num_tokens * k, device=device) % num_experts).view(num_tokens, k)


def _loads(out_TK: Tensor, num_experts: int) -> Tensor:
    """(E,) slots each expert holds (-1 slots hold none), without a host sync."""
    return bincount(torch.where(out_TK < 0, num_experts, out_TK), num_experts + 1)[:num_experts]
