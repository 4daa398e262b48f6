"""``python -m moe.models.llama``: the presets as a markdown table, parameter counts by formula."""

from __future__ import annotations

from .config import PRESETS


def _count(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.4g}{unit}"
    return str(n)


def presets_table() -> str:
    rows = [
        "| preset | layers | dim | heads / kv | MLP width | MoE layers | experts (top-k, width) | total | active |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, c in PRESETS.items():
        moe_layers = c.moe_layers
        if not moe_layers:
            where, experts = "none", "-"
        else:
            where = "all" if len(moe_layers) == c.n_layers else f"{len(moe_layers)} of {c.n_layers}"
            shared = f" + {c.moe.num_shared_experts} shared" if c.moe.num_shared_experts else ""
            experts = f"{c.moe.num_experts}{shared} (top-{c.moe.top_k}, {c.moe.hidden_dim}, {c.moe.router})"
        rows.append(
            f"| `{name}` | {c.n_layers} | {c.dim} | {c.n_heads} / {c.n_kv_heads} | {c.ffn_hidden_dim} | {where} | "
            f"{experts} | {_count(c.num_params())} | {_count(c.num_active_params())} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    print(presets_table())
