"""What a run records: per-step metrics (``metrics.jsonl``) and the plots redrawn from them.

Every line of ``metrics.jsonl`` is one optimiser step::

    {"step": 12, "loss": 3.1, "lm_loss": 3.08, "aux_loss": 0.02, "val_loss": 3.2 (eval steps only),
     "tokens_per_s": 5400.0, "lr": 0.0003, "grad_norm": 0.9, "skipped_steps": 0,
     "skipped": true (a step skipped for a NaN/inf loss or gradient norm only),
     "moe": {"1": {"max_load": 1.3, "cv": 0.2, "dropped": 0.0, "load": [0.3, 0.2, ...]}, ...}}

The line of step 0 holds only ``val_loss``, the validation loss before training.
``moe`` has one entry per MoE layer (by layer index): max load / mean load, the coefficient of
variation of the loads, the fraction of slots dropped, and each expert's share of the slots,
over the whole global batch of the step (every rank's tokens, every micro-batch: `LoadCounter`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..layer import MoE
from ..routing.common import in_backward

__all__ = ["LoadCounter", "MetricsLog", "moe_layer_keys", "plot_run"]


class LoadCounter:
    """Each MoE layer's routing over one step, summed over its forwards and over the ranks.

    Legend: L MoE layers of the whole model, E experts.

    A forward hook on every MoE layer of ``model`` (in training mode only, so evaluation does
    not count, and not in an activation-checkpointing re-run) adds the layer's per-expert
    counts, slots, dropped slots and (BASE) slots on one of their token's K best experts to one
    (L, E + 3) int64 tensor on the device, without a
    host read: the micro-batches of a pipeline step add up. `stats` then sums it over the ranks
    with ``sum_over_ranks`` (one all-reduce per step, after the step) and derives the balance,
    so the logged loads are those of the whole global batch, as in one process.

    ``keys`` names every MoE layer of the whole model (its index in ``model.layers``), the same
    on every rank; a pipeline rank fills the rows of the layers it holds and leaves the others 0.
    Slots are T*K (T for expert choice, whose dropped slots are the tokens no expert took).
    """

    def __init__(self, model: nn.Module, keys: list[str], num_experts: int, device, *, preferred: bool = False) -> None:
        self.keys, self.num_experts = list(keys), num_experts
        # per layer: E counts, slots, dropped slots, slots on one of their token's K best experts
        self.rows = torch.zeros(len(self.keys), num_experts + 3, dtype=torch.int64, device=device)
        self.preferred = preferred  # the routers report the last column (BASE; the same on every rank)
        for name, module in model.named_modules():
            if isinstance(module, MoE):
                module.register_forward_hook(self._hook(self.keys.index(_layer_key(name))))

    def _hook(self, row: int):
        def hook(module: MoE, args, out) -> None:
            res = module.last_routing
            if not module.training or res is None or in_backward():
                return
            idx = res.expert_idx
            if module.config.router == "expert_choice":  # idx (T, E): a token no expert took is dropped
                slots, dropped = idx.shape[0], (idx < 0).all(dim=1).sum()
            else:
                slots, dropped = idx.numel(), idx.numel() - res.counts.sum()
            r = self.rows[row]
            r[: self.num_experts] += res.counts.to(r.device)
            r[self.num_experts] += slots
            r[self.num_experts + 1] += dropped.to(r.device)
            if res.preferred is not None:
                r[self.num_experts + 2] += res.preferred.to(r.device)

        return hook

    def reset(self) -> None:
        self.rows.zero_()

    def stats(self, sum_over_ranks=None) -> dict[str, dict]:
        """The balance of each MoE layer over the step: max load / mean, coefficient of variation
        of the loads, fraction of slots dropped, each expert's share of the routed slots."""
        rows = self.rows if sum_over_ranks is None else sum_over_ranks(self.rows)
        rows = rows.double().cpu()
        out = {}
        for key, r in zip(self.keys, rows, strict=True):
            counts, slots, dropped = r[: self.num_experts], float(r[-3]), float(r[-2])
            mean = float(counts.mean())
            routed = float(counts.sum())
            out[key] = {
                "max_load": float(counts.max()) / mean if mean > 0 else 0.0,
                "cv": float(counts.std(unbiased=False)) / mean if mean > 0 else 0.0,
                "dropped": dropped / slots if slots else 0.0,
                "load": (counts / routed).tolist() if routed else [0.0] * self.num_experts,
            }
            if self.preferred:  # BASE: the share of slots on one of their token's K highest-scoring experts
                out[key]["preferred"] = float(r[-1]) / slots if slots else 0.0
        return out


def moe_layer_keys(model: nn.Module) -> list[str]:
    """The MoE layers of ``model`` by their index in ``model.layers``, in model order."""
    return [_layer_key(name) for name, module in model.named_modules() if isinstance(module, MoE)]


def _layer_key(name: str) -> str:
    return name.split(".")[1] if name.startswith("layers.") else name


def _rows(text: str) -> list[dict]:
    """The records of ``metrics.jsonl``; a line that does not parse (the half-written last line
    of a killed run) is left out."""
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


class MetricsLog:
    """Appends one JSON object per step to ``metrics.jsonl`` (a resumed run drops the lines
    past the step it resumes from, and a torn last line, so the file reads as one run), and
    passes each to ``mirror`` (the ``--log`` logger of `moe.train.loggers`) when there is one."""

    def __init__(self, run_dir: Path, resume_step: int | None = None, mirror=None) -> None:
        self.mirror = mirror
        self.path = Path(run_dir) / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            kept = [row for row in _rows(self.path.read_text()) if row["step"] <= resume_step]
            tmp = self.path.with_name(".metrics.jsonl.tmp")  # a kill while rewriting keeps the old file
            tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
            tmp.replace(self.path)
        self._file = self.path.open("a")

    def write(self, record: dict) -> None:
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as err:  # a write names no file: say which one
            raise OSError(err.errno, err.strerror, str(self.path)) from err
        if self.mirror is not None:
            self.mirror.write(record)

    def close(self) -> None:
        self._file.close()
        if self.mirror is not None:
            self.mirror.close()


def read_metrics(run_dir) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return _rows(path.read_text()) if path.exists() else []


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
