"""What every router returns.

Legend: T tokens, E experts, K expert slots per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["RoutingResult", "RoutingStats", "routing_stats"]


class RoutingStats:
    """Balance and confidence of one routing decision, as plain floats:

    - ``max_load``: max_e counts[e] / mean_e counts[e]; 1.0 is perfect balance;
    - ``load_cv``: the coefficient of variation of the counts (std / mean);
    - ``dropped_fraction``: dropped slots / (T * K);
    - ``entropy``: the mean over tokens of the entropy (nats) of the router's probabilities.

    Built by `routing_stats` from detached tensors; the floats are computed, with their host
    reads, the first time one of them is read, so a step that never reads them makes no reads
    and almost no work for them. Only the counts and a scalar are kept, not the probabilities.
    """

    __slots__ = ("_counts_E", "_num_slots", "_dropped", "_entropy", "_values")

    def __init__(self, counts_E: Tensor, num_slots: int, dropped: int | Tensor, entropy: Tensor | float) -> None:
        self._counts_E, self._num_slots, self._dropped, self._entropy = counts_E, num_slots, dropped, entropy
        self._values: tuple[float, float, float, float] | None = None

    def _read(self) -> tuple[float, float, float, float]:
        if self._values is None:
            c = self._counts_E.double()
            mean = float(c.mean()) if c.numel() else 0.0
            max_load = float(c.max()) / mean if mean > 0 else 0.0
            cv = float(c.std(unbiased=False)) / mean if mean > 0 else 0.0
            dropped_fraction = float(self._dropped) / self._num_slots if self._num_slots else 0.0
            self._values = (max_load, cv, dropped_fraction, float(self._entropy))
            self._counts_E = self._dropped = self._entropy = None  # read once: nothing more to keep
        return self._values

    @property
    def max_load(self) -> float:
        return self._read()[0]

    @property
    def load_cv(self) -> float:
        return self._read()[1]

    @property
    def dropped_fraction(self) -> float:
        return self._read()[2]

    @property
    def entropy(self) -> float:
        return self._read()[3]

    def __repr__(self) -> str:
        max_load, cv, dropped, entropy = self._read()
        return f"RoutingStats(max_load={max_load}, load_cv={cv}, dropped_fraction={dropped}, entropy={entropy})"


def routing_stats(
    counts_E: Tensor, num_slots: int, dropped: int | Tensor | None, probs_TE: Tensor | None
) -> RoutingStats:
    """`RoutingStats` from per-expert counts, the number of slots T*K, the dropped slots (None:
    ``num_slots - counts_E.sum()``) and the router's probabilities. No host reads here; three
    small reductions for the entropy, so the probabilities need not be kept."""
    with torch.no_grad():
        counts_E = counts_E.detach().clone()  # the counts of this decision, whatever later changes them
        if dropped is None:
            dropped = num_slots - counts_E.sum()
        elif isinstance(dropped, Tensor):
            dropped = dropped.detach()
        entropy: Tensor | float = 0.0
        if probs_TE is not None and probs_TE.numel():
            p = probs_TE.detach()
            entropy = torch.special.entr(p if p.dtype == torch.float64 else p.float()).sum() / p.shape[0]
    return RoutingStats(counts_E, num_slots, dropped, entropy)


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
