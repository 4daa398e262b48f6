"""The planner's cost of global BASE by prices (moe/plan/base_time.py): what a solve sends against
what the simulated solver measured, and its share of the step at the large layouts."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

from moe.models.llama import LlamaConfig
from moe.parallel import price_certificate, price_prices, price_rows
from moe.parallel.price_base import CAPPED_SHARE, price_balanced_assignment
from moe.parallel.price_prices import PAIR_TRY_ROUNDS, pair_bytes
from moe.parallel.reduction import ShardReduce
from moe.plan import base_time
from moe.plan import time as plan_time
from moe.plan.hardware import GPUS
from moe.plan.layout import Layout
from moe.plan.memory import TrainShape
from moe.plan.time import step_time
from tests.routing.test_balanced import make_scores

DEEPSEEK = ("deepseek-v3-like", "h800", Layout(pp=16, ep=64, dp_shard=128, precision="fp8", reshard=False), 15360)
LARGE = ("llama2-moe-1.2t", "h200", Layout(tp=4, pp=16, ep=8, etp=True, dp_shard=16, reshard=False, chunks=4), 4096)


def _base(name: str) -> LlamaConfig:
    cfg = LlamaConfig.from_name(name)
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, router="base", router_options={}))


def _step(cfg, lay, gpu, seqs):
    return step_time(cfg, lay, TrainShape(seq_len=4096, global_batch_tokens=seqs * 4096), GPUS[gpu])


def test_bytes_match_the_simulated_solver():
    # W = 64, T = 4096, E = 64, K = 1, random scores: the warm calls received 0.096-0.128 MB
    # per rank (`python -m benchmarks.global_base --W 64 --T 4096 --E 64 --K 1 --scores random`,
    # counting an all-reduce once; the model counts a ring's twice)
    cfg = dataclasses.replace(_base("deepseek-v3-like"), moe=dataclasses.replace(_base("deepseek-v3-like").moe,
                              num_experts=64, top_k=1))  # fmt: skip
    got = base_time.global_base_bytes(cfg, Layout(ep=64, dp_shard=64), 4096)
    assert 0.096e6 <= got <= 2 * 0.128e6
    assert got <= 0.01 * 64 * 4096 * 64 * 4  # under 1% of the gathered path's scores


def test_stalled_updates_pay_the_pair_rounds_where_they_spare_bytes():
    """A trained router's scores (`STALLED`): at W = 64, T = 4096, E = 64 the pair rounds' counts
    (197 KB) cost less than an eighth of the tokens at the margin (655 KB), so a solve pays
    them and their rounds; at W = 8 they would cost more, and the margin holds that eighth."""
    cfg = dataclasses.replace(_base("deepseek-v3-like"), moe=dataclasses.replace(_base("deepseek-v3-like").moe,
                              num_experts=64, top_k=1))  # fmt: skip
    for ep, runs in ((64, True), (8, False)):
        lay = Layout(ep=ep, dp_shard=ep)
        plain = base_time.global_base_bytes(cfg, lay, 4096), base_time.global_base_s(cfg, lay, 4096, 1e9, 1e12)
        with mock.patch.object(base_time, "STALLED", True):
            assert base_time.pair_rounds(cfg, lay, 4096) == runs
            stalled = base_time.global_base_bytes(cfg, lay, 4096), base_time.global_base_s(cfg, lay, 4096, 1e9, 1e12)
        if runs:
            reduce = 2 * (ep - 1) / ep
            assert stalled[0] - plain[0] == pytest.approx(reduce * (pair_bytes(64) + 65 * 8))
            assert stalled[1] - plain[1] >= PAIR_TRY_ROUNDS * base_time.ROUND_LATENCY_S
        else:  # no pair rounds: the margin holds the cap's eighth, in the same rounds
            rows = CAPPED_SHARE * ep * 4096 * 20  # 20 bytes a row at K = 1
            assert stalled[0] - plain[0] == pytest.approx(
                rows - max(base_time.margin_share(64) * ep * 4096, 2 * 64) * 20
            )
            assert stalled[1] - plain[1] == pytest.approx((stalled[0] - plain[0]) / 1e9)


def test_a_warm_solve_carries_the_local_start_without_a_round_of_its_own():
    """deepseek-v3-like (E = 256, K = 8, ep = 64, T = 4096): the model adds what the solver's
    warm call sends for its local start, the ranks' prices (W x E int32) on the first update's
    sum, its chain's counts on `PRICE_UPDATES` - 1 more, and each rank's own solve, but no
    round. The solver (W = 8, E = 16) sends exactly those values on its first update, and no
    gather before its margin."""
    cfg, lay = _base("deepseek-v3-like"), Layout(ep=64, dp_shard=64)
    counts = price_prices.chain_values(256) * 4
    assert base_time.local_start_bytes(64, 256) == pytest.approx(2 * 63 / 64 * (64 * 256 * 4 + 7 * counts))
    with_it = base_time.global_base_bytes(cfg, lay, 4096), base_time.global_base_s(cfg, lay, 4096, 1e9, 1e12)
    with mock.patch.object(base_time, "local_start_bytes", lambda W, E: 0.0):
        without = base_time.global_base_bytes(cfg, lay, 4096), base_time.global_base_s(cfg, lay, 4096, 1e9, 1e12)
    assert with_it[0] - without[0] == pytest.approx(base_time.local_start_bytes(64, 256))
    rounds = (base_time.PRICE_UPDATES + 6) * base_time.ROUND_LATENCY_S  # no more than without it
    passes = (
        base_time.PASSES + base_time.LOCAL_SOLVE_PASSES + 2 * base_time.PRICE_UPDATES + base_time.FINGERPRINT_PASSES
    )
    assert with_it[1] == pytest.approx(rounds + with_it[0] / 1e9 + passes * 4096 * 256 * 4 / 1e12)
    x = make_scores(0, 8 * 512, 16, "gauss", torch.float32)
    parts = list(x.split(512))
    _, prices, _ = price_balanced_assignment(parts, 1, ShardReduce(8))
    for local_start in (True, False):
        _, _, stats = price_balanced_assignment(parts, 1, ShardReduce(8), prices=prices, local_start=local_start)
        first = stats.log[1]
        assert first[0] == "sum" and first[1] == price_prices.chain_values(16) + 8 * 16 * local_start
        assert first[2] == first[1] * 4  # int32, the prices as their float32 bits
        margin = next(i for i, (kind, n, _) in enumerate(stats.log) if kind == "sum" and n == 16 + 8 + 33)
        assert all(kind != "gather" for kind, _, _ in stats.log[:margin])


def test_only_base_over_an_ep_group_pays_it():
    name, gpu, lay, seqs = DEEPSEEK
    assert _step(LlamaConfig.from_name(name), lay, gpu, seqs).exposed_s["global_base"] == 0  # top-k
    assert _step(_base(name), dataclasses.replace(lay, ep=1), gpu, seqs).exposed_s["global_base"] == 0
    assert _step(_base(name), lay, gpu, seqs).exposed_s["global_base"] > 0


def test_a_recomputed_forward_takes_its_forwards_routes():
    """Activation checkpointing's re-run of a layer takes the routes its forward kept
    (`GroupBalance`): its header alone (`base_time.rerun_s`), not a second solve."""
    name, gpu, lay, seqs = LARGE
    once = _step(_base(name), lay, gpu, seqs)
    with mock.patch.object(plan_time, "rerun_s", lambda *args: 1.0):  # counts the re-runs
        counted = _step(_base(name), dataclasses.replace(lay, recompute=True), gpu, seqs)
    again = _step(_base(name), dataclasses.replace(lay, recompute=True), gpu, seqs)
    reruns = counted.exposed_s["global_base"] - once.exposed_s["global_base"]
    assert reruns > 0 and reruns == pytest.approx(round(reruns), abs=1e-6)
    assert once.exposed_s["global_base"] / reruns > 10 * base_time.ROUND_LATENCY_S  # a solve: many rounds more
    added = again.exposed_s["global_base"] - once.exposed_s["global_base"]
    assert base_time.ROUND_LATENCY_S < added / reruns < 1.01 * base_time.ROUND_LATENCY_S  # a round, a few KB, 2 passes
    extra = again.bytes_per_rank["global_base"] - once.bytes_per_rank["global_base"]
    assert extra == pytest.approx(reruns * base_time.header_bytes(lay.ep), rel=1e-9)


@pytest.mark.parametrize("case", [DEEPSEEK, LARGE], ids=["deepseek-v3-like", "llama2-moe-1.2t"])
def test_share_of_the_step_at_the_large_layouts(case):
    name, gpu, lay, seqs = case
    t = _step(_base(name), lay, gpu, seqs)
    assert 0 < t.exposed_s["global_base"] < 0.03 * t.step_s  # docs/scale.md states the shares


def test_a_round_priced_in_bytes_keeps_the_pair_rounds_off_a_small_group():
    """llama2-moe-1.2t (ep = 8), a trained router's stalled updates (7 of them, the margin at
    2.6% after the pair rounds): weighed by bytes alone the pair rounds run (their counts cost
    less than the margin's eighth) and global BASE costs over 3% of the step. With the router
    config's ``base_round_bytes`` at 50 us x 25 GB/s, the solver's own rule finds their five
    rounds dearer than the bytes they spare: they do not run, and the share falls under 3%."""
    name, gpu, lay, seqs = LARGE
    shares = {}
    for round_bytes in (0.0, 50e-6 * 25e9):
        cfg = _base(name)
        priced = dataclasses.replace(cfg.moe, router_options={"base_round_bytes": round_bytes})
        cfg = dataclasses.replace(cfg, moe=priced)
        with (
            mock.patch.object(base_time, "STALLED", True),
            mock.patch.object(base_time, "margin_share", lambda e: 0.026),
            mock.patch.object(base_time, "PRICE_UPDATES", 7),
        ):
            runs = base_time.pair_rounds(cfg, lay, 4096)
            t = _step(cfg, lay, gpu, seqs)
        shares[round_bytes] = (runs, t.exposed_s["global_base"] / t.step_s)
    (runs_free, share_free), (runs_priced, share_priced) = shares.values()
    assert runs_free and not runs_priced
    assert share_free > 0.03 > share_priced, shares


def test_a_priced_round_sends_rows_with_their_counts():
    """With ``base_round_bytes`` set, the model counts the margin and the certificate as the
    solver runs them (`price_rows.ahead_rows`): at llama2-moe-1.2t (ep = 8, E = 24, K = 2) a
    rank's rows fit what the margin's first counts and a check send ahead, so the margin takes
    1 round, not 2, and the certificate 2, not 3, for their padding's bytes; at the
    deepseek-v3-like layout (ep = 64, K = 8) stalled with a margin of 15% they do not fit: the
    margin sends none ahead (its band surely holds more), 2 rounds, and the certificate takes 3
    and pays its padding. Bytes alone: the counts' sums and the rows."""
    for case, fits in ((LARGE, True), (DEEPSEEK, False)):
        name, gpu, lay, seqs = case
        cfg = _base(name)
        priced = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, router_options={"base_round_bytes": 1.25e6}))
        with (
            mock.patch.object(base_time, "STALLED", True),
            mock.patch.object(base_time, "margin_share", lambda e: 0.15),
        ):
            free, paid = base_time.certificate(cfg, lay, 4096), base_time.certificate(priced, lay, 4096)
            m_free, m_paid = base_time.margin(cfg, lay, 4096), base_time.margin(priced, lay, 4096)
            W, E, K = lay.ep, cfg.moe.num_experts, cfg.moe.top_k
            layout = price_rows.RowLayout.of(W * 4096, E, K, torch.float32)
            row, m_row = layout.width(min(E, K + price_rows.SENT)), layout.width(min(E, K + price_rows.SENT), False)
            ahead = price_rows.ahead_rows(1.25e6, W, row, 8)
            m_head = 4 * (E + price_prices.GAP_BINS + 2)
            m_ahead = price_rows.ahead_rows(1.25e6, W, m_row, m_head)
            rows = max(0.15 * W * 4096, 2 * E)  # a share of 15% over the capped eighth (no pair rounds)
            base = [base_time.global_base_s(c, lay, 4096, 1e12, 1e15) for c in (cfg, priced)]
            pairs = PAIR_TRY_ROUNDS * (base_time.pair_rounds(priced, lay, 4096) - base_time.pair_rounds(cfg, lay, 4096))
        first = 1.25 * rows / W  # the certificate's first check, a rank's rows
        assert free == (3, 2 * 2 * (W - 1) / W * 2 * W * 8)
        assert paid[0] == (2 if fits else 3) and (first <= min(ahead, 2 * rows / W)) == fits, (name, ahead, first)
        sent = min(ahead, 4096, price_certificate.AHEAD_FIRST * rows / W)  # the first check's rows ahead
        assert paid[1] == W * row * (sent + 1 + min(ahead, first) + 1)  # the rows left out, as by bytes alone
        assert paid[1] <= 2 * price_rows.AHEAD_SHARE * 1.25e6  # two checks, each within its share
        assert m_free[0] == 2 and m_paid[0] == (1 if fits else 2) and (rows / W <= m_ahead) == fits, (name, m_ahead)
        sent = W * (-(-m_head // m_row) + m_ahead) * m_row
        assert sent <= price_rows.AHEAD_SHARE * 1.25e6
        assert m_paid[1] == (sent if fits else m_free[1])  # the band surely holds more: none ahead
        # at a fast link the rounds' latency is what differs (at llama2-moe-1.2t the price keeps
        # the pair rounds off too)
        assert pairs == (-PAIR_TRY_ROUNDS if fits else 0)
        rounds = paid[0] - free[0] + m_paid[0] - m_free[0] + pairs
        assert base[1] - base[0] == pytest.approx(rounds * base_time.ROUND_LATENCY_S, abs=1e-6), name
        # separated scores (the default model): a thin margin, no more rows ahead than twice its rows
        thin = max(base_time.margin_share(E) * W * 4096, 2 * E)
        assert base_time.margin(priced, lay, 4096) == (
            1,
            W * (-(-m_head // m_row) + min(m_ahead, int(2 * thin))) * m_row,
        )


def test_the_plan_states_the_price_of_a_round_on_the_ep_groups_link():
    """`moe plan` gives the ``base_round_bytes`` a round costs on the ep group's link (50 us at
    the h200's 50 GB/s between nodes, at 90%: 2.25e6 bytes) where the model balances BASE over
    the group, and 0 where it does not."""
    name, gpu, lay, seqs = LARGE
    assert _step(_base(name), lay, gpu, seqs).base_round_bytes == pytest.approx(50e-6 * 50e9 * 0.9)
    assert _step(LlamaConfig.from_name(name), lay, gpu, seqs).base_round_bytes == 0  # top-k: no solve
