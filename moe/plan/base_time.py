"""Time of one global-BASE solve by prices (`moe.parallel.price_base`, docs/parallel.md) for one
MoE layer and one micro-batch: the rounds of small collectives the ranks agree through, times a
collective's latency, plus the bytes each rank receives over the ep group's bandwidth.

Legend: W ep ranks, T tokens per rank, E experts, K experts per token.

What a solve sends (docs/benchmarks.md, "Global BASE by prices", measured on simulated ranks):
a header (one max of 16 + 3W float64), `PRICE_UPDATES` price updates (one sum of 18 E + 33
int32 each: the histograms and the tokens by margin), the margin's counts (E + W + 33 int64;
where the updates stopped, their tokens by margin already widened its band to the rows it
needs, without a sum of its own) and rows (every rank receives all of them: a share
`margin_share` of the group's W T tokens, at least 2E, each with its K + `SENT` best
experts as uint8 (int16 beyond 256 experts) and their fp32 scores, without a key:
`price_rows.margin_row_bytes`) and two certificate checks (2W int64 each). Rounds: 6 +
`PRICE_UPDATES`, 10-17 measured on random scores at W = 64. With a round priced (the router
config's ``base_round_bytes``), each check's counts carry its first rows
(`price_rows.ahead_rows`): the check that sends rows takes one round, not two, where a
rank's rows fit (`certificate`); so do the margin's first counts where they do not ride on the
pair rounds' check (`margin`).

Assumed, not measured on a cluster: each round costs `ROUND_LATENCY_S` (a small all-reduce or
all-gather across nodes with NCCL), the bytes move at the ep group's bandwidth, and the rank's
own passes over its (T, E) scores (histograms, the pick) read them `PASSES` times from HBM.
This model is of separated (random) scores by default. A trained router's scores
(`STALLED`): the price updates stall, and the pair rounds follow where their E x E x 4 int32
counts (and their 4 more rounds, at the router config's ``base_round_bytes`` each: the
check after them carries the margin's counts) cost less
than the eighth of the tokens the margin would otherwise hold, the solver's own rule
(`price_prices.pair_rounds_pay`); docs/scale.md costs that case with the replay's measured
updates and margin. Every warm solve (the steady state modelled here) also carries each
rank's prices for its own tokens on its first update's sum (W x E int32 more in it: no round
of its own), and a chain of updates from their median runs beside the given prices' in the same
sums (`local_start_bytes`: costed as `PRICE_UPDATES` - 1 more counts),
and each rank solves its own tokens by the single-process solver
(`moe.routing.balanced.balanced_prices`), counted as `LOCAL_SOLVE_PASSES` passes over its
scores (its price updates, the normalisation, the pick, the fill and the check; its exchange
cycles are not counted), and two passes per update for its chain. A lower bound: on tie-heavy
scores, where the pick drops over 1% of the slots, up to three more rounds of updates run
(up to 2 x 24 + 4 passes).
"""

from __future__ import annotations

import torch

from ..models.llama import LlamaConfig
from ..parallel.price_base import CAPPED_SHARE
from ..parallel.price_certificate import AHEAD_FIRST
from ..parallel.price_prices import GAP_BINS, PAIR_ROUNDS, PAIR_TRY_ROUNDS, chain_values, pair_bytes, pair_rounds_pay
from ..parallel.price_rows import SENT, RowLayout, ahead_rows, margin_row_bytes
from ..routing.balanced.exact import MAX_ITERS
from .layout import Layout

__all__ = [
    "PRICE_UPDATES",
    "ROUND_LATENCY_S",
    "STALLED",
    "certificate",
    "global_base_bytes",
    "global_base_s",
    "header_bytes",
    "local_start_bytes",
    "margin",
    "pair_rounds",
    "rerun_s",
    "round_bytes",
    "uses_global_base",
]

PRICE_UPDATES = 8  # 6-10 measured at W = 64, K = 1 and 8, E = 64 and 256
STALLED = False  # the updates stall (a trained router's scores): the pair rounds run where they pay
ROUND_LATENCY_S = 50e-6
PASSES = 2 * PRICE_UPDATES + 4  # a histogram pass and a pick per update, the normalisation, the margin
LOCAL_SOLVE_PASSES = 2 * MAX_ITERS + 4  # a rank's cold solve of its own tokens: `balanced_prices`' updates and 4 more
FINGERPRINT_PASSES = 2  # `GroupBalance`'s fingerprint of the scores: their row and column sums


def uses_global_base(cfg: LlamaConfig, lay: Layout) -> bool:
    """The trainer balances BASE layers over the whole ep group whenever ep > 1."""
    return cfg.moe is not None and cfg.moe.router == "base" and lay.ep > 1


def margin_share(experts: int) -> float:
    """Share of the tokens gathered at the margin: 0.08-0.12% at E = 64 and 0.3-0.5% at E = 256
    measured at W = 64, K = 1 and 8; in between by E."""
    return 0.0012 if experts <= 64 else 0.005 if experts >= 256 else 0.0012 + 0.0038 * (experts - 64) / 192


def _row(cfg: LlamaConfig, lay: Layout, tokens: int) -> int:
    E, K = cfg.moe.num_experts, cfg.moe.top_k
    return margin_row_bytes(lay.ep * tokens, E, K, torch.float32)


def pair_rounds(cfg: LlamaConfig, lay: Layout, tokens: int) -> bool:
    """Whether a solve runs the pair rounds: the updates stall and they cost less than the
    eighth of the tokens at the margin they spare, their rounds priced at the router config's
    ``base_round_bytes`` (`price_base.price_balanced_assignment`)."""
    if not STALLED:
        return False
    spared = CAPPED_SHARE * lay.ep * tokens * _row(cfg, lay, tokens)
    return pair_rounds_pay(cfg.moe.num_experts, spared, cfg.moe.router_config().base_round_bytes)


def round_bytes(bw: float) -> float:
    """What a round costs in the bytes the link moves in its latency: the router config's
    ``base_round_bytes`` for an ep group of bandwidth ``bw`` (`moe plan` states it)."""
    return ROUND_LATENCY_S * bw


def _margin_rows(cfg: LlamaConfig, lay: Layout, tokens: int) -> float:
    """Rows at the margin, over the group: a share of the W T tokens, at least 2E."""
    share = margin_share(cfg.moe.num_experts)
    if STALLED and not pair_rounds(cfg, lay, tokens):  # stalled without the pair rounds: the cap's eighth
        share = max(share, CAPPED_SHARE)
    return max(share * lay.ep * tokens, 2 * cfg.moe.num_experts)


def margin(cfg: LlamaConfig, lay: Layout, tokens: int) -> tuple[int, float]:
    """(rounds, bytes a rank receives) of the margin: its counts (E + W + 33 int64, in a sum of
    their own or on the pair rounds' check) and its rows, 2 rounds. With a round priced
    (``base_round_bytes``) and no pair rounds, each rank's own counts (E + 34 int32) travel with
    its first rows in one gather of fixed size (`price_rows.ahead_rows`): 1 round where a
    rank's rows fit, padded to the rows it allows (at most a rank's tokens, and twice the
    group's margin rows: the updates' counts bound the band's tokens by the next bin's edge,
    `MarginStart.at_most`); where the group's
    rows are more than every rank can send ahead (the updates' counts of tokens by margin tell
    the solver so, `MarginStart.surely`), the sum and the gather."""
    W, E = lay.ep, cfg.moe.num_experts
    reduce = 2 * (W - 1) / W
    rows, row = _margin_rows(cfg, lay, tokens), _row(cfg, lay, tokens)
    price = cfg.moe.router_config().base_round_bytes
    head = 4 * (E + GAP_BINS + 2)
    # no more than a rank's tokens, nor than the band holds at most (its bin's edge: taken as twice its rows)
    ahead = 0 if pair_rounds(cfg, lay, tokens) else min(ahead_rows(price, W, row, head), tokens, int(2 * rows))
    if rows > W * ahead:  # none ahead, or the band surely holds more (the updates' counts say so)
        return 2, reduce * (E + W + GAP_BINS + 1) * 8 + rows * row
    return 1, W * (-(-head // row) + ahead) * row


def certificate(cfg: LlamaConfig, lay: Layout, tokens: int) -> tuple[int, float]:
    """(rounds, bytes a rank receives) of the certificate: two checks, the first finding rows.
    By bytes alone, each check's counts (2W int64) in a sum, then the first's rows (not
    counted: a few); 3 rounds. With a round priced (``base_round_bytes``), each check's counts
    and first rows in one gather of fixed size (`price_rows.ahead_rows`): 2 rounds where
    a rank's rows fit, taken as 1.25 times its margin rows (0.06-1.24 times measured in the
    first check of the replayed training scores at W = 8), with the first check's padding up
    to the rows it allows (at most `AHEAD_FIRST` times a rank's margin rows, and its tokens)
    and the second's up to the first's rows; the rows themselves are not counted in either
    mode."""
    W, E, K = lay.ep, cfg.moe.num_experts, cfg.moe.top_k
    price = cfg.moe.router_config().base_round_bytes
    reduce = 2 * (W - 1) / W
    row = RowLayout.of(W * tokens, E, K, torch.float32).width(min(E, K + SENT))
    ahead = ahead_rows(price, W, row, 8)
    if not ahead:
        return 3, 2 * reduce * 2 * W * 8
    first = 1.25 * _margin_rows(cfg, lay, tokens) / W
    sent = min(ahead, tokens, AHEAD_FIRST * _margin_rows(cfg, lay, tokens) / W)
    # the first check's rows themselves are left out, as by bytes alone (where they do not all come
    # ahead, the rest travel in a gather of their own, its round counted)
    return (2 if first <= sent else 3), W * row * (sent + 1 + min(ahead, first) + 1)


def local_start_bytes(W: int, E: int) -> float:
    """Bytes the local start adds to a warm solve: every rank's prices (W x E, float32 bits in
    int32) on the first update's sum, then its chain's counts beside the given prices' from
    the second update on (`PRICE_UPDATES` - 1 of them), all in all-reduces."""
    reduce = 2 * (W - 1) / W
    return reduce * (W * E * 4 + (PRICE_UPDATES - 1) * chain_values(E) * 4)


def header_bytes(W: int) -> float:
    """Bytes one rank receives in the header (its max of 16 + 3W float64, a ring all-reduce)."""
    return 2 * (W - 1) / W * (16 + 3 * W) * 8


def rerun_s(cfg: LlamaConfig, lay: Layout, tokens: int, bw: float, hbm_bw: float) -> float:
    """Seconds of an activation-checkpointing re-run of one layer: the scores' fingerprint and
    the header, which agrees that every rank takes the routes its forward kept (`GroupBalance`)."""
    local = FINGERPRINT_PASSES * tokens * cfg.moe.num_experts * 4 / hbm_bw
    return ROUND_LATENCY_S + header_bytes(lay.ep) / bw + local


def global_base_bytes(cfg: LlamaConfig, lay: Layout, tokens: int) -> float:
    """Bytes one rank receives in one solve of one layer."""
    W, E = lay.ep, cfg.moe.num_experts
    reduce = 2 * (W - 1) / W  # a ring all-reduce receives about twice the buffer
    header = header_bytes(W)
    prices = PRICE_UPDATES * reduce * chain_values(E) * 4
    pairs = pair_rounds(cfg, lay, tokens)
    pair_counts = reduce * (pair_bytes(E) + (E + 1) * 8) if pairs else 0  # and the max (one try)
    rows = margin(cfg, lay, tokens)[1]
    checks = certificate(cfg, lay, tokens)[1]
    return header + prices + pair_counts + rows + checks + local_start_bytes(W, E)


def global_base_s(cfg: LlamaConfig, lay: Layout, tokens: int, bw: float, hbm_bw: float) -> float:
    """Seconds of one solve of one layer: rounds x latency, bytes over ``bw``, the local passes."""
    pairs = pair_rounds(cfg, lay, tokens)
    rounds = PRICE_UPDATES + 1 + margin(cfg, lay, tokens)[0] + certificate(cfg, lay, tokens)[0]
    rounds += PAIR_TRY_ROUNDS if pairs else 0
    passes = PASSES + (PAIR_ROUNDS if pairs else 0) + LOCAL_SOLVE_PASSES + 2 * PRICE_UPDATES + FINGERPRINT_PASSES
    local = passes * tokens * cfg.moe.num_experts * 4 / hbm_bw
    return rounds * ROUND_LATENCY_S + global_base_bytes(cfg, lay, tokens) / bw + local
