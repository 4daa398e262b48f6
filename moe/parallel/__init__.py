"""Expert parallelism over torch.distributed: collectives, the dispatcher, `parallelize_moe`.

Parallelism is applied from outside the layer; nothing here holds a process-group global.
"""

from .all_to_all import all_gather_rows, all_to_all, reduce_scatter_rows
from .dispatch import DispatchInfo, PeerFailedError, combine, dispatch
from .expert_parallel import ExpertParallel, GroupBalance, parallelize_moe, reduce_gradients

__all__ = [
    "DispatchInfo",
    "ExpertParallel",
    "GroupBalance",
    "PeerFailedError",
    "all_gather_rows",
    "all_to_all",
    "combine",
    "dispatch",
    "parallelize_moe",
    "reduce_gradients",
    "reduce_scatter_rows",
]
