"""Mixture-of-Experts layers for PyTorch."""

from .config import MoEConfig
from .layer import MoE, aux_loss
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
    "MoE",
    "MoEConfig",
    "aux_loss",
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
