"""``--log tensorboard|wandb``: the metrics.jsonl records, also sent to TensorBoard or W&B (the
optional extra ``log``), under the same keys: a nested key is joined with ``/``
(``moe/1/max_load``, ``moe/1/load/0``), ``skipped`` is 1, the step is the record's step.

TensorBoard event files go to ``<run>/tensorboard``; a resumed run purges the events past the
step it resumes from, as metrics.jsonl drops its lines. W&B writes to ``<run>/wandb``, offline
unless ``WANDB_API_KEY`` or ``WANDB_MODE`` says otherwise (nothing is sent by default), one W&B
run per run folder (its id kept in ``<run>/wandb/run_id``, so ``--resume`` continues it).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["LOGGERS", "MISSING", "open_logger", "scalars"]

LOGGERS = ("none", "tensorboard", "wandb")
MISSING = {  # the package each logger imports, for the command's check before anything runs
    "tensorboard": "tensorboard",
    "wandb": "wandb",
}


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a metrics record, nested keys joined with ``/``."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, name + "/"))
        elif isinstance(value, list):
            out.update(scalars(dict(enumerate(value)), name + "/"))
        elif isinstance(value, bool | int | float) and key != "step":
            out[name] = float(value)
    return out


class _TensorBoard:
    def __init__(self, run_dir: Path, config: dict, resume_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = None if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)

    def write(self, record: dict) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, global_step=record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, run_dir: Path, config: dict, resume_step: int | None) -> None:
        import uuid

        import wandb

        folder = run_dir / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / "run_id"
        if not id_file.is_file():
            id_file.write_text(uuid.uuid4().hex[:12] + "\n")
        online = os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE")
        self.run = wandb.init(
            dir=str(run_dir), project=os.environ.get("WANDB_PROJECT", "moe"), name=run_dir.name, config=config,
            id=id_file.read_text().strip(), resume="allow", mode=None if online else "offline",
            settings=wandb.Settings(console="off", silent=True),
        )  # fmt: skip

    def write(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


def open_logger(kind: str, run_dir: Path, config: dict, resume_step: int | None = None):
    """The logger of ``--log kind`` (None for ``none``): ``write(record)`` and ``close()``."""
    if kind == "none":
        return None
    if kind not in LOGGERS:
        raise ValueError(f"--log: expected one of {', '.join(LOGGERS)}, got {kind!r}")
    return (_TensorBoard if kind == "tensorboard" else _WandB)(Path(run_dir), config, resume_step)
