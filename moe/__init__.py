"""Mixture-of-Experts layers for PyTorch."""

from .routing import (
    BaseRouter,
    ExpertChoiceRouter,
    RouterConfig,
    RoutingResult,
    SinkhornRouter,
    TopKRouter,
    balanced_assignment,
    build_router,
)

__all__ = [
    "BaseRouter",
    "ExpertChoiceRouter",
    "RouterConfig",
    "RoutingResult",
    "SinkhornRouter",
    "TopKRouter",
    "balanced_assignment",
    "build_router",
]
__version__ = "0.1.0"
