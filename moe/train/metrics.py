"""What a run records: per-step metrics (``metrics.jsonl``) and the plots redrawn from them.

Every line of ``metrics.jsonl`` is one optimiser step::

    {"step": 12, "loss": 3.1, "lm_loss": 3.08, "aux_loss": 0.02, "val_loss": 3.2 (eval steps only),
     "tokens_per_s": 5400.0, "lr": 0.0003, "grad_norm": 0.9,
     "moe": {"1": {"max_load": 1.3, "cv": 0.2, "dropped": 0.0, "load": [0.3, 0.2, ...]}, ...}}

The line of step 0 holds only ``val_loss``, the validation loss before training.
``moe`` has one entry per MoE layer (by layer index): max load / mean load, the coefficient of
variation of the loads, the fraction of slots dropped, and each expert's share of the slots.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..layer import MoE

__all__ = ["MetricsLog", "moe_layer_stats", "plot_run"]


def moe_layer_stats(model: nn.Module) -> dict[str, dict]:
    """Balance of each MoE layer's last routing, keyed by the layer's index in ``model.layers``."""
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, MoE) or module.last_routing is None:
            continue
        res = module.last_routing
        key = name.split(".")[1] if name.startswith("layers.") else name
        counts = res.counts.detach().double()
        load = (counts / counts.sum().clamp(min=1)).tolist()
        s = res.stats
        if s is None:  # routers that skip stats (no host read): compute them here
            mean = counts.mean().clamp(min=1e-12)
            s_max, s_cv = float(counts.max() / mean), float(counts.std(unbiased=False) / mean)
            dropped = 1.0 - float(counts.sum()) / max(res.expert_idx.numel(), 1)
        else:
            s_max, s_cv, dropped = s.max_load, s.load_cv, s.dropped_fraction
        out[key] = {"max_load": s_max, "cv": s_cv, "dropped": dropped, "load": load}
    return out


class MetricsLog:
    """Appends one JSON object per step to ``metrics.jsonl`` (a resumed run drops the lines
    past the step it resumes from, so the file reads as one run)."""

    def __init__(self, run_dir: Path, resume_step: int | None = None) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self._file = self.path.open("a")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(run_dir) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def plot_run(run_dir) -> list[Path]:
    """Redraw ``loss.png`` (training and validation loss) and ``expert_load.png`` (one heatmap
    per MoE layer: expert share of the slots over steps) from ``metrics.jsonl``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        return []
    written = []
    fig, ax = plt.subplots(figsize=(7, 4))
    train_rows = [r for r in rows if "loss" in r]
    ax.plot([r["step"] for r in train_rows], [r["loss"] for r in train_rows], label="train loss (lm + aux)", lw=1)
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation loss", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "loss.png.tmp.png", dpi=110)
    plt.close(fig)
    (run_dir / "loss.png.tmp.png").replace(run_dir / "loss.png")  # readers never see half a file
    written.append(run_dir / "loss.png")

    layers = sorted(rows[-1].get("moe", {}), key=lambda k: (len(k), k))
    rows = train_rows
    if layers:
        fig, axes = plt.subplots(len(layers), 1, figsize=(7, 1.6 + 1.4 * len(layers)), squeeze=False)
        for ax, layer in zip(axes[:, 0], layers, strict=True):
            steps = [r["step"] for r in rows if layer in r.get("moe", {})]
            load = torch.tensor([r["moe"][layer]["load"] for r in rows if layer in r.get("moe", {})])
            extent = (steps[0] - 0.5, steps[-1] + 0.5, load.shape[1] - 0.5, -0.5)
            im = ax.imshow(load.T.numpy(), aspect="auto", cmap="viridis", extent=extent, interpolation="nearest")
            ax.set_ylabel(f"layer {layer}\nexpert")
            fig.colorbar(im, ax=ax, label="share of slots")
        axes[-1, 0].set_xlabel("step")
        fig.tight_layout()
        fig.savefig(run_dir / "expert_load.png.tmp.png", dpi=110)
        plt.close(fig)
        (run_dir / "expert_load.png.tmp.png").replace(run_dir / "expert_load.png")
        written.append(run_dir / "expert_load.png")
    return written
