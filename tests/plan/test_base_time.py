"""The planner's cost of global BASE by prices (moe/plan/base_time.py): what a solve sends against
what the simulated solver measured, and its share of the step at the large layouts."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

from moe.models.llama import LlamaConfig
from moe.parallel import price_base, price_prices
from moe.parallel.price_base import CAPPED_SHARE, price_balanced_assignment
from moe.parallel.price_prices import PAIR_ROUNDS, pair_bytes
from moe.parallel.reduction import ShardReduce
from moe.plan import base_time
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
    # docs/benchmarks.md, "Rows as bytes": W = 64, T = 4096, E = 64, K = 1 received
    # 0.049-0.058 MB per rank (counting an all-reduce once; the model counts a ring's twice)
    cfg = dataclasses.replace(_base("deepseek-v3-like"), moe=dataclasses.replace(_base("deepseek-v3-like").moe,
                              num_experts=64, top_k=1))  # fmt: skip
    got = base_time.global_base_bytes(cfg, Layout(ep=64, dp_shard=64), 4096)
    assert 0.049e6 <= got <= 2 * 0.058e6
    assert got <= 0.01 * 64 * 4096 * 64 * 4  # under 1% of the gathered path's scores


def test_stalled_updates_pay_the_pair_rounds_where_they_spare_bytes():
    """A trained router's scores (`STALLED`): at W = 64, T = 4096, E = 64 the pair rounds' counts
    (197 KB) cost less than an eighth of the tokens at the margin (655 KB), so a solve pays
    them and their rounds, after the local start (its gather and 20 updates, 108 KB, cost less
    too: `restarts`); at W = 8 both would cost more (the local start 94 KB against 82 KB), and
    the margin holds that eighth."""
    cfg = dataclasses.replace(_base("deepseek-v3-like"), moe=dataclasses.replace(_base("deepseek-v3-like").moe,
                              num_experts=64, top_k=1))  # fmt: skip
    for ep, runs in ((64, True), (8, False)):
        lay = Layout(ep=ep, dp_shard=ep)
        plain = base_time.global_base_bytes(cfg, lay, 4096), base_time.global_base_s(cfg, lay, 4096, 1e9, 1e12)
        with mock.patch.object(base_time, "STALLED", True):
            assert base_time.pair_rounds(cfg, lay, 4096) == runs
            assert base_time.restarts(cfg, lay, 4096) == runs
            stalled = base_time.global_base_bytes(cfg, lay, 4096), base_time.global_base_s(cfg, lay, 4096, 1e9, 1e12)
        if runs:
            reduce = 2 * (ep - 1) / ep
            restart = ep * 64 * 4 + base_time.PRICE_UPDATES * reduce * 18 * 64 * 4
            assert stalled[0] - plain[0] == pytest.approx(reduce * (pair_bytes(64) + 65 * 8) + restart)
            rounds = PAIR_ROUNDS + 2 + 1 + base_time.PRICE_UPDATES
            assert stalled[1] - plain[1] >= rounds * base_time.ROUND_LATENCY_S
        else:  # no pair rounds: the margin holds the cap's eighth, in the same rounds
            rows = CAPPED_SHARE * ep * 4096 * 20  # 20 bytes a row at K = 1
            assert stalled[0] - plain[0] == pytest.approx(
                rows - max(base_time.margin_share(64) * ep * 4096, 2 * 64) * 20
            )
            assert stalled[1] - plain[1] == pytest.approx((stalled[0] - plain[0]) / 1e9)


def test_stalled_updates_at_256_experts_try_the_local_start():
    """deepseek-v3-like (E = 256, K = 8, ep = 64, T = 4096), stalled: the pair rounds (3.1 MB) cost
    more than the margin's eighth (1.8 MB), the local start's gather and 20 updates (434 KB) less, so
    a solve pays its gather, `PRICE_UPDATES` more updates and their rounds, and each rank's own
    cold solve; priced at 1.25e6 bytes a round, it does not run."""
    cfg, lay = _base("deepseek-v3-like"), Layout(ep=64, dp_shard=64)
    plain = base_time.global_base_bytes(cfg, lay, 4096), base_time.global_base_s(cfg, lay, 4096, 1e9, 1e12)
    with mock.patch.object(base_time, "STALLED", True):
        assert not base_time.pair_rounds(cfg, lay, 4096) and base_time.restarts(cfg, lay, 4096)
        stalled = base_time.global_base_bytes(cfg, lay, 4096), base_time.global_base_s(cfg, lay, 4096, 1e9, 1e12)
        priced = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, router_options={"base_round_bytes": 1.25e6}))
        assert not base_time.restarts(priced, lay, 4096)
    rows = (CAPPED_SHARE - base_time.margin_share(256)) * 64 * 4096 * 55  # K = 8: 55 bytes a row
    restart = 64 * 256 * 4 + base_time.PRICE_UPDATES * 2 * 63 / 64 * 18 * 256 * 4
    assert stalled[0] - plain[0] == pytest.approx(rows + restart)
    latency = (1 + base_time.PRICE_UPDATES) * base_time.ROUND_LATENCY_S
    passes = (base_time.LOCAL_SOLVE_PASSES + 2 * base_time.PRICE_UPDATES) * 4096 * 256 * 4 / 1e12
    assert stalled[1] - plain[1] == pytest.approx((stalled[0] - plain[0]) / 1e9 + latency + passes)


@pytest.mark.parametrize("tokens", [1024, 1536])
def test_the_planner_tries_the_local_start_where_the_solver_does(tokens):
    """W = 8, E = 16, K = 1, the pair rounds off: the local start's gather and 20 updates (23.6 KB)
    cost more than the margin's eighth at T = 1024 (20.5 KB) and less at T = 1536 (30.7 KB). The
    planner's `restarts` and a stalled warm call of the solver decide alike."""
    cfg = _base("deepseek-v3-like")
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, num_experts=16, top_k=1))
    with (
        mock.patch.object(base_time, "STALLED", True),
        mock.patch.object(base_time, "pair_rounds_pay", lambda *a: False),
    ):
        planned = base_time.restarts(cfg, Layout(ep=8, dp_shard=8), tokens)
    x = make_scores(0, 8 * tokens, 16, "gauss", torch.float32)  # fp32 rows, as the planner's
    parts = list(x.split(tokens))
    _, prices, _ = price_balanced_assignment(parts, 1, ShardReduce(8))
    g = torch.Generator().manual_seed(0)
    far = prices + 0.05 * float((x.amax(1) - x.amin(1)).amax()) * torch.randn(16, generator=g, dtype=torch.float64)
    started, stopped = [], []
    real_start, real_jacobi = price_base._local_start, price_base.jacobi_prices

    def local(*a, **kw):
        started.append(True)
        return real_start(*a, **kw)

    def jacobi(s_parts, *a, **kw):
        got = real_jacobi(s_parts, *a, **kw)
        stopped.append(got[3])
        return got

    with (
        mock.patch.object(price_base, "pair_rounds_pay", lambda *a: False),
        mock.patch.object(price_prices, "STALL", 0.0),  # stalled after three updates unless converged
        mock.patch.object(price_base, "_local_start", local),
        mock.patch.object(price_base, "jacobi_prices", jacobi),
    ):
        price_balanced_assignment(parts, 1, ShardReduce(8), prices=far)
    assert not stopped[0]  # the warm updates did not converge
    assert planned == bool(started) == (tokens == 1536)


def test_only_base_over_an_ep_group_pays_it():
    name, gpu, lay, seqs = DEEPSEEK
    assert _step(LlamaConfig.from_name(name), lay, gpu, seqs).exposed_s["global_base"] == 0  # top-k
    assert _step(_base(name), dataclasses.replace(lay, ep=1), gpu, seqs).exposed_s["global_base"] == 0
    assert _step(_base(name), lay, gpu, seqs).exposed_s["global_base"] > 0


def test_a_recomputed_forward_solves_again():
    name, gpu, lay, seqs = LARGE
    once = _step(_base(name), lay, gpu, seqs)
    twice = _step(_base(name), dataclasses.replace(lay, recompute=True), gpu, seqs)
    assert twice.exposed_s["global_base"] == pytest.approx(2 * once.exposed_s["global_base"], rel=1e-9)
    assert twice.bytes_per_rank["global_base"] == pytest.approx(2 * once.bytes_per_rank["global_base"], rel=1e-9)


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
