"""Router losses: pure functions of tensors (nothing is stored on a module).

Legend: T tokens, E experts, K expert slots per token, B sequences, S tokens per sequence.

- `load_balancing_loss`: Switch Transformer (Fedus et al. 2021), ``E * sum_e f_e * P_e``.
- `sequence_load_balancing_loss`: the same per sequence, averaged (DeepSeek-V3's sequence-wise loss).
- `router_z_loss`: ST-MoE (Zoph et al. 2022), mean over tokens of ``logsumexp(logits)^2``.

All three compute in fp32 and return a scalar; an empty batch (T = 0) gives a zero that still
belongs to the autograd graph of its input.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["load_balancing_loss", "router_z_loss", "sequence_load_balancing_loss"]


def _describe(t: object) -> str:
    return f"shape {tuple(t.shape)} dtype {t.dtype}" if isinstance(t, Tensor) else type(t).__name__


def _check_routing(probs_TE: Tensor, expert_idx_TK: Tensor, num_experts: int) -> None:
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    if not isinstance(probs_TE, Tensor) or probs_TE.dim() != 2 or not probs_TE.is_floating_point():
        raise ValueError(f"probs_TE must be a floating (T, E) tensor, got {_describe(probs_TE)}")
    if probs_TE.shape[1] != num_experts:
        raise ValueError(f"probs_TE must have E = num_experts = {num_experts} columns, got {_describe(probs_TE)}")
    integer = isinstance(expert_idx_TK, Tensor) and not (
        expert_idx_TK.is_floating_point() or expert_idx_TK.is_complex() or expert_idx_TK.dtype == torch.bool
    )
    if not integer or expert_idx_TK.dim() != 2:
        raise ValueError(f"expert_idx_TK must be an integer (T, K) tensor, got {_describe(expert_idx_TK)}")
    if expert_idx_TK.shape[0] != probs_TE.shape[0]:
        raise ValueError(
            f"expert_idx_TK must have the same T as probs_TE (T = {probs_TE.shape[0]}), got {_describe(expert_idx_TK)}"
        )


def _slot_fractions(expert_idx_BN: Tensor, num_experts: int) -> Tensor:
    """(B, N) expert of each of N slots, -1 = dropped -> (B, E) fp32 fraction of the N slots per expert.

    Dropped slots count in the denominator but for no expert, so f sums to the kept fraction.
    """
    valid = expert_idx_BN >= 0
    counts = torch.zeros(expert_idx_BN.shape[0], num_experts, dtype=torch.float32, device=expert_idx_BN.device)
    counts.scatter_add_(1, expert_idx_BN.long().clamp(min=0), valid.float())
    return counts / max(expert_idx_BN.shape[1], 1)


def load_balancing_loss(probs_TE: Tensor, expert_idx_TK: Tensor, num_experts: int) -> Tensor:
    """Switch load-balancing loss ``E * sum_e f_e * P_e``: scalar fp32.

    Args:
        probs_TE: (T, E) router probabilities (each row sums to one).
        expert_idx_TK: (T, K) integer, the expert of each slot, or -1 for a dropped slot.
        num_experts: E.

    ``f_e`` is the fraction of the T*K slots that are routed to e (dropped slots belong to no
    expert) and ``P_e`` the mean probability of e over the T tokens. The loss is 1.0 at perfect
    balance with uniform probabilities and E when every slot and all the probability go to one
    expert. ``f`` is a count and carries no gradient: the loss is differentiable through
    ``probs_TE`` only, with ``d loss / d probs[t, e] = E * f_e / T``.
    """
    _check_routing(probs_TE, expert_idx_TK, num_experts)
    p = probs_TE.float()
    if p.shape[0] == 0:
        return p.sum() * 0.0
    f_E = _slot_fractions(expert_idx_TK.reshape(1, -1), num_experts)[0]
    return num_experts * (f_E * p.mean(dim=0)).sum()


def sequence_load_balancing_loss(probs_TE: Tensor, expert_idx_TK: Tensor, num_experts: int, seq_len: int) -> Tensor:
    """Sequence-wise load-balancing loss (DeepSeek-V3): scalar fp32.

    Args:
        probs_TE: (T, E) router probabilities, rows are tokens of B = T / seq_len consecutive sequences.
        expert_idx_TK: (T, K) integer, -1 for a dropped slot.
        num_experts: E.
        seq_len: S, tokens per sequence; must divide T.

    `load_balancing_loss` computed on each sequence of S tokens alone, then averaged over the B
    sequences. With ``seq_len == T`` it equals `load_balancing_loss`.
    """
    _check_routing(probs_TE, expert_idx_TK, num_experts)
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
    num_tokens = probs_TE.shape[0]
    if num_tokens % seq_len != 0:
        raise ValueError(f"seq_len must divide the number of tokens T = {num_tokens}, got seq_len = {seq_len}")
    p = probs_TE.float()
    if num_tokens == 0:
        return p.sum() * 0.0
    num_seqs = num_tokens // seq_len
    f_BE = _slot_fractions(expert_idx_TK.reshape(num_seqs, -1), num_experts)
    P_BE = p.view(num_seqs, seq_len, num_experts).mean(dim=1)
    return num_experts * (f_BE * P_BE).sum(dim=1).mean()


def router_z_loss(logits_TE: Tensor) -> Tensor:
    """ST-MoE router z-loss ``mean_t logsumexp(logits[t])^2``: scalar fp32.

    Args:
        logits_TE: (T, E) router logits (before softmax).

    It keeps logits small, which keeps the softmax of low-precision logits accurate.
    """
    if not isinstance(logits_TE, Tensor) or logits_TE.dim() != 2 or not logits_TE.is_floating_point():
        raise ValueError(f"logits_TE must be a floating (T, E) tensor, got {_describe(logits_TE)}")
    if logits_TE.shape[1] < 1:
        raise ValueError(f"logits_TE must have E >= 1 columns, got {_describe(logits_TE)}")
    z = logits_TE.float()
    if z.shape[0] == 0:
        return z.sum() * 0.0
    return torch.logsumexp(z, dim=1).square().mean()
