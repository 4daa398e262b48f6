"""Router configuration: data only (no device, no process group)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Literal

__all__ = ["RouterConfig", "ROUTER_KINDS", "check_bool", "check_choice", "check_float", "check_int"]

ROUTER_KINDS = ("base", "topk", "sinkhorn", "expert_choice")


# Field checks for the config dataclasses: a field of the wrong type would otherwise pass a
# comparison (True >= 1, 1.5 <= 4) and fail much later, or never (a truthy string as a bool).
# numpy integers and floats count (they register with `numbers`); bools are not numbers here.
def _or_none(none_ok: bool) -> str:
    return "None or " if none_ok else ""


def check_int(name: str, value, low: int, high: int | None = None, *, none_ok: bool = False) -> None:
    """Raise ValueError unless ``value`` is an int (not a bool) in [low, high] (or None if ``none_ok``)."""
    if value is None and none_ok:
        return
    is_int = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not (is_int and value >= low and (high is None or value <= high)):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {_or_none(none_ok)}an int {span}, got {value!r}")


def check_float(name: str, value, low: float, *, strict: bool = False, none_ok: bool = False) -> None:
    """Raise ValueError unless ``value`` is a finite real number (not a bool) >= low (> low if
    ``strict``), or None if ``none_ok``."""
    if value is None and none_ok:
        return
    is_real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (is_real and math.isfinite(value) and (value > low if strict else value >= low)):
        raise ValueError(
            f"{name} must be {_or_none(none_ok)}a finite number {'>' if strict else '>='} {low}, got {value!r}"
        )


def check_bool(name: str, value) -> None:
    """Raise ValueError unless ``value`` is True or False (a truthy string is not)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    """Raise ValueError unless ``value`` is one of the strings ``choices``."""
    if not (isinstance(value, str) and value in choices):
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


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
    # global BASE by prices (expert parallelism): what one more round of collectives costs, as
    # the bytes a rank receives in the time of its latency (e.g. 50 us at 25 GB/s: 1.25e6); the
    # solver's pair rounds run only where they cost less at this price. 0: bytes alone
    base_round_bytes: float = 0.0

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        check_choice("kind", self.kind, ROUTER_KINDS)
        check_int("dim", self.dim, 1)
        check_int("num_experts", self.num_experts, 1)
        check_int("top_k", self.top_k, 1, self.num_experts)
        check_choice("score_func", self.score_func, ("softmax", "sigmoid"))
        check_bool("renormalize", self.renormalize)
        check_int("n_groups", self.n_groups, 1)
        need(
            self.num_experts % self.n_groups == 0,
            f"n_groups must divide num_experts={self.num_experts}, got {self.n_groups}",
        )
        check_int("topk_groups", self.topk_groups, 1, self.n_groups)
        need(
            self.top_k <= self.topk_groups * (self.num_experts // self.n_groups),
            f"top_k={self.top_k} exceeds the experts reachable in topk_groups={self.topk_groups} groups",
        )
        check_float("bias_update_rate", self.bias_update_rate, 0)
        check_float("capacity_factor", self.capacity_factor, 0, strict=True, none_ok=True)
        for name in ("aux_loss_coef", "seq_aux_loss_coef", "z_loss_coef"):
            check_float(name, getattr(self, name), 0)
        check_int("sinkhorn_iters", self.sinkhorn_iters, 1)
        check_float("sinkhorn_temperature", self.sinkhorn_temperature, 0, strict=True)
        check_int("base_max_iters", self.base_max_iters, 0, none_ok=True)
        check_choice("base_solver", self.base_solver, ("exact", "approx"))
        check_choice("base_extras", self.base_extras, ("best", "lowest"))
        check_float("base_round_bytes", self.base_round_bytes, 0)
