"""Parallelism over torch.distributed: collectives, the expert-parallel dispatchers (`FlatDispatcher`,
`HierarchicalDispatcher`, `ChunkedDispatcher`: `parallelize_moe` sets one as each layer's ``dispatcher``), and
the Llama layouts (`parallelize_llama`, `pipeline_llama`) on one named DeviceMesh.

Parallelism is applied from outside the layer; nothing here holds a process-group global.
"""

from .all_to_all import all_gather_rows, all_to_all, reduce_scatter_rows
from .chunked import ChunkedDispatcher
from .dispatch import DispatchInfo, PeerFailedError, combine, dispatch
from .expert_parallel import ExpertParallel, parallelize_moe, reduce_gradients
from .flat import FlatDispatcher
from .global_base import GroupBalance
from .hierarchical import HierarchicalDispatcher
from .hierarchical_chunked import ChunkedHierarchicalDispatcher
from .layout import LlamaMesh
from .llama import LlamaParallel, checkpoint_and_compile, llama_loss, loss_context, parallelize_llama, router_loss

__all__ = [
    "checkpoint_and_compile",
    "ChunkedDispatcher",
    "ChunkedHierarchicalDispatcher",
    "DispatchInfo",
    "ExpertParallel",
    "FlatDispatcher",
    "GroupBalance",
    "HierarchicalDispatcher",
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


def __getattr__(name: str):
    # pipelining imports torch._dynamo (about 1.5 s): loaded on first use, so a run without
    # pipeline stages does not pay for it
    if name in ("LlamaPipeline", "pipeline_llama"):
        from . import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
