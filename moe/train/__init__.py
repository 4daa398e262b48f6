"""The trainer behind ``moe train``: data, the loop, checkpoints, metrics and plots, generation
and export. Entry points: `moe.cli` (the command) and `train` (the same from Python)."""

from .config import TrainConfig, model_config

__all__ = ["TrainConfig", "Trainer", "model_config", "train"]


def __getattr__(name: str):
    # the loop imports torch's pipelining (and with it torch._dynamo, about 1.5 s): loaded on
    # first use, so `moe train --help`, argument checks and the --nproc launcher start quickly
    if name in ("Trainer", "train"):
        from . import loop

        return getattr(loop, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
