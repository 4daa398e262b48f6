"""Pieces every router shares: input checks, fp32 gate logits, losses, capacity drops.

Legend: T tokens, D model dim, E experts, K expert slots per token, N = T*K slots.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .config import RouterConfig
from .losses import load_balancing_loss, router_z_loss, sequence_load_balancing_loss

__all__ = [
    "GatedRouter",
    "bincount",
    "check_logits",
    "check_seq_len",
    "check_tokens",
    "drop_by_score",
    "gate_logits",
    "router_losses",
]


def in_backward() -> bool:
    """True while autograd runs a backward pass: a forward called now is activation checkpointing
    re-running it, and must neither repeat its side effects nor route differently.

    False while torch.compile traces: the answer would be baked into the graph, so a compiled
    MoE layer must not be activation-checkpointed (docs/training.md)."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


def bincount(x: Tensor, n: int, *, sync_ok: bool = False) -> Tensor:
    """``torch.bincount(x, minlength=n)`` (int64) for integer ``x`` in [0, n), without a host
    sync: CUDA's bincount reads max(x) back to size its output; this adds ones into n bins.
    ``sync_ok``: the caller syncs anyway, so on CPU (where there is nothing to wait for) take
    bincount itself, which is faster there (270 against 440 us for 262k values)."""
    flat = x.reshape(-1)
    if sync_ok and flat.device.type == "cpu":
        return torch.bincount(flat, minlength=n)
    ones = torch.ones(1, dtype=torch.int64, device=x.device).expand(flat.numel())
    return torch.zeros(n, dtype=torch.int64, device=x.device).index_add_(0, flat, ones)


def check_tokens(x_TD: Tensor, dim: int, *, host_check: bool = True, values: bool = True) -> None:
    """Raise ValueError unless ``x_TD`` is a floating (T, D) tensor with D == ``dim``, and (with
    ``values``) finite. The routers pass ``values=False`` and check their logits instead
    (`check_logits`), which covers x too.

    ``host_check=False`` checks finiteness without a host sync (``torch._assert_async``: a
    RuntimeError on CPU, a device-side assert on CUDA) for callers that promise none."""
    if not isinstance(x_TD, Tensor):
        raise ValueError(f"x must be a torch.Tensor of shape (T, D={dim}), got {type(x_TD).__name__}")
    if x_TD.dim() != 2 or x_TD.shape[1] != dim:
        raise ValueError(f"x must have shape (T, D={dim}), got {tuple(x_TD.shape)}")
    if not x_TD.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got dtype {x_TD.dtype}")
    if not values:
        return
    # a NaN would otherwise pass silently through topk and pick arbitrary experts
    if torch.compiler.is_compiling():  # a traced graph cannot branch on a value, nor format a symbolic shape
        torch._assert_async(torch.isfinite(x_TD).all(), "x must be finite: found NaN or Inf")
        return
    what = f"x must be finite: found NaN or Inf in a tensor of shape {tuple(x_TD.shape)}"
    if not host_check:
        torch._assert_async(torch.isfinite(x_TD).all(), what)
    elif x_TD.numel() and not bool(torch.isfinite(x_TD).all()):  # host sync
        raise ValueError(what)


def _all_finite(t: Tensor) -> bool:
    """Whether every value of ``t`` is finite, with one reduction and one host read: a NaN or an
    Inf anywhere makes the sum non-finite. Only a non-finite sum (or finite values whose sum
    overflows) takes the elementwise check."""
    return math.isfinite(float(t.detach().sum())) or bool(torch.isfinite(t).all())


def check_logits(logits_TE: Tensor, x_TD: Tensor, *, host_check: bool = True) -> None:
    """Raise ValueError unless the router logits of ``x_TD`` are finite.

    A NaN would otherwise pass silently through topk and pick arbitrary experts. Any NaN or
    Inf in x makes its row of logits non-finite, so checking the logits rather than x costs
    the same one host read (on T*E values instead of T*D) and also catches finite x so large
    that its fp32 logits overflow (|x| near 1e38), which would give NaN gates.

    ``host_check=False`` checks without a host sync (``torch._assert_async``: a RuntimeError
    on CPU, a device-side assert on CUDA) for callers that promise none."""
    if torch.compiler.is_compiling():  # a traced graph cannot branch on a value, nor format a symbolic shape
        what = "x must be finite: found NaN or Inf in x or in its fp32 router logits"
        torch._assert_async(torch.isfinite(logits_TE).all(), what)
        return
    shape = tuple(x_TD.shape)
    if not host_check:
        what = f"x must be finite: found NaN or Inf in x of shape {shape} or in its fp32 router logits"
        torch._assert_async(torch.isfinite(logits_TE).all(), what)
    elif logits_TE.numel() and not _all_finite(logits_TE):  # host sync
        if not bool(torch.isfinite(x_TD).all()):  # only on the way to the error
            raise ValueError(f"x must be finite: found NaN or Inf in a tensor of shape {shape}")
        raise ValueError(
            f"x must be small enough for fp32 router logits: x of shape {shape} is finite, but "
            f"x @ weight.T overflows fp32 (largest |x| = {float(x_TD.abs().max()):.3g}) "
            "or the router weight holds NaN or Inf"
        )


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
    counts_E = bincount(e_N, num_experts)
    start_E = torch.cumsum(counts_E, 0) - counts_E
    rank = torch.arange(n, device=e_N.device) - start_E[by_expert.values]
    keep_N = torch.empty(n, dtype=torch.bool, device=e_N.device)
    cap = capacity[by_expert.values] if isinstance(capacity, Tensor) else capacity
    keep_N[slot_sorted] = rank < cap
    return keep_N.view_as(expert_idx_TK)


class GatedRouter(nn.Module):
    """What every router holds: its config and a gate weight (E, D), ``logits = x @ weight.T``."""

    def __init__(self, config: RouterConfig) -> None:
        if not isinstance(config, RouterConfig):  # e.g. an MoEConfig, which has some of its fields
            raise ValueError(
                f"config must be a moe.routing.RouterConfig (MoEConfig.router_config() gives one), "
                f"got {type(config).__name__}"
            )
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.dim))  # (E, D)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)

    def logits(self, x_TD: Tensor, *, host_check: bool = True) -> Tensor:
        """Checked input (T, D) -> checked fp32 logits (T, E) (``host_check``: see `check_logits`)."""
        check_tokens(x_TD, self.config.dim, values=False)
        logits_TE = gate_logits(x_TD, self.weight)
        check_logits(logits_TE, x_TD, host_check=host_check)
        return logits_TE

    def extra_repr(self) -> str:
        cfg = self.config
        return f"dim={cfg.dim}, num_experts={cfg.num_experts}, top_k={cfg.top_k}"
