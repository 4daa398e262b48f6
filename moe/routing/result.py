"""What every router returns.

Legend: T tokens, E experts, K expert slots per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["RoutingResult", "RoutingStats", "routing_stats"]


@dataclass(frozen=True)
class RoutingStats:
    """Balance and confidence of one routing decision (plain floats, computed without autograd)."""

    max_load: float  # max_e counts[e] / mean_e counts[e]; 1.0 is perfect balance
    load_cv: float  # coefficient of variation of counts (std / mean)
    dropped_fraction: float  # dropped slots / (T * K)
    entropy: float  # mean over tokens of the entropy (nats) of the router's probabilities


def routing_stats(counts_E: Tensor, num_slots: int, dropped: int | Tensor, probs_TE: Tensor | None) -> RoutingStats:
    """Build `RoutingStats` from per-expert counts, the number of slots T*K and dropped slots."""
    with torch.no_grad():
        c = counts_E.double()
        mean = c.mean() if c.numel() else c.new_zeros(())
        max_load = float(c.max() / mean) if c.numel() and mean > 0 else 0.0
        cv = float(c.std(unbiased=False) / mean) if c.numel() and mean > 0 else 0.0
        dropped_fraction = float(dropped) / num_slots if num_slots else 0.0
        if probs_TE is None or probs_TE.numel() == 0:
            entropy = 0.0
        else:
            p = probs_TE.detach().double()
            entropy = float(-(p * p.clamp(min=1e-30).log()).sum(-1).mean())
    return RoutingStats(max_load=max_load, load_cv=cv, dropped_fraction=dropped_fraction, entropy=entropy)


@dataclass(frozen=True)
class RoutingResult:
    """The routing of T tokens to K expert slots each.

    Shapes and dtypes are checked on construction; a slot that was dropped has
    ``expert_idx == -1`` and ``weights == 0``.
    """

    expert_idx: Tensor  # (T, K) int64, expert of each slot in [0, E) or -1 if dropped
    weights: Tensor  # (T, K) floating, combine weight of each slot (the gate); 0 where dropped
    counts: Tensor  # (E,) int64, tokens routed to each expert (dropped slots excluded)
    aux_loss: Tensor = field(default_factory=lambda: torch.zeros(()))  # scalar load-balancing loss
    z_loss: Tensor = field(default_factory=lambda: torch.zeros(()))  # scalar router z-loss
    # balance metrics, see `RoutingStats`; None where they would need host reads (sync-free BASE, torch.compile)
    stats: RoutingStats | None = None
    # BASE in training: how many slots went to one of their token's K highest-scoring experts
    # (a scalar int64 on the device, read by the trainer's metrics once a step); None elsewhere
    preferred: Tensor | None = None

    def __post_init__(self) -> None:
        idx, w, c = self.expert_idx, self.weights, self.counts
        if idx.dim() != 2 or idx.dtype != torch.int64:
            raise ValueError(
                f"expert_idx must be a (T, K) int64 tensor, got shape {tuple(idx.shape)} dtype {idx.dtype}"
            )
        if w.shape != idx.shape or not w.is_floating_point():
            raise ValueError(
                f"weights must be a floating (T, K) tensor matching expert_idx {tuple(idx.shape)}, "
                f"got shape {tuple(w.shape)} dtype {w.dtype}"
            )
        if c.dim() != 1 or c.dtype != torch.int64:
            raise ValueError(f"counts must be an (E,) int64 tensor, got shape {tuple(c.shape)} dtype {c.dtype}")
        for name in ("aux_loss", "z_loss"):
            v = getattr(self, name)
            if not isinstance(v, Tensor) or v.dim() != 0:
                raise ValueError(f"{name} must be a scalar tensor, got {v!r}")

    @property
    def num_tokens(self) -> int:
        return self.expert_idx.shape[0]

    @property
    def top_k(self) -> int:
        return self.expert_idx.shape[1]

    @property
    def num_experts(self) -> int:
        return self.counts.shape[0]
