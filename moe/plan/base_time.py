"""Time of one global-BASE solve by prices (`moe.parallel.price_base`, docs/parallel.md) for one
MoE layer and one micro-batch: the rounds of small collectives the ranks agree through, times a
collective's latency, plus the bytes each rank receives over the ep group's bandwidth.

Legend: W ep ranks, T tokens per rank, E experts, K experts per token.

What a solve sends (docs/benchmarks.md, "Global BASE by prices", measured on simulated ranks):
a header (one max of 8 + 3W float64), `PRICE_UPDATES` price updates (one sum of 66 E int32
each), the margin's counts (E + W int64) and rows (every rank receives all of them: a share
`margin` of the group's W T tokens, 1 + K + ceil(E / 2) int64 words each) and one certificate
check (W int64). Rounds: 4 + `PRICE_UPDATES`, 9-12 measured on random scores at W = 8 and 64.

Assumed, not measured on a cluster: each round costs `ROUND_LATENCY_S` (a small all-reduce or
all-gather across nodes with NCCL), the bytes move at the ep group's bandwidth, and the rank's
own passes over its (T, E) scores (histograms, the pick) read them `PASSES` times from HBM.
Early in training, scores with exact ties take up to 50 rounds and gather far more margin rows
(measured on a tiny model's first steps); this model is of the separated scores of a trained
router.
"""

from __future__ import annotations

from math import ceil

from ..models.llama import LlamaConfig
from .layout import Layout

__all__ = ["PRICE_UPDATES", "ROUND_LATENCY_S", "global_base_bytes", "global_base_s", "uses_global_base"]

PRICE_UPDATES = 8  # 12 rounds measured (9-12): these, plus header, margin counts and rows, certificate
ROUND_LATENCY_S = 50e-6
PASSES = 2 * PRICE_UPDATES + 4  # a histogram pass and a pick per update, the normalisation, the margin


def uses_global_base(cfg: LlamaConfig, lay: Layout) -> bool:
    """The trainer balances BASE layers over the whole ep group whenever ep > 1."""
    return cfg.moe is not None and cfg.moe.router == "base" and lay.ep > 1


def margin_share(experts: int) -> float:
    """Share of the tokens gathered at the margin: 0.34-0.47% at E = 64 and 1.15-1.52% at E = 256
    measured at W = 64 (the largest of them here); in between by E."""
    return 0.005 if experts <= 64 else 0.015 if experts >= 256 else 0.005 + 0.010 * (experts - 64) / 192


def global_base_bytes(cfg: LlamaConfig, lay: Layout, tokens: int) -> float:
    """Bytes one rank receives in one solve of one layer."""
    W, E, K = lay.ep, cfg.moe.num_experts, cfg.moe.top_k
    reduce = 2 * (W - 1) / W  # a ring all-reduce receives about twice the buffer
    header = reduce * (8 + 3 * W) * 8
    prices = PRICE_UPDATES * reduce * 66 * E * 4
    counts = reduce * (E + W) * 8
    rows = margin_share(E) * W * tokens * (1 + K + ceil(E / 2)) * 8
    certificate = reduce * W * 8
    return header + prices + counts + rows + certificate


def global_base_s(cfg: LlamaConfig, lay: Layout, tokens: int, bw: float, hbm_bw: float) -> float:
    """Seconds of one solve of one layer: rounds x latency, bytes over ``bw``, the local passes."""
    rounds = PRICE_UPDATES + 4
    local = PASSES * tokens * cfg.moe.num_experts * 4 / hbm_bw
    return rounds * ROUND_LATENCY_S + global_base_bytes(cfg, lay, tokens) / bw + local
