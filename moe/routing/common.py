"""Pieces every router shares: input checks, fp32 gate logits, losses, capacity drops.

Legend: T tokens, D model dim, E experts, K expert slots per token, N = T*K slots.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .config import RouterConfig
from .losses import load_balancing_loss, router_z_loss, sequence_load_balancing_loss

__all__ = ["GatedRouter", "check_seq_len", "check_tokens", "drop_by_score", "gate_logits", "router_losses"]


def in_backward() -> bool:
    """True while autograd runs a backward pass: a forward called now is activation checkpointing
    re-running it, and must neither repeat its side effects nor route differently."""
    return torch._C._current_graph_task_id() != -1


def check_tokens(x_TD: Tensor, dim: int) -> None:
    """Raise ValueError unless ``x_TD`` is a finite floating (T, D) tensor with D == ``dim``."""
    if not isinstance(x_TD, Tensor):
        raise ValueError(f"x must be a torch.Tensor of shape (T, D={dim}), got {type(x_TD).__name__}")
    if x_TD.dim() != 2 or x_TD.shape[1] != dim:
        raise ValueError(f"x must have shape (T, D={dim}), got {tuple(x_TD.shape)}")
    if not x_TD.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got dtype {x_TD.dtype}")
    # host sync; a NaN would otherwise pass silently through topk and pick arbitrary experts
    if x_TD.numel() and not bool(torch.isfinite(x_TD).all()):
        raise ValueError(f"x must be finite: found NaN or Inf in a tensor of shape {tuple(x_TD.shape)}")


def check_seq_len(config: RouterConfig, seq_len: int | None, num_tokens: int) -> None:
    """Raise ValueError if ``seq_len`` is needed and missing, or does not split the T tokens."""
    if seq_len is None:
        if config.seq_aux_loss_coef > 0:
            raise ValueError(
                f"seq_len must be given when seq_aux_loss_coef > 0 (seq_aux_loss_coef = {config.seq_aux_loss_coef}), "
                "got None"
            )
        return
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len must be None or an int >= 1, got {seq_len!r}")
    if num_tokens % seq_len != 0:
        raise ValueError(f"seq_len must divide the number of tokens T = {num_tokens}, got seq_len = {seq_len}")


def gate_logits(x_TD: Tensor, weight_ED: Tensor) -> Tensor:
    """(T, D) x (E, D) -> (T, E) fp32 logits; router math stays in fp32 whatever the input dtype."""
    return x_TD.float() @ weight_ED.float().T


def router_losses(
    config: RouterConfig, logits_TE: Tensor, probs_TE: Tensor, expert_idx_TK: Tensor, seq_len: int | None
) -> tuple[Tensor, Tensor]:
    """``(aux_loss, z_loss)`` scalars weighted by the config's coefficients; exact zeros when a coefficient is 0."""
    num_experts = config.num_experts
    aux = logits_TE.new_zeros(())
    if config.aux_loss_coef > 0:
        aux = aux + config.aux_loss_coef * load_balancing_loss(probs_TE, expert_idx_TK, num_experts)
    if config.seq_aux_loss_coef > 0 and seq_len is not None:
        seq = sequence_load_balancing_loss(probs_TE, expert_idx_TK, num_experts, seq_len)
        aux = aux + config.seq_aux_loss_coef * seq
    z = logits_TE.new_zeros(())
    if config.z_loss_coef > 0:
        z = z + config.z_loss_coef * router_z_loss(logits_TE)
    return aux, z


def drop_by_score(expert_idx_TK: Tensor, score_TK: Tensor, num_experts: int, capacity: int | Tensor) -> Tensor:
    """(T, K) bool: which slots the experts keep, each at most ``capacity`` (an int, or (E,) int64).

    Each expert keeps its ``capacity`` slots with the highest score; among equal scores the
    lowest token index wins. ``expert_idx_TK`` must hold experts in [0, E) (nothing dropped yet).
    """
    e_N = expert_idx_TK.reshape(-1)
    n = e_N.numel()
    # stable sorts: by score (descending), then by expert, so each expert's block is ordered by
    # score with ties in slot order, i.e. by token index
    order = torch.sort(-score_TK.reshape(-1), stable=True).indices
    by_expert = torch.sort(e_N[order], stable=True)
    slot_sorted = order[by_expert.indices]
    counts_E = torch.bincount(e_N, minlength=num_experts)
    start_E = torch.cumsum(counts_E, 0) - counts_E
    rank = torch.arange(n, device=e_N.device) - start_E[by_expert.values]
    keep_N = torch.empty(n, dtype=torch.bool, device=e_N.device)
    cap = capacity[by_expert.values] if isinstance(capacity, Tensor) else capacity
    keep_N[slot_sorted] = rank < cap
    return keep_N.view_as(expert_idx_TK)


class GatedRouter(nn.Module):
    """What every router holds: its config and a gate weight (E, D), ``logits = x @ weight.T``."""

    def __init__(self, config: RouterConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.dim))  # (E, D)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)

    def logits(self, x_TD: Tensor) -> Tensor:
        """Checked input (T, D) -> fp32 logits (T, E)."""
        check_tokens(x_TD, self.config.dim)
        return gate_logits(x_TD, self.weight)

    def extra_repr(self) -> str:
        cfg = self.config
        return f"dim={cfg.dim}, num_experts={cfg.num_experts}, top_k={cfg.top_k}"
