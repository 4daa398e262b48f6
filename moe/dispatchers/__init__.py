"""How one MoE layer's routed tokens reach its experts and come back: the layer's dispatcher.

`MoE.forward` routes, then calls ``layer.dispatcher(layer, x_TD, routing, gates_TK)`` for the
steps in between (permute -> [exchange] -> experts -> [exchange back] -> unpermute), then mixes
in the residual and the shared experts. Each way of dispatching is one class in one file: here
the one-device ones; the expert-parallel ones live in `moe.parallel`, whose `parallelize_moe`
swaps them in from outside.
"""

from .base import Dispatcher
from .fused import FusedDispatcher
from .local import LocalDispatcher

__all__ = ["Dispatcher", "FusedDispatcher", "LocalDispatcher", "for_config"]


def for_config(config) -> Dispatcher:
    """The one-device dispatcher a layer of ``config`` starts with (``config.fused`` picks)."""
    return FusedDispatcher() if config.fused else LocalDispatcher()
