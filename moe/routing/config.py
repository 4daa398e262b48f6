"""Router configuration: data only (no device, no process group)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["RouterConfig", "ROUTER_KINDS"]

ROUTER_KINDS = ("base", "topk", "sinkhorn", "expert_choice")


@dataclass(kw_only=True)
class RouterConfig:
    """Options shared by the router family; each router reads the fields that concern it."""

    dim: int  # D, model width of the tokens routed
    num_experts: int  # E
    top_k: int = 1  # K, experts per token (expert choice: average experts per token, sets capacity)
    kind: Literal["base", "topk", "sinkhorn", "expert_choice"] = "topk"

    # top-k family
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    renormalize: bool = True  # gates of the K chosen experts sum to one
    n_groups: int = 1  # group-limited routing (DeepSeek-V3): experts split into n_groups groups
    topk_groups: int = 1  # ... and each token may only use experts of its topk_groups best groups
    bias_update_rate: float = 0.0  # aux-loss-free balancing: per-expert selection bias step (0 = off)
    capacity_factor: float | None = None  # None = dropless; else capacity = ceil(cf * T * K / E)

    # losses (coefficients; 0 disables and returns a zero scalar)
    aux_loss_coef: float = 0.0  # Switch load-balancing loss over the batch
    seq_aux_loss_coef: float = 0.0  # the same, per sequence (needs seq_len at call time)
    z_loss_coef: float = 0.0  # router z-loss: mean squared logsumexp of the logits

    # Sinkhorn (S-BASE)
    sinkhorn_iters: int = 8
    sinkhorn_temperature: float = 1.0

    # BASE balanced assignment
    base_max_iters: int | None = None  # price updates; None: the solver's own default
    # "exact": balanced_assignment (optimal, reads back its exchange cycles); "approx":
    # balanced_assignment_approx (exact balance, near-optimal, no host sync)
    base_solver: Literal["exact", "approx"] = "exact"
    # which experts take the extra tokens when T * top_k % E > 0: "best" (chosen with the
    # assignment, for the best total) or "lowest" (experts 0 .. r-1: loads known from T alone,
    # which moe.parallel.parallelize_moe(static_splits=True) needs)
    base_extras: Literal["best", "lowest"] = "best"

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        need(self.kind in ROUTER_KINDS, f"kind must be one of {ROUTER_KINDS}, got {self.kind!r}")
        need(self.dim >= 1, f"dim must be >= 1, got {self.dim}")
        need(self.num_experts >= 1, f"num_experts must be >= 1, got {self.num_experts}")
        need(
            1 <= self.top_k <= self.num_experts,
            f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}",
        )
        need(
            self.score_func in ("softmax", "sigmoid"),
            f"score_func must be 'softmax' or 'sigmoid', got {self.score_func!r}",
        )
        need(
            self.n_groups >= 1 and self.num_experts % self.n_groups == 0,
            f"n_groups must divide num_experts={self.num_experts}, got {self.n_groups}",
        )
        need(
            1 <= self.topk_groups <= self.n_groups,
            f"topk_groups must be in [1, n_groups={self.n_groups}], got {self.topk_groups}",
        )
        need(
            self.top_k <= self.topk_groups * (self.num_experts // self.n_groups),
            f"top_k={self.top_k} exceeds the experts reachable in topk_groups={self.topk_groups} groups",
        )
        need(self.bias_update_rate >= 0, f"bias_update_rate must be >= 0, got {self.bias_update_rate}")
        need(
            self.capacity_factor is None or self.capacity_factor > 0,
            f"capacity_factor must be None (dropless) or > 0, got {self.capacity_factor}",
        )
        for name in ("aux_loss_coef", "seq_aux_loss_coef", "z_loss_coef"):
            need(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        need(self.sinkhorn_iters >= 1, f"sinkhorn_iters must be >= 1, got {self.sinkhorn_iters}")
        need(self.sinkhorn_temperature > 0, f"sinkhorn_temperature must be > 0, got {self.sinkhorn_temperature}")
        need(
            self.base_max_iters is None or self.base_max_iters >= 0,
            f"base_max_iters must be None or >= 0, got {self.base_max_iters}",
        )
        need(
            self.base_solver in ("exact", "approx"),
            f"base_solver must be 'exact' or 'approx', got {self.base_solver!r}",
        )
        need(
            self.base_extras in ("best", "lowest"),
            f"base_extras must be 'best' or 'lowest', got {self.base_extras!r}",
        )
