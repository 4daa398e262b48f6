"""Expert parallelism over torch.distributed: collectives and (to come) the dispatcher.

Parallelism is applied from outside the layer; nothing here holds a process-group global.
"""

from .all_to_all import all_to_all

__all__ = ["all_to_all"]
