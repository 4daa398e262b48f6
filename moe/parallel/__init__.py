"""Parallelism over torch.distributed: collectives, the expert dispatcher, `parallelize_moe`, and
the Llama layouts (`parallelize_llama`, `pipeline_llama`) on one named DeviceMesh.

Parallelism is applied from outside the layer; nothing here holds a process-group global.
"""

from .all_to_all import all_gather_rows, all_to_all, reduce_scatter_rows
from .dispatch import DispatchInfo, PeerFailedError, combine, dispatch
from .expert_parallel import ExpertParallel, GroupBalance, parallelize_moe, reduce_gradients
from .layout import LlamaMesh
from .llama import LlamaParallel, llama_loss, loss_context, parallelize_llama, router_loss
from .pipeline import LlamaPipeline, pipeline_llama

__all__ = [
    "DispatchInfo",
    "ExpertParallel",
    "GroupBalance",
    "LlamaMesh",
    "LlamaParallel",
    "LlamaPipeline",
    "PeerFailedError",
    "all_gather_rows",
    "all_to_all",
    "combine",
    "dispatch",
    "llama_loss",
    "loss_context",
    "parallelize_llama",
    "pipeline_llama",
    "parallelize_moe",
    "reduce_gradients",
    "reduce_scatter_rows",
    "router_loss",
]
