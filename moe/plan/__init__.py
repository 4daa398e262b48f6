"""The memory and time model behind `moe plan`: which layouts of a `Llama` fit a cluster and
how fast a training step is expected to be (docs/scale.md)."""

from .layout import Layout, parse_layout
from .memory import TrainShape, memory, param_bytes, peak_memory
from .shards import rank_params

__all__ = ["Layout", "TrainShape", "memory", "param_bytes", "parse_layout", "peak_memory", "rank_params"]
