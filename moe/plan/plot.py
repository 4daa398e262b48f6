"""PNG of the memory per rank by component for some plans (matplotlib, Agg backend)."""

from __future__ import annotations

import textwrap

from .memory import COMPONENTS, USABLE_FRACTION

__all__ = ["plot_memory"]


def plot_memory(plans, hbm_bytes: int, path: str, title: str = "") -> None:
    """Stacked bars of the busiest rank's bytes by component, one bar per plan, the HBM and its
    usable part as lines."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("the memory plot needs matplotlib: pip install 'moe[bench]'") from e
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(plans) + 2), 6.0))
    xs = list(range(len(plans)))
    bottom = [0.0] * len(plans)
    for comp in COMPONENTS:
        vals = [p.memory[comp] / 2**30 for p in plans]
        if any(vals):
            ax.bar(xs, vals, bottom=bottom, label=comp)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.axhline(hbm_bytes / 2**30, color="black", lw=1, label="HBM")
    ax.axhline(USABLE_FRACTION * hbm_bytes / 2**30, color="black", lw=1, ls="--", label=f"{USABLE_FRACTION:.0%} usable")
    labels = [p.layout.short().replace("schedule=interleaved_1f1b", "interleaved").replace(",", "\n") for p in plans]
    ax.set_xticks(xs, labels, fontsize=6)
    ax.set_ylabel("GiB on the busiest rank")
    ax.set_title(textwrap.fill(title, 90), fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
