"""Time of one global-BASE solve by prices (`moe.parallel.price_base`, docs/parallel.md) for one
MoE layer and one micro-batch: the rounds of small collectives the ranks agree through, times a
collective's latency, plus the bytes each rank receives over the ep group's bandwidth.

Legend: W ep ranks, T tokens per rank, E experts, K experts per token.

What a solve sends (docs/benchmarks.md, "Global BASE by prices", measured on simulated ranks):
a header (one max of 8 + 3W float64), `PRICE_UPDATES` price updates (one sum of 18 E int32
each), the margin's counts (E + W + 33 int64) and rows (every rank receives all of them: a
share `margin_share` of the group's W T tokens, at least 2E, each with its K + `SENT` best
experts as uint8 (int16 beyond 256 experts) and their fp32 scores, without a key:
`_Layout.width` bytes) and two certificate checks (2W int64 each). Rounds: 6 +
`PRICE_UPDATES`, 10-17 measured on random scores at W = 64.

Assumed, not measured on a cluster: each round costs `ROUND_LATENCY_S` (a small all-reduce or
all-gather across nodes with NCCL), the bytes move at the ep group's bandwidth, and the rank's
own passes over its (T, E) scores (histograms, the pick) read them `PASSES` times from HBM.
This model is of separated (random) scores. A trained router's replayed scores take 8-25
rounds warm (a median of 14: the updates stop once they stall) and gather about a fifth of
the tokens at W = 64 (docs/scale.md costs that case).
"""

from __future__ import annotations

import torch

from ..models.llama import LlamaConfig
from ..parallel.price_base import SENT, _Layout
from .layout import Layout

__all__ = ["PRICE_UPDATES", "ROUND_LATENCY_S", "global_base_bytes", "global_base_s", "uses_global_base"]

PRICE_UPDATES = 8  # 6-10 measured at W = 64, K = 1 and 8, E = 64 and 256
ROUND_LATENCY_S = 50e-6
PASSES = 2 * PRICE_UPDATES + 4  # a histogram pass and a pick per update, the normalisation, the margin


def uses_global_base(cfg: LlamaConfig, lay: Layout) -> bool:
    """The trainer balances BASE layers over the whole ep group whenever ep > 1."""
    return cfg.moe is not None and cfg.moe.router == "base" and lay.ep > 1


def margin_share(experts: int) -> float:
    """Share of the tokens gathered at the margin: 0.08-0.12% at E = 64 and 0.3-0.5% at E = 256
    measured at W = 64, K = 1 and 8; in between by E."""
    return 0.0012 if experts <= 64 else 0.005 if experts >= 256 else 0.0012 + 0.0038 * (experts - 64) / 192


def global_base_bytes(cfg: LlamaConfig, lay: Layout, tokens: int) -> float:
    """Bytes one rank receives in one solve of one layer."""
    W, E, K = lay.ep, cfg.moe.num_experts, cfg.moe.top_k
    reduce = 2 * (W - 1) / W  # a ring all-reduce receives about twice the buffer
    header = reduce * (8 + 3 * W) * 8
    prices = PRICE_UPDATES * reduce * 18 * E * 4
    counts = reduce * (E + W + 33) * 8
    row = _Layout.of(W * tokens, E, K, torch.float32).width(min(E, K + SENT), keyed=False)
    rows = max(margin_share(E) * W * tokens, 2 * E) * row
    certificate = 2 * reduce * 2 * W * 8
    return header + prices + counts + rows + certificate


def global_base_s(cfg: LlamaConfig, lay: Layout, tokens: int, bw: float, hbm_bw: float) -> float:
    """Seconds of one solve of one layer: rounds x latency, bytes over ``bw``, the local passes."""
    rounds = PRICE_UPDATES + 6
    local = PASSES * tokens * cfg.moe.num_experts * 4 / hbm_bw
    return rounds * ROUND_LATENCY_S + global_base_bytes(cfg, lay, tokens) / bw + local
