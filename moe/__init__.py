"""Mixture-of-Experts layers for PyTorch."""

from .config import MoEConfig
from .layer import MoE, aux_loss, release_work_buffers
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
    "release_work_buffers",
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
