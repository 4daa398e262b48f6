"""The trainer behind ``moe train``: data, the loop, checkpoints, metrics and plots, generation
and export. Entry points: `moe.cli` (the command) and `train` (the same from Python)."""

from .config import TrainConfig, model_config
from .loop import Trainer, train

__all__ = ["TrainConfig", "Trainer", "model_config", "train"]
