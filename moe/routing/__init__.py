"""Routers and balanced assignment: scores (T, E) -> RoutingResult.

This subpackage imports nothing else of ``moe`` and can be used and benchmarked on its own.
"""

from .balanced import (
    assignment_bound,
    assignment_score,
    balanced_assignment,
    balanced_assignment_approx,
    balanced_assignment_ref,
    expert_capacities,
    expert_capacities_list,
    release_work_buffers,
)
from .base import BaseRouter
from .config import ROUTER_KINDS, RouterConfig
from .expert_choice import ExpertChoiceRouter
from .losses import load_balancing_loss, router_z_loss, sequence_load_balancing_loss
from .result import RoutingResult, RoutingStats, routing_stats
from .sinkhorn import SinkhornRouter, sinkhorn
from .topk import TopKRouter

__all__ = [
    "ROUTER_KINDS",
    "BaseRouter",
    "ExpertChoiceRouter",
    "RouterConfig",
    "RoutingResult",
    "RoutingStats",
    "SinkhornRouter",
    "TopKRouter",
    "assignment_bound",
    "assignment_score",
    "balanced_assignment",
    "balanced_assignment_approx",
    "balanced_assignment_ref",
    "build_router",
    "expert_capacities",
    "expert_capacities_list",
    "load_balancing_loss",
    "release_work_buffers",
    "router_z_loss",
    "routing_stats",
    "sequence_load_balancing_loss",
    "sinkhorn",
]


def build_router(config: RouterConfig):
    """The router named by ``config.kind``, built from ``config``."""
    if not isinstance(config, RouterConfig):
        raise ValueError(f"config must be a moe.routing.RouterConfig, got {type(config).__name__}")
    return {"base": BaseRouter, "topk": TopKRouter, "sinkhorn": SinkhornRouter, "expert_choice": ExpertChoiceRouter}[
        config.kind
    ](config)
