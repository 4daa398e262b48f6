"""Expert parallelism over torch.distributed: collectives and (to come) the dispatcher.

Parallelism is applied from outside the layer; nothing here holds a process-group global.
"""

from .all_to_all import all_to_all
from .dispatch import DispatchInfo, combine, dispatch

__all__ = ["DispatchInfo", "all_to_all", "combine", "dispatch"]
