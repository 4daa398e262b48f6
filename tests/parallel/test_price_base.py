"""The distributed exact BASE solver (`price_balanced_assignment`): W ranks simulated in one
process against the single-process solve of the stacked problem (and scipy on small cases),
then the same code over gloo against the gathered path."""

import dataclasses
import math
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given
from hypothesis import strategies as st

from benchmarks.common import count_collectives
from moe.parallel import price_base, price_certificate, price_margin, price_prices, price_rows
from moe.parallel.global_base import GroupBalance
from moe.parallel.price_base import price_balanced_assignment
from moe.parallel.reduction import GroupReduce, ShardReduce
from moe.routing.balanced import assignment_bound, assignment_score, balanced_assignment, balanced_prices
from tests.parallel.launch import init, spawn
from tests.routing.test_balanced import check_feasible, make_scores, optimum


def bound(scores: torch.Tensor, k: int) -> float:
    """The single-process solver's guarantee, (2 T K + E) eps R, in the scores' units."""
    t, e = scores.shape
    spread = float((scores.amax(1) - scores.amin(1)).amax()) if t else 0.0
    return (2 * t * k + e) * 1e-6 * spread + 1e-9 * max(1.0, float(scores.abs().max()) if t else 1.0)


def same_order(idx_TK: torch.Tensor) -> torch.Tensor:
    """A token's experts as a set (the solvers may list them in different orders)."""
    return idx_TK.sort(dim=1).values


def split(x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(x.split(sizes))


def solve_simulated(x, sizes, k, extras, prices=None, local_start=True, round_bytes=0.0):
    red = ShardReduce(len(sizes))
    out, p, stats = price_balanced_assignment(
        split(x, sizes), k, red, extras=extras, prices=prices, local_start=local_start, round_bytes=round_bytes
    )
    return torch.cat(out), p, stats


sizes_st = st.lists(st.integers(0, 12), min_size=1, max_size=5)


@given(
    sizes=sizes_st,
    e=st.integers(2, 9),
    k=st.integers(1, 8),
    kind=st.sampled_from(["gauss", "int", "one_expert", "equal", "huge"]),
    extras=st.sampled_from(["best", "lowest"]),
    seed=st.integers(0, 2**16),
    all_on_one=st.booleans(),
    priced=st.sampled_from([0.0, 3000.0, 1e9]),  # the warm solve's round price: rows ahead of the counts
)
@example(sizes=[10, 10, 10], e=5, k=1, kind="gauss", extras="best", seed=1, all_on_one=False, priced=0.0)
@example(sizes=[0, 7, 0], e=4, k=1, kind="int", extras="best", seed=0, all_on_one=False, priced=1e9)  # empty ranks
@example(sizes=[5, 3], e=8, k=3, kind="equal", extras="best", seed=1, all_on_one=False, priced=3000.0)  # all tied
def test_simulated_ranks_solve_the_stacked_problem(sizes, e, k, kind, extras, seed, all_on_one, priced):
    k = min(k, e)
    if all_on_one:  # one rank holds every token
        sizes = [sum(sizes)] + [0] * (len(sizes) - 1)
    total = sum(sizes)
    x = make_scores(seed, total, e, kind)
    got, prices, _ = solve_simulated(x, sizes, k, extras)
    check_feasible(got, total, e, k, extras)
    ref = balanced_assignment(x, k, extras=extras)
    tol = bound(x, k)
    assert abs(float(assignment_score(x, got) - assignment_score(x, ref))) <= 2 * tol
    if total and total * e <= 60 and (k == 1 or total * e <= 40):
        assert abs(float(assignment_score(x, got)) - optimum(x, k, extras)) <= 2 * tol
    if prices is not None:  # the returned prices (in the scores' units) certify the optimum
        assert float(assignment_bound(x, prices, k, extras=extras) - assignment_score(x, got)) <= 2 * tol
    if prices is not None:  # a warm start from the returned prices reaches the same optimum
        warm, p_warm, stats = solve_simulated(x, sizes, k, extras, prices, round_bytes=priced)
        check_feasible(warm, total, e, k, extras)
        if priced:  # rows ahead of their counts change no result where the pair rounds ran alike
            plain, p_plain, plain_stats = solve_simulated(x, sizes, k, extras, prices)
            if plain_stats.price_updates == stats.price_updates:
                assert torch.equal(warm, plain) and (p_warm is None) == (p_plain is None)
                assert p_warm is None or torch.equal(p_warm, p_plain)
        assert abs(float(assignment_score(x, warm) - assignment_score(x, got))) <= 2 * tol


@pytest.mark.parametrize("k", [1, 4])
def test_larger_group_equals_the_single_process_solve(k):
    """W = 16 shards of uneven size, Gaussian scores (a unique optimum): the same assignment as
    the single-process solver, cold and warm started; warm needs no price update."""
    sizes = [120 + 37 * i for i in range(16)]
    x = make_scores(3, sum(sizes), 24, "gauss", torch.float32)
    ref = same_order(balanced_assignment(x, k))
    cold, prices, stats = solve_simulated(x, sizes, k, "best")
    assert torch.equal(same_order(cold), ref)
    warm, _, warm_stats = solve_simulated(x, sizes, k, "best", prices)
    assert torch.equal(same_order(warm), ref)
    assert warm_stats.price_updates == 0 and warm_stats.rounds < stats.rounds
    assert stats.margin_rows < sum(sizes) // 2  # the margin travels, not the scores


def test_top_k_margin_is_a_thin_share():
    """K = 8 of E = 32 (a token's 8th and 9th choices lie close): the band follows the prices'
    accuracy, so few tokens travel, and the result is the single-process solver's. Warm from
    the returned prices no update runs and the band widens at once to enough rows."""
    sizes = [256 + 13 * i for i in range(16)]
    x = make_scores(5, sum(sizes), 32, "gauss", torch.float32)
    ref = same_order(balanced_assignment(x, 8))
    cold, prices, stats = solve_simulated(x, sizes, 8, "best")
    assert torch.equal(same_order(cold), ref)
    assert stats.margin_rows <= 0.05 * sum(sizes)  # 10.5% with a band of 4 price moves, at least 1e-4
    warm, _, warm_stats = solve_simulated(x, sizes, 8, "best", prices)
    assert torch.equal(same_order(warm), ref)
    assert warm_stats.price_updates == 0
    assert 2 * 32 <= warm_stats.margin_rows <= 0.05 * sum(sizes)
    assert warm_stats.rounds < stats.rounds


def test_warm_prices_hold_when_the_scale_changes():
    """The returned prices are in the scores' units, not in those of the group's largest range
    (which one token sets, and which changes from call to call): the same tokens' scores
    doubled need twice the prices, and from those a warm start runs no update."""
    sizes = [300, 0, 211, 160]
    x = make_scores(11, sum(sizes), 16, "gauss", torch.float32)
    ref = same_order(balanced_assignment(x, 2))
    _, prices, _ = solve_simulated(x, sizes, 2, "best")
    cold, doubled, _ = solve_simulated(2 * x, sizes, 2, "best")
    torch.testing.assert_close(doubled, 2 * prices)
    assert float(prices.abs().max()) > 0.05  # not all tied at zero
    warm, _, stats = solve_simulated(2 * x, sizes, 2, "best", 2 * prices)
    assert torch.equal(same_order(warm), ref) and torch.equal(same_order(cold), ref)
    assert stats.price_updates == 0


def test_prices_where_the_scores_have_no_finite_units():
    """Every token's scores equal: the prices are zeros, and a warm start from them is a cold
    one (under the cold cap). fp64 scores whose range exceeds float64's: no prices come back
    (in the scores' units they would not be finite), and the next call starts cold."""
    sizes = [150, 0, 150]
    flat = torch.zeros(300, 6, dtype=torch.float64)
    _, prices, cold = solve_simulated(flat, sizes, 1, "best")
    assert torch.equal(prices, torch.zeros(6, dtype=torch.float64))
    _, again, warm = solve_simulated(flat, sizes, 1, "best", prices)
    assert warm.price_updates == cold.price_updates and warm.rounds == cold.rounds
    huge = make_scores(3, 300, 6, "gauss").mul(1e308).clamp(-1.7e308, 1.7e308)
    huge[:, 0], huge[:, 1] = 1.7e308, -1.7e308  # every token's range beyond float64's
    got, prices, _ = solve_simulated(huge, sizes, 1, "best")
    assert prices is None
    check_feasible(got, 300, 6, 1, "best")
    assert (
        abs(float(assignment_score(huge / 1e308, got) - assignment_score(huge / 1e308, balanced_assignment(huge, 1))))
        < 1e-6
    )


@pytest.mark.parametrize("iters", [1, 3])
def test_capped_price_updates_widen_the_margin(iters):
    """Price updates stopped at their cap (far from converged): the margin holds at least
    `CAPPED_SHARE` of the tokens, the result is still the single-process solver's, and the
    warm start's default cap is the lower one."""
    sizes = [200 + 11 * i for i in range(8)]
    x = make_scores(7, sum(sizes), 16, "gauss", torch.float32)
    ref = same_order(balanced_assignment(x, 2))
    out, prices, stats = price_balanced_assignment(  # from zero prices: the local start would converge in 3
        split(x, sizes), 2, ShardReduce(8), max_price_iters=iters, local_start=False
    )
    assert stats.price_updates == iters
    assert stats.margin_rows >= price_base.CAPPED_SHARE * sum(sizes)
    assert torch.equal(same_order(torch.cat(out)), ref)
    spread = float((x.amax(1) - x.amin(1)).amax())  # the prices are in the scores' units
    far = prices + spread * torch.linspace(-0.3, 0.3, 16, dtype=prices.dtype)  # a poor warm start
    warm, _, warm_stats = price_balanced_assignment(split(x, sizes), 2, ShardReduce(8), prices=far)
    assert warm_stats.price_updates <= price_base.PRICE_ITERS[1]
    assert torch.equal(same_order(torch.cat(warm)), ref)


def test_stalled_warm_updates_stop_early_and_widen_the_margin():
    """A quarter of the tokens identical (a tied group at a boundary: no prices split it, so
    the loads miss by about its size whatever the updates do). Warm started, the updates stop
    once two of them leave most of the miss, long before the cap, and the margin then holds
    at least `CAPPED_SHARE` of the tokens; the result is still the single-process optimum.
    Without the rule every update up to the cap runs."""
    sizes = [200 + 11 * i for i in range(8)]
    x = make_scores(7, sum(sizes), 16, "gauss", torch.float32)
    x[::4] = x[0]
    tol = bound(x, 1)
    ref = float(assignment_score(x, balanced_assignment(x, 1)))
    cold, prices, cold_stats = solve_simulated(x, sizes, 1, "best", local_start=False)
    assert cold_stats.price_updates == price_base.PRICE_ITERS[0]  # from zero prices they run to their cap
    # local_start=False: the stall rule alone (a warm call's local start runs beside it:
    # `test_a_warm_calls_local_start_rides_on_its_first_update`)
    warm, _, stats = solve_simulated(x, sizes, 1, "best", prices, local_start=False)
    assert stats.price_updates == 2 and stats.rounds < cold_stats.rounds // 2
    assert stats.margin_rows >= price_base.CAPPED_SHARE * sum(sizes)
    for got in (cold, warm):
        check_feasible(got, sum(sizes), 16, 1)
        assert abs(float(assignment_score(x, got)) - ref) <= 2 * tol
    with mock.patch.object(price_prices, "STALL", float("inf")):
        _, _, slow = solve_simulated(x, sizes, 1, "best", prices, local_start=False)
    assert slow.price_updates == price_base.PRICE_ITERS[1]


def test_stopped_updates_widen_the_margin_by_their_own_counts_of_tokens_by_margin():
    """Where the updates stall (a tied group as above, a sixteenth of the tokens), the margin
    holds at least `CAPPED_SHARE` of the tokens, which the last update's band does not. Each
    update also counts the group's tokens by margin at its prices (33 int32), and a chain that
    stops keeps them: the margin's first sum is at the band that holds the eighth, not at the
    thin band and then again. The same margin, assignment and prices as with that sum, in one
    round fewer."""
    sizes = [200 + 11 * i for i in range(8)]
    x = make_scores(7, sum(sizes), 16, "gauss", torch.float32)
    x[::16] = x[0]
    _, prices, _ = solve_simulated(x, sizes, 1, "best", local_start=False)
    warm, p, stats = solve_simulated(x, sizes, 1, "best", prices, local_start=False)
    assert stats.price_updates == 2 and stats.margin_rows >= price_base.CAPPED_SHARE * sum(sizes)
    real = price_margin.MarginStart.__init__

    def without(self, s_parts, p_E, width, k, red, gaps=None, min_rows=0):
        real(self, s_parts, p_E, width, k, red, None, min_rows)

    with mock.patch.object(price_margin.MarginStart, "__init__", without):
        slow, slow_p, slow_stats = solve_simulated(x, sizes, 1, "best", prices, local_start=False)
    assert torch.equal(warm, slow) and torch.equal(p, slow_p)
    assert stats.margin_rows == slow_stats.margin_rows and stats.rounds == slow_stats.rounds - 1
    margin_sums = [i for i, (kind, n, _) in enumerate(slow_stats.log) if kind == "sum" and n == 16 + 8 + 33]
    assert margin_sums[:2] == [4, 5]  # the header, three updates, then the thin band's sum and the widened one
    assert slow_stats.log[:4] + slow_stats.log[5:] == stats.log


@pytest.mark.parametrize("k", [1, 2])
def test_the_local_start_lands_near_the_groups_prices(k):
    """Each rank's own exact prices (`balanced_prices`), brought to the group's normalised units
    and their per-expert median taken, start within a few percent of the group's optimal prices,
    where those spread over a fifth of the range (one rank has no tokens and sends NaN; the
    scores are scaled by 50, so prices left in the scores' units would start far off)."""
    sizes = [512, 0, 480, 544, 512, 500, 530, 520]
    g = torch.Generator().manual_seed(k)
    x = 50.0 * (torch.randn(sum(sizes), 12, generator=g, dtype=torch.float64) + torch.linspace(0, 2.0, 12))
    parts = split(x, sizes)
    _, p, _ = price_balanced_assignment(parts, k, ShardReduce(len(sizes)))
    unit = float((x.amax(1) - x.amin(1)).amax())  # the group's largest per-token range
    optimal = p / unit
    start = price_base._local_start(parts, k, ShardReduce(len(sizes)), "best", 1e-6, unit)
    assert start is not None and start.dtype == torch.float64
    start = start - start.mean()
    assert float(optimal.max() - optimal.min()) > 0.2
    assert float((start - optimal).abs().max()) < 0.03, (start - optimal).abs().max()


def chain_misses(s_parts, caps, k, world, start, iters, tol):
    """One chain of price updates alone from ``start``: the loads' miss after each collective,
    what `jacobi_prices` returns at its end, and whether it stopped by its own rule (converged
    or stalled) before ``iters`` (`jacobi_prices` with one start, cap by cap)."""
    misses = []
    for cap in range(1, iters + 1):
        got = price_prices.jacobi_prices(s_parts, caps, k, ShardReduce(world), [start], max_iters=cap, tol=tol)
        misses.append(got[4])
        if got[1] < cap:  # stopped after cap collectives
            return misses, got, True
    return misses, got, False


def test_the_leading_chain_is_the_one_that_missed_least_the_first_on_a_tie():
    chains = [price_prices._Chain(None, 4, "cpu") for _ in range(3)]
    assert price_prices._leader(chains) is chains[0]  # none measured
    for c, misses in zip(chains, ([9, 5], [7, 5], [6]), strict=True):
        c.misses = misses
    assert price_prices._leader(chains) is chains[0]  # the last miss counts, and 5 ties 5
    chains[2].misses = [4]
    assert price_prices._leader(chains) is chains[2]


@pytest.mark.parametrize("k", [1, 2])
def test_a_warm_calls_local_start_rides_on_its_first_update(k):
    """Warm started from the draw's own optimal prices moved by 0.3% of the range (even draws)
    or 3% (odd ones), the updates stalling after two (`STALL` 0): every rank's own prices ride
    on the first update's sum (W x E more int32 values, no round of their own) and a chain
    from their median runs beside the given prices' from the second update on. The updates end
    once one converges or both have stopped, and the solve keeps the prices of the one whose
    loads missed least: the same as each chain alone would reach (the oracle runs them one at
    a time and applies the rule).
    The objective is the single-process solver's either way. A cold call gathers its start
    (its own round) and runs one chain; ``local_start=False`` carries none."""
    sizes = [150, 0, 164, 171, 178, 185]
    world, calls, kept = len(sizes), [], set()
    real_jacobi = price_base.jacobi_prices

    def jacobi(s_parts, caps, k_, red, starts, **kw):
        got = real_jacobi(s_parts, caps, k_, red, starts, **kw)
        calls.append((s_parts, caps, starts, kw, got))
        return got

    for seed in range(8):
        x = make_scores(seed, sum(sizes), 16, "gauss")
        x[::8] = x[0]  # a tied group: no prices split it, so neither start's updates converge
        rng = float((x.amax(1) - x.amin(1)).amax())
        g = torch.Generator().manual_seed(seed)
        _, own, _ = price_balanced_assignment(split(x, sizes), k, ShardReduce(world))
        far = own + (0.03 if seed % 2 else 0.003) * rng * torch.randn(16, generator=g, dtype=torch.float64)
        calls.clear()
        with (
            mock.patch.object(price_base, "jacobi_prices", jacobi),
            mock.patch.object(price_base, "pair_rounds_pay", lambda *a: False),
            mock.patch.object(price_prices, "STALL", 0.0),
        ):
            out, _, stats = price_balanced_assignment(split(x, sizes), k, ShardReduce(world), prices=far)
            ((s_parts, caps, starts, kw, got),) = calls
            kinds = [kind for kind, _, _ in stats.log]
            first = stats.log[1]  # the header, then the first update: its counts and the ranks' prices
            assert kinds[:2] == ["max", "sum"] and "gather" not in kinds[: 1 + got[1] + 1]
            assert first[1] == price_prices.chain_values(16) + world * 16 and first[2] == 4 * first[1]
            late_blocks, median = kw["late"]
            local = median(torch.stack(late_blocks).sum(0).view(world, 16))
            unit = float((x.amax(1) - x.amin(1)).amax())  # the group's largest per-token range
            gathered = price_base._local_start(split(x, sizes), k, ShardReduce(world), "best", 1e-6, unit)
            assert torch.equal(local, gathered)  # the sum is the gather, bit for bit
            iters, tol = kw["max_iters"], kw["tol"]
            a_miss, a_got, a_stop = chain_misses(s_parts, caps, k, world, starts[0], iters, tol)
            b_miss, b_got, b_stop = chain_misses(s_parts, caps, k, world, local, iters - 1, tol)
        # the two chains, the local one a collective behind, until one converges or both have
        # stopped; a chain moves after each of its sums but the one it stopped at; the smaller
        # last miss is kept (the first on a tie)
        moved = 0
        for t in range(iters):
            a = a_miss[min(t, len(a_miss) - 1)]
            b = b_miss[min(t - 1, len(b_miss) - 1)] if t else float("inf")
            a_moves = t < len(a_miss) - (1 if a_stop else 0)
            b_moves = 0 < t < len(b_miss) + 1 - (1 if b_stop else 0)
            moved += a_moves or b_moves
            a_done = a_stop and t >= len(a_miss) - 1 or t == iters - 1
            b_done = t and (b_stop and t - 1 >= len(b_miss) - 1) or t == iters - 1
            if min(a, b) <= kw["tol"] or (a_done and b_done):
                break
        winner = 0 if a <= b else 1
        alone = (a_got, b_got)[winner]
        assert got[5] == winner and torch.equal(got[0], alone[0]), (seed, a_miss, b_miss, got[1:])
        assert got[1] == moved and got[2:5] == alone[2:5], (seed, a_miss, b_miss, got[1:], alone[1:])
        assert stats.start == ("given", "local")[winner]
        kept.add(winner)
        merged = torch.cat(out)  # the tied group makes the optimum not unique: its objective
        check_feasible(merged, sum(sizes), 16, k)
        assert abs(float(assignment_score(x, merged) - assignment_score(x, balanced_assignment(x, k)))) <= 2 * bound(
            x, k
        )
        for prices, local_start in ((None, True), (far, False)):
            calls.clear()
            with mock.patch.object(price_base, "jacobi_prices", jacobi):
                _, _, st_ = price_balanced_assignment(
                    split(x, sizes), k, ShardReduce(world), prices=prices, local_start=local_start
                )
            assert calls[0][3]["late"] is None and len(calls[0][2]) == 1
            assert [kind for kind, _, _ in st_.log].count("gather") >= (prices is None)
            assert st_.log[1][0] == ("gather" if prices is None else "sum")
    assert kept == {0, 1}


def flat_scores(seed: int, num_tokens: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A trained router's look: every token's experts within a hair of each other (one token
    with a wide spread sets the group's scale), and the same scores a step later, moved a little."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, e, generator=g) * 0.01 + torch.randn(e, generator=g) * 0.01
    x[0] = torch.linspace(-0.5, 0.5, e)
    return x, x + 0.002 * torch.randn(num_tokens, e, generator=g)


@pytest.mark.parametrize("k", [1, 2])
def test_pair_rounds_keep_the_margin_thin_where_the_updates_stop_short(k):
    """Warm started and stopped after one update, far from converged: the pair rounds move the
    prices near enough that the margin holds a sliver of the tokens, not `CAPPED_SHARE`, and
    the result is the single-process solver's. Without them (where their bytes and rounds,
    at ``round_bytes`` a round, would cost more than they spare, or from zero prices) the
    margin holds the eighth."""
    sizes = [250 + 13 * i for i in range(8)]
    before, x = flat_scores(k, sum(sizes), 8)
    _, prices, _ = price_balanced_assignment(split(before, sizes), k, ShardReduce(8))
    spared = price_base.CAPPED_SHARE * sum(sizes) * price_rows.margin_row_bytes(sum(sizes), 8, k, x.dtype)
    assert price_prices.pair_bytes(8) < spared  # they pay: the rule runs them
    out, _, stats = price_balanced_assignment(  # the local start off: the test above
        split(x, sizes), k, ShardReduce(8), prices=prices, max_price_iters=1, local_start=False
    )
    assert stats.price_updates == 1 + price_prices.PAIR_ROUNDS + 2  # the max that agrees on them, the loads' check
    assert stats.margin_rows < price_base.CAPPED_SHARE * sum(sizes) / 4, stats
    assert torch.equal(same_order(torch.cat(out)), same_order(balanced_assignment(x, k)))
    # a round worth just under, then just over, what leaves the rounds and their counts even
    even = (spared - price_prices.pair_bytes(8)) / price_prices.PAIR_TRY_ROUNDS
    for round_bytes, runs in ((0.99 * even, True), (1.01 * even, False)):
        got, _, st = price_balanced_assignment(split(x, sizes), k, ShardReduce(8), prices=prices, max_price_iters=1,
                                               round_bytes=round_bytes, local_start=False)  # fmt: skip
        assert (st.price_updates > 1) == runs, (round_bytes, st)
        assert torch.equal(same_order(torch.cat(got)), same_order(torch.cat(out)))
    assert st.margin_rows >= price_base.CAPPED_SHARE * sum(sizes) and st.rounds < stats.rounds
    with pytest.raises(ValueError, match="round_bytes must be a finite number >= 0"):
        price_balanced_assignment(split(x, sizes), k, ShardReduce(8), round_bytes=-1.0)
    cold, _, cold_stats = price_balanced_assignment(
        split(x, sizes), k, ShardReduce(8), max_price_iters=1, local_start=False
    )
    assert cold_stats.price_updates == 1  # from zero prices: no pair rounds (their windows suit a warm start)
    assert torch.equal(same_order(torch.cat(cold)), same_order(torch.cat(out)))


@pytest.mark.parametrize("k", [1, 2])
def test_the_pair_rounds_check_carries_the_margins_first_counts(k):
    """The sum of the loads that checks the pair rounds' prices also carries the margin's first
    counts at them (E + W + 33 values more), so where the try holds the margin starts without
    a sum of its own: the same margin, assignment and prices as with that sum, in one round
    fewer."""
    sizes = [250 + 13 * i for i in range(8)]
    before, x = flat_scores(k, sum(sizes), 8)
    _, prices, _ = price_balanced_assignment(split(before, sizes), k, ShardReduce(8))

    def solve():
        return price_balanced_assignment(
            split(x, sizes), k, ShardReduce(8), prices=prices, max_price_iters=1, local_start=False
        )

    out, p, stats = solve()
    real = price_base.pair_prices

    def apart(s_parts, caps, k_, red, p_E, margin):  # the margin's own start at the try's prices, summed apart
        q, n, step, first = real(s_parts, caps, k_, red, p_E, margin)
        return q, n, step, None if first is None else price_margin.MarginStart(s_parts, q, step, k_, red)

    with mock.patch.object(price_base, "pair_prices", apart):
        slow, slow_p, slow_stats = solve()
    assert all(torch.equal(a, b) for a, b in zip(out, slow, strict=True)) and torch.equal(p, slow_p)
    assert stats.margin_rows == slow_stats.margin_rows and stats.rounds == slow_stats.rounds - 1
    check = 2 + price_prices.PAIR_ROUNDS + 1  # the header, the update, the pair rounds, their max
    margin = 8 + 8 + price_margin.GAP_BINS + 1
    assert stats.log[check][:2] == ("sum", 8 + margin) and slow_stats.log[check + 1][:2] == ("sum", margin)
    assert stats.log[check + 1 :] == slow_stats.log[check + 2 :]


@pytest.mark.parametrize("k", [1, 2])
def test_pair_rounds_that_raise_the_miss_run_again_narrower_or_leave_the_prices(k):
    """The loads at the pair rounds' prices are counted once more (one sum of E). Where a try
    leaves them further off than the prices it started from (here its first move is replaced by
    one that sends expert 0's price far up), the rounds run again from those prices with half
    the first window; where every try does so, the prices stay as they were and the margin is
    a stalled call's, the eighth. The assignment is the single-process solver's either way."""
    sizes = [250 + 13 * i for i in range(8)]
    before, x = flat_scores(k, sum(sizes), 8)
    _, prices, _ = price_balanced_assignment(split(before, sizes), k, ShardReduce(8))
    real_move, windows = price_prices.model_move, []

    def move(pairs, excess, window, bad=()):
        windows.append(window)
        got = real_move(pairs, excess, window)
        if window in bad:
            got = got.copy()
            got[0] += 0.5  # expert 0 far dearer: its tokens leave, the miss grows
        return got

    real_rounds, starts, returned = price_prices._pair_rounds, [], []

    def rounds(s_parts, caps, k_, red, p, window):
        starts.append(p.clone())
        return real_rounds(s_parts, caps, k_, red, p, window)

    real_pairs = price_base.pair_prices

    def pairs(*a):
        returned.append(real_pairs(*a))
        return returned[-1]

    def solve(bad):
        windows.clear(), starts.clear(), returned.clear()
        with (
            mock.patch.object(price_prices, "model_move", lambda *a: move(*a, bad=bad)),
            mock.patch.object(price_prices, "_pair_rounds", rounds),
            mock.patch.object(price_base, "pair_prices", pairs),
        ):
            return price_balanced_assignment(
                split(x, sizes), k, ShardReduce(8), prices=prices, max_price_iters=1, local_start=False
            )

    first, shrink = price_prices.PAIR_WINDOW, price_prices.PAIR_SHRINK
    ref = same_order(balanced_assignment(x, k))
    out, _, stats = solve(bad=())
    one_try = [first, first / shrink, first / shrink**2]
    assert windows == one_try
    assert stats.margin_rows < price_base.CAPPED_SHARE * sum(sizes) / 4
    again, _, again_stats = solve(bad=(first,))
    assert windows == one_try + [w / 2 for w in one_try]  # a second try, from half the first window
    assert again_stats.price_updates == stats.price_updates + price_prices.PAIR_ROUNDS + 2
    assert again_stats.margin_rows < price_base.CAPPED_SHARE * sum(sizes) / 4
    tries = price_prices.PAIR_TRIES
    kept, _, kept_stats = solve(bad=tuple(first / 2**i for i in range(tries)))
    assert len(windows) == tries * price_prices.PAIR_ROUNDS
    assert kept_stats.price_updates == 1 + tries * (price_prices.PAIR_ROUNDS + 2)
    assert len(starts) == tries and all(torch.equal(p, starts[0]) for p in starts)  # every try from the same prices
    assert torch.equal(returned[0][0], starts[0]) and not returned[0][3]  # none helped: those prices, unconverged
    assert kept_stats.margin_rows >= price_base.CAPPED_SHARE * sum(sizes)  # the margin of a stalled call
    for got in (out, again, kept):
        assert torch.equal(same_order(torch.cat(got)), ref)


def test_a_cold_start_is_the_median_of_the_ranks_own_prices():
    """Without a previous call's prices, every rank solves its own tokens alone and the group
    starts from the per-expert median of those prices (float32, one gather of W x E): one rank
    whose tokens all crowd onto expert 0 moves the mean of expert 0's price, not the median;
    an empty rank sends NaN and is left out."""
    sizes = [120, 0, 130, 110, 125]
    x = make_scores(3, sum(sizes), 6, "gauss", torch.float64)
    parts = split(x, sizes)
    parts[2] = parts[2].clone()
    parts[2][:, 0] += 5.0  # every token of rank 2 wants expert 0
    red = ShardReduce(len(sizes))
    got = price_base._local_start(parts, 1, red, "best", 1e-6, unit=1.0)
    own = [balanced_prices(p, 1)[1] for p in parts if p.shape[0]]
    stacked = torch.stack(own).to(torch.float32).to(torch.float64)
    assert torch.equal(got, stacked.median(0).values)  # four rows: the lower middle one, exactly
    assert (got - stacked.mean(0)).abs()[0] > 0.5  # the mean would follow rank 2
    assert red.log == [("gather", len(sizes) * 6, len(sizes) * 6 * 4)]
    nothing = [x[:0], x[:0]]  # no rank with tokens: no start (NaN rows only)
    assert price_base._local_start(nothing, 1, ShardReduce(2), "best", 1e-6, unit=1.0) is None


def test_a_local_start_holds_fp64_scores_beyond_float32():
    """The ranks' prices travel as float32 in the normalised units, so fp64 scores of 1e40
    give a finite start and the single-process solver's assignment."""
    sizes = [110, 0, 90]
    x = make_scores(5, sum(sizes), 8, "gauss", torch.float64) * 1e40
    out, p, stats = price_balanced_assignment(split(x, sizes), 2, ShardReduce(3))
    assert any(kind == "gather" and values == 3 * 8 for kind, values, _ in stats.log), stats
    assert p is not None and bool(p.isfinite().all())
    assert torch.equal(same_order(torch.cat(out)), same_order(balanced_assignment(x, 2)))


@pytest.mark.parametrize("k", [1, 2])
def test_a_local_start_spares_the_cold_updates(k):
    """On a trained router's look (every token's experts within a hair of each other) a cold
    call from the ranks' own prices takes fewer rounds and receives fewer bytes (its gather
    included) than from zero prices, and gives the single-process solver's assignment either way."""
    sizes = [250 + 13 * i for i in range(8)]
    _, x = flat_scores(10 + k, sum(sizes), 8)
    out, _, local = price_balanced_assignment(split(x, sizes), k, ShardReduce(8))
    zero, _, cold = price_balanced_assignment(split(x, sizes), k, ShardReduce(8), local_start=False)
    assert local.rounds < cold.rounds and local.bytes < cold.bytes, (local, cold)
    want = same_order(balanced_assignment(x, k))
    assert torch.equal(same_order(torch.cat(out)), want) and torch.equal(same_order(torch.cat(zero)), want)


@pytest.mark.parametrize("k", [1, 2])
def test_an_overfull_expert_widens_its_own_band(k):
    """A start that makes expert 0 far too cheap: its fixed tokens overfill it, and its band
    alone grows until they leave room (a token takes the widest band of the experts it holds);
    the others' tokens stay fixed outside the first band (the eighth a start without updates
    takes). Growing every band sends nearly every token."""
    sizes = [250 + 13 * i for i in range(8)]
    x = make_scores(2, sum(sizes), 8, "gauss")
    _, prices, _ = price_balanced_assignment(split(x, sizes), k, ShardReduce(8))
    far = prices.clone()
    far[0] -= 0.2 * float((x.amax(1) - x.amin(1)).amax())
    held = int((torch.topk(x.double() - far, k, dim=1).indices == 0).any(1).sum())
    out, _, stats = price_balanced_assignment(split(x, sizes), k, ShardReduce(8), prices=far, max_price_iters=0)
    assert held > 2 * sum(sizes) * k / 8  # twice its capacity
    assert stats.margin_rows < held + sum(sizes) / 4, (stats.margin_rows, held)
    assert torch.equal(same_order(torch.cat(out)), same_order(balanced_assignment(x, k)))


def dear_expert(k: int, experts: int = 64, dearer: float = 0.02):
    """Expert 0 of ``experts`` (64) made dearer by ``dearer`` (2%) of the scores' range than the
    optimum's prices, over 8 ranks of 256 tokens: few tokens pick it, and the margin rows,
    which carry their K + 3 best experts under these prices, rarely carry it."""
    sizes = [256] * 8
    x = make_scores(1, sum(sizes), experts, "gauss")
    _, prices, _ = price_balanced_assignment(split(x, sizes), k, ShardReduce(8))
    far = prices.clone()
    far[0] += dearer * float((x.amax(1) - x.amin(1)).amax())
    return x, sizes, far


@pytest.mark.parametrize("k", [1, 2])
def test_rows_that_cannot_fill_an_expert_on_their_own_columns_widen_the_band(k):
    """The room the fixed tokens leave on expert 0 only rows at a column they did not carry
    can fill. Left to the certificate, the cycles' price for it would fall far below the
    picks' and nearly every fixed token would fail (about 2000 of 2048 rows); the cycles on
    the gathered rows see it first and the band grows until rows that carry it come. The sum
    that decides to grow carries the grown margin's counts under both ways it may grow, so
    the rows it adds are gathered next, with no count of their own."""
    x, sizes, far = dear_expert(k)
    out, _, stats = price_balanced_assignment(split(x, sizes), k, ShardReduce(8), prices=far, max_price_iters=0)
    assert stats.margin_rows < sum(sizes) / 2, stats.margin_rows
    widen = [
        i
        for i, (kind, n, _) in enumerate(stats.log)
        if kind == "sum" and n == 3 + 2 * (64 + 8 + price_margin.GAP_BINS + 1)
    ]
    assert widen and all(stats.log[i + 1][0] == "gather" for i in widen), stats.log
    assert torch.equal(same_order(torch.cat(out)), same_order(balanced_assignment(x, k)))


@pytest.mark.parametrize("k", [1, 2])
def test_an_expert_short_of_rows_pulls_the_tokens_nearest_to_it(k):
    """Where the gathered rows cannot fill expert 0 on their own columns, the margin takes the
    tokens nearest to taking it (their rows carrying it), not every band 2x: under three
    quarters of the rows and bytes (0.58-0.66x here), in no more rounds, to the same optimum."""
    x, sizes, far = dear_expert(k)

    def solve():
        return price_balanced_assignment(split(x, sizes), k, ShardReduce(8), prices=far, max_price_iters=0)

    out, _, pulled = solve()
    with mock.patch.object(price_margin, "PULL_SHARE", float("inf")):  # never a pull: every band grows
        out_band, _, banded = solve()
    assert pulled.margin_rows < 0.75 * banded.margin_rows, (pulled, banded)
    assert pulled.bytes < 0.75 * banded.bytes and pulled.rounds <= banded.rounds
    best = same_order(balanced_assignment(x, k))
    assert torch.equal(same_order(torch.cat(out)), best) and torch.equal(same_order(torch.cat(out_band)), best)


@pytest.mark.parametrize("k", [1, 2])
def test_every_band_grows_in_finer_steps_where_rows_travel(k):
    """Where the rows cannot fill an expert and no pull is taken, every band grows 2x, not 4x:
    the last step overshoots the band needed by less, so fewer rows and bytes (0.61-0.67x
    here) in at most two rounds more, to the same optimum. On one rank, where the band costs
    no bytes, it grows 4x as before: the local start's prices are the same either way."""
    x, sizes, far = dear_expert(k)

    def solve(parts, world, grow):
        with mock.patch.object(price_margin, "PULL_SHARE", float("inf")), mock.patch.object(price_margin, "GROW", grow):
            return price_balanced_assignment(parts, k, ShardReduce(world), prices=far, max_price_iters=0)

    out, _, fine = solve(split(x, sizes), 8, price_margin.GROW)
    out_coarse, _, coarse = solve(split(x, sizes), 8, 4)
    assert fine.margin_rows < 0.75 * coarse.margin_rows and fine.bytes < 0.75 * coarse.bytes, (fine, coarse)
    assert fine.rounds <= coarse.rounds + 2
    best = same_order(balanced_assignment(x, k))
    assert torch.equal(same_order(torch.cat(out)), best) and torch.equal(same_order(torch.cat(out_coarse)), best)
    _, p_one, one = solve([x], 1, price_margin.GROW)
    _, p_one4, one4 = solve([x], 1, 4)
    assert torch.equal(p_one, p_one4) and one.margin_rows == one4.margin_rows


def test_the_rows_a_pull_adds_carry_its_expert():
    """Expert 0 of 256 dearer by 4% of the range, K = 2: the tokens nearest to taking it rank
    it below their K + 3 best under these prices, so only the column a pull makes them carry
    lets the cycles fill it. Sent without it, the band grows until every row travels."""
    x, sizes, far = dear_expert(2, experts=256, dearer=0.04)
    pack = price_margin.pack_rows

    def solve():
        return price_balanced_assignment(split(x, sizes), 2, ShardReduce(8), prices=far, max_price_iters=0)

    def without_want(*args):  # the rows as before the pull: their own best columns only
        return pack(*args[:7])

    out, _, pulled = solve()
    with mock.patch.object(price_margin, "pack_rows", without_want):
        out_plain, _, plain = solve()
    assert pulled.margin_rows < plain.margin_rows / 2 and pulled.bytes < plain.bytes / 2, (pulled, plain)
    best = float(assignment_score(x, balanced_assignment(x, 2)))
    for got in (out, out_plain):
        assert abs(float(assignment_score(x, torch.cat(got))) - best) <= bound(x, 2)


@pytest.mark.parametrize("k", [1, 2])
def test_one_rank_grows_every_band_not_a_pull(k):
    """On one rank (a local start's solve) no row travels: the band grows as without the pull,
    and the prices, the group's start, are those of the wider margin, bit for bit."""
    x, _, far = dear_expert(k)

    def solve():
        return price_balanced_assignment([x], k, ShardReduce(1), prices=far, max_price_iters=0)

    out, prices, stats = solve()
    with mock.patch.object(price_margin, "PULL_SHARE", float("inf")):
        out_band, prices_band, banded = solve()
    assert stats.margin_rows == banded.margin_rows and torch.equal(prices, prices_band)
    assert torch.equal(out[0], out_band[0])


def test_fewer_failing_fixed_tokens_than_a_wider_band_adds_go_to_the_certificate():
    """Expert 0 of 8 dearer by a fifth of the range, K = 2, no price updates: rows sit on its
    column without carrying it, but fewer fixed tokens fail against the cycles' prices than a
    4x band would add, so those travel instead of the band growing (which takes more bytes)."""
    sizes = [250 + 13 * i for i in range(8)]
    x = make_scores(2, sum(sizes), 8, "gauss")
    _, prices, _ = price_balanced_assignment(split(x, sizes), 2, ShardReduce(8))
    far = prices.clone()
    far[0] += 0.2 * float((x.amax(1) - x.amin(1)).amax())

    def solve():
        return price_balanced_assignment(split(x, sizes), 2, ShardReduce(8), prices=far, max_price_iters=0)

    out, _, stats = solve()
    counts = price_margin._widen_counts

    def never_fewer(*a):  # every band always grows
        three, ways = counts(*a)
        return [2**62, 2**62, three[2]], ways

    with mock.patch.object(price_margin, "_widen_counts", never_fewer):
        _, _, grown = solve()
    assert stats.bytes < 0.9 * grown.bytes, (stats, grown)
    assert torch.equal(same_order(torch.cat(out)), same_order(balanced_assignment(x, 2)))


def test_an_expert_the_cycles_price_out_widens_its_own_band():
    """Random scores over 8 ranks of 512 tokens, 16 experts, K = 2: the gathered rows want more
    of one expert than the room the fixed tokens leave, and too few of them hold it, so the
    cycles raise its price far above the others' (more than 4 bands). Left to the
    certificate, every fixed token that holds it near its margin would fail and travel (315
    rows over two checks); its band grows first, the tokens that hold it come, and the
    certificate passes at its first check."""
    g = torch.Generator().manual_seed(18)
    x = torch.randn(8 * 512, 16, generator=g) + 0.3 * torch.randn(16, generator=g)
    out, _, stats = solve_simulated(x, [512] * 8, 2, "best")
    with mock.patch.object(price_margin, "_risen", lambda *a: torch.zeros(0, dtype=torch.int64)):
        _, _, left = solve_simulated(x, [512] * 8, 2, "best")
    assert stats.checks == 1 < left.checks, (stats, left)
    assert 2 * stats.margin_rows < left.margin_rows and stats.bytes < left.bytes, (stats, left)
    assert torch.equal(same_order(out), same_order(balanced_assignment(x, 2)))


def test_a_wider_band_sends_only_the_rows_it_adds():
    """Each margin row travels once while the band grows (the prices, and so its row, stay):
    with the certificate passing at once, the rows gathered are the margin rows."""
    x, sizes, far = dear_expert(1)
    _, _, stats = price_balanced_assignment(split(x, sizes), 1, ShardReduce(8), prices=far, max_price_iters=0)
    gathers = [size for kind, _, size in stats.log if kind == "gather"]
    assert stats.checks == 1 and len(gathers) > 1
    assert sum(gathers) == stats.margin_rows * price_rows.margin_row_bytes(sum(sizes), 64, 1, x.dtype)


def test_prices_too_far_for_the_margins_bins():
    """Prices so far apart that fewer than 2E tokens have a margin under the last bin's edge
    (about 2e3 of the normalised scores): the band goes past 4, the whole problem. With the
    local start beside them (the default), its chain leads and the margin stays thin."""
    x = make_scores(0, 200, 4, "gauss")
    spread = float((x.amax(1) - x.amin(1)).amax())
    far = torch.tensor([0.0, 1e4, 2e4, 3e4], dtype=torch.float64) * spread
    ref = same_order(balanced_assignment(x, 1))
    out, _, stats = price_balanced_assignment(split(x, [120, 80]), 1, ShardReduce(2), prices=far, local_start=False)
    assert stats.margin_rows == 200 and stats.start == "given"
    assert torch.equal(same_order(torch.cat(out)), ref)
    out, _, stats = price_balanced_assignment(split(x, [120, 80]), 1, ShardReduce(2), prices=far)
    assert stats.margin_rows < 50 and stats.start == "local"
    assert torch.equal(same_order(torch.cat(out)), ref)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_thresholds_are_the_prices_each_expert_keeps_a_token_below(k):
    """``s[e, t]`` less the K-th best ``s - p`` of the other experts, read off a sort, ties and
    tokens tied at their best included (K = 1 takes the two largest by two maxima)."""
    s = make_scores(4, 60, 7, "gauss").T.contiguous()
    s[:, :10] = 0.0  # every expert tied
    s[2, 10:20] = s[5, 10:20]  # two tied at the top under equal prices
    for p in (torch.zeros(7, 1, dtype=s.dtype), torch.linspace(-0.3, 0.3, 7, dtype=s.dtype)[:, None]):
        got = price_prices.thresholds(s, p, k)
        for t in range(s.shape[1]):
            a = (s[:, t] - p[:, 0]).tolist()
            for e in range(7):
                others = sorted((a[j] for j in range(7) if j != e), reverse=True)
                assert float(got[e, t]) == float(s[e, t] - others[k - 1]), (k, t, e)


def test_histogram_counts_each_threshold_in_its_bin():
    """Per expert: the thresholds above the window, in each of its bins from the top (a bin
    holds values in (top - (j + 1) h, top - j h]), and below it, as a loop over them reads it."""
    b = price_prices.BINS
    v = make_scores(5, 50, 6, "gauss").T.contiguous().float()
    top = torch.linspace(-0.5, 0.5, 6)[:, None]
    h = torch.full((6, 1), 0.05)
    v[1, :5] = top[1, 0] - 3 * h[1, 0]  # on a bin's edge
    want = torch.zeros(6, b + 2, dtype=torch.int32)
    for e in range(6):
        for x in v[e].tolist():
            j = math.floor((float(top[e, 0]) - x) / float(h[e, 0]))
            want[e, min(max(j, -1), b) + 1] += 1
    got = price_prices._histogram(v.clone(), top, h)
    assert got.dtype == torch.int32 and torch.equal(got, want)


def test_pair_counts_count_each_token_at_its_boundary():
    """Each token once, at (its K-th expert, the next, its margin's bin), when the margin is
    inside the window; the loads are the K best under the prices."""
    k, e, window = 2, 5, 0.3
    s = make_scores(3, 40, e, "gauss").T.contiguous()
    p = torch.linspace(-0.2, 0.2, e, dtype=s.dtype)[:, None]
    got = price_prices.pair_counts(s, p, k, window)
    b = price_prices.PAIR_BINS
    want, loads = torch.zeros(e, e, b, dtype=torch.int64), torch.zeros(e, dtype=torch.int64)
    for t in range(s.shape[1]):
        order = sorted(range(e), key=lambda j: -float(s[j, t] - p[j, 0]))
        loads[order[:k]] += 1
        gap = float(s[order[k - 1], t] - p[order[k - 1], 0] - (s[order[k], t] - p[order[k], 0]))
        if gap < window:
            want[order[k - 1], order[k], int(gap / (window / b))] += 1
    assert got.dtype == torch.int32
    assert torch.equal(got[: e * e * b].long().view(e, e, b), want) and torch.equal(got[e * e * b :].long(), loads)


def test_model_move_balances_two_experts_and_stays_in_its_window():
    """400 tokens on expert 0 with expert 1 next, their margins spread evenly over the window:
    50 too many on 0 move once 0 is dearer than 1 by an eighth of the window (a sixteenth up,
    a sixteenth down). An excess no token in the window can take stops at half the window."""
    window = 4e-3
    pairs = torch.zeros(2, 2, price_prices.PAIR_BINS, dtype=torch.float64)
    pairs[0, 1] = 400 / price_prices.PAIR_BINS
    move = price_prices.model_move(pairs.numpy(), torch.tensor([50, -50]).numpy(), window)
    assert move == pytest.approx([window / 16, -window / 16], rel=1e-3)
    move = price_prices.model_move(pairs.numpy(), torch.tensor([1000, -1000]).numpy(), window)
    assert move[0] == pytest.approx(window / 2, rel=1e-3) and move[1] == pytest.approx(-window / 2, rel=1e-3)
    move = price_prices.model_move(pairs.numpy(), torch.tensor([-50, 50]).numpy(), window)  # 1 has no tokens to give
    assert move[1] == pytest.approx(window / 2, rel=1e-3)
    empty = torch.zeros(4, 4, price_prices.PAIR_BINS, dtype=torch.float64)  # no token in the window at all
    move = price_prices.model_move(empty.numpy(), torch.tensor([3, -1, -1, -1]).numpy(), window)
    assert torch.from_numpy(move).isfinite().all() and abs(move).max() <= window


@pytest.mark.parametrize("e", [8, 256, 300])  # uint8 experts up to id 255, int16 beyond
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cols", ["some", "all"])
@pytest.mark.parametrize("total", [100, 2**31])  # int32 and int64 keys
@pytest.mark.parametrize("keyed", [True, False])  # the certificate's rows, the margin's
def test_rows_travel_as_bytes_and_come_back(e, dtype, cols, total, keyed):
    """`pack_rows` packs rows into bytes and `unpack_rows` reads every rank's back: the key where a row
    has one, the slots in their order, the carried columns' scores bit for bit and ``UNSENT``
    elsewhere; a row of ``cols`` < E carries its slots and its ``cols`` - K best other experts."""
    g = torch.Generator().manual_seed(e)
    k = 2
    width = e if cols == "all" else k + 3
    lay = price_rows.RowLayout.of(total, e, k, dtype)
    assert lay.index == (torch.int32 if total < 2**31 else torch.int64)
    assert lay.expert == (torch.uint8 if e <= 256 else torch.int16)
    p = torch.randn(e, 1, generator=g, dtype=dtype)
    shards = [torch.rand(e, t, generator=g, dtype=dtype) - 1 for t in (6, 0, 9, 1)]
    shards[0][e - 1, 0] = 10.0  # the last expert, id e - 1, among the slots
    picks = [torch.topk(s - p, k, dim=0).indices.T.flip(1).contiguous() for s in shards]  # the K best, worst first
    locals_ = [torch.tensor(i, dtype=torch.int64) for i in ([0, 2, 5], [], [8, 1, 3, 4], [0])]  # one empty, one 1 row
    keys = [torch.tensor(i, dtype=torch.int64) for i in ([-1, 2, 5], [], [14, -1, 9, 10], [total - 16])]
    keys = keys if keyed else [None] * 4
    made = [price_rows.pack_rows(*a, width, lay) for a in zip(shards, [p] * 4, picks, locals_, keys, strict=True)]
    rows = torch.cat([r for r, _ in made])
    assert rows.dtype == torch.uint8 and rows.shape[1] == lay.width(width, keyed)
    assert lay.width(width, True) - lay.width(width, False) == lay.index.itemsize
    got_keys, slots, got = price_rows.unpack_rows(rows, lay, width, keyed)
    if keyed:
        assert got_keys.tolist() == [-1, 2, 5, 14, -1, 9, 10, total - 16]
    else:
        assert got_keys is None
    assert e - 1 in slots[0].tolist()
    assert torch.equal(slots, torch.cat([o[lc] for o, lc in zip(picks, locals_, strict=True)]))
    want = torch.cat([s[:, lc] for s, lc in zip(shards, locals_, strict=True)], 1)
    sent = torch.cat([m for _, m in made], 1)
    assert torch.equal(got[sent], want[sent]) and bool((got[~sent] == price_rows.UNSENT).all())
    held = torch.zeros_like(sent).scatter_(0, slots.T, True)
    best = torch.topk(torch.where(held, float("-inf"), want - p), width - k, dim=0).indices
    assert torch.equal(sent, held.scatter(0, best, True))


def test_a_row_carries_the_expert_it_is_pulled_to():
    """A row with ``want`` carries that expert in place of the last of its best others where
    they lack it, and is unchanged where they hold it or it names none (-1)."""
    g = torch.Generator().manual_seed(5)
    e, k, width = 16, 2, 5
    lay = price_rows.RowLayout.of(100, e, k, torch.float32)
    s = torch.rand(e, 6, generator=g) - 1
    p = torch.zeros(e, 1)
    held = torch.topk(s, k, dim=0).indices.T.contiguous()
    local = torch.arange(6)
    _, plain = price_rows.pack_rows(s, p, held, local, None, width, lay)
    far = (~plain).float().argmax(0)  # an expert each row lacks
    near = plain.float().argmax(0)  # one it carries
    want = torch.stack([far[0], near[1], torch.tensor(-1), far[3], far[4], far[5]])
    rows, sent = price_rows.pack_rows(s, p, held, local, None, width, lay, want)
    _, slots, got = price_rows.unpack_rows(rows, lay, width, keyed=False)
    assert torch.equal(slots, held)
    for t in range(6):
        if t in (1, 2):
            assert torch.equal(sent[:, t], plain[:, t])
        else:
            last = torch.topk(torch.where(plain[:, t], s[:, t], float("inf")), 1, largest=False).indices  # worst sent
            assert sent[want[t], t] and int(sent[:, t].sum()) == width
            assert not sent[last, t] or bool(torch.isin(last, held[t]).any())
    assert torch.equal(got[sent], s[sent])


@given(
    sizes=sizes_st,
    e=st.integers(4, 14),
    k=st.integers(1, 3),
    kind=st.sampled_from(["gauss", "int", "equal"]),
    extras=st.sampled_from(["best", "lowest"]),
    seed=st.integers(0, 2**16),
    sent=st.integers(0, 2),
)
@example(sizes=[12, 12, 12, 12], e=14, k=2, kind="gauss", extras="best", seed=3, sent=0)
def test_rows_short_of_columns_come_back_with_more(sizes, e, k, kind, extras, seed, sent):
    """Margin rows carrying only their slots and ``sent`` more columns: the certificate finds
    the rows whose missing columns could gain, they travel again with their best columns under
    the new prices added to the ones they carried, and the result is the single-process
    solver's optimum."""
    total = sum(sizes)
    x = make_scores(seed, total, e, kind)
    with mock.patch.object(price_margin, "SENT", sent):
        got, _, stats = solve_simulated(x, sizes, k, extras)
    check_feasible(got, total, e, k, extras)
    ref = balanced_assignment(x, k, extras=extras)
    assert abs(float(assignment_score(x, got) - assignment_score(x, ref))) <= 2 * bound(x, k)
    assert stats.margin_rows <= total


@pytest.mark.parametrize("sent", [0, 3])
def test_a_priced_round_sends_the_certificates_rows_with_its_counts(sent):
    """With a round priced (``round_bytes``), each certificate check sends its counts and its
    first rows in one gather of fixed size (`price_rows.ahead_rows`) instead of the counts' sum
    and then the rows: the same assignment and prices, the same collectives before the
    certificate (the margin's rows ahead kept off here: the next test), one round fewer per
    check that sent rows where every rank's fit, and none more where they do not (the rest
    follows in a second gather). ``sent`` 0: rows of their slots alone, which travel again at
    every check up to the last."""
    sizes = [60, 65, 0, 75]
    x = make_scores(40, sum(sizes), 24, "gauss")
    far = 0.02 * float((x.amax(1) - x.amin(1)).amax()) * torch.linspace(-1, 1, 24, dtype=torch.float64)

    def solve(round_bytes):
        with mock.patch.object(price_margin, "SENT", sent), mock.patch.object(price_margin, "ahead_rows", lambda *a: 0):
            return price_balanced_assignment(split(x, sizes), 2, ShardReduce(4), prices=far, max_price_iters=0,
                                             round_bytes=round_bytes)  # fmt: skip

    plain_out, plain_p, plain = solve(0.0)
    checks = plain.log[plain.check_from :]
    with_rows = sum(kind == "gather" for kind, _, _ in checks)
    assert with_rows >= 2 and {(kind, values) for kind, values, _ in checks[::2]} == {("sum", 8)}, checks
    ref = balanced_assignment(x, 2)
    assert torch.equal(same_order(torch.cat(plain_out)), same_order(ref))
    for round_bytes in (1e9, 2000.0):  # every row fits; one row a rank ahead (4 x 2 rows of 49 bytes)
        out, p, stats = solve(round_bytes)
        assert torch.equal(torch.cat(out), torch.cat(plain_out)) and torch.equal(p, plain_p), round_bytes
        assert stats.log[: stats.check_from] == plain.log[: plain.check_from] and stats.checks == plain.checks
        mine = stats.log[stats.check_from :]
        sums = sum(kind == "sum" for kind, _, _ in mine)
        if round_bytes == 1e9:  # at sent 0 the last check sends every row whole: more than a rank sent before
            assert sums == 0 and stats.rounds == plain.rounds - with_rows + (sent == 0), mine
        else:  # a rest gather in some checks; at sent 0 the last check's whole rows (102 bytes) too wide
            assert sums == (sent == 0) and len(mine) > stats.checks, mine
            assert plain.rounds - with_rows < stats.rounds <= plain.rounds


@pytest.mark.parametrize("iters", [2, 0])
def test_a_priced_round_sends_the_margins_first_rows_with_its_counts(iters):
    """With a round priced, the margin's first counts (where they did not ride on an earlier
    collective) travel as each rank's own counts with the first rows of its first band, in one
    gather of fixed size, instead of their sum and then the rows (the certificate's rows ahead
    kept off here). Where that band stands (2 updates from far prices), the rows that came are
    the margin's first gather (with a second for the rest where a rank had more than came:
    10 rows ahead at 12,000 bytes a round), and where all came the solve takes one round
    fewer; where it grows (no update: too few rows, then experts overfilled), they are dropped
    and the wider band's rows gather as without them, in the same rounds. The same assignment
    and prices, bit for bit, and the same collectives but the first margin sum."""
    sizes = [60, 65, 0, 75]
    x = make_scores(40, sum(sizes), 24, "gauss")
    far = 0.02 * float((x.amax(1) - x.amin(1)).amax()) * torch.linspace(-1, 1, 24, dtype=torch.float64)

    def solve(round_bytes):
        with mock.patch.object(price_certificate, "ahead_rows", lambda *a: 0):
            return price_balanced_assignment(split(x, sizes), 2, ShardReduce(4), prices=far, max_price_iters=iters,
                                             round_bytes=round_bytes)  # fmt: skip

    plain_out, plain_p, plain = solve(0.0)
    kinds = [(kind, values) for kind, values, _ in plain.log]
    at = kinds.index(("sum", 24 + 4 + price_prices.GAP_BINS + 1))  # the margin's first counts
    stands = iters == 2
    # standing, the rows came: the gather after the sum is gone; grown, two more sums came first
    assert [kind for kind, _ in kinds[at + 1 : at + 3]] == (["gather", "sum"] if stands else ["sum", "sum"])
    rows = plain.log[at + 1][1] // (2 + 3) // (1 + 8)  # fp64 rows of 5 columns
    assert stands <= (rows > 3 * 10)  # more rows than 10 a rank: a rest to gather at 12,000 bytes
    for round_bytes in (1e9, 12000.0):
        out, p, stats = solve(round_bytes)
        assert torch.equal(torch.cat(out), torch.cat(plain_out)) and torch.equal(p, plain_p)
        assert (
            stats.log[at][0] == "gather" and stats.log[:at] == plain.log[:at] and stats.margin_rows == plain.margin_rows
        )
        rest = stands and round_bytes == 12000.0
        if rest:  # the first band's rows beyond the 10 that came, in a gather of their own
            assert stats.log[at + 1][0] == "gather" and stats.log[at + 1][1] < plain.log[at + 1][1]
        assert stats.log[at + 1 + rest :] == plain.log[at + 1 + stands :], (stats.log, plain.log)
        assert stats.rounds == plain.rounds - stands + rest


def test_a_band_that_surely_holds_more_rows_than_come_ahead_sums_its_counts():
    """The stalled solve above: its updates' counts of tokens by margin say how many tokens the
    first band surely holds and at most holds (`MarginStart.surely`, ``at_most``). Where it
    surely holds more than every rank can send ahead of its counts (10 rows of 20 bytes a rank
    at 12,800 bytes a round, after 10 rows of counts), a rank surely has more than come: the
    margin's counts go in their sum and its rows in one gather, as by bytes alone, with no
    padding. Where they all fit, the counts come with the rows, one round fewer. The same
    margin, assignment and prices either way. On converged random scores a rank sends no more
    rows ahead than the band holds at most, not as many as it has tokens."""
    sizes = [200 + 11 * i for i in range(8)]
    x = make_scores(7, sum(sizes), 16, "gauss", torch.float32)
    x[::16] = x[0]
    _, prices, _ = solve_simulated(x, sizes, 1, "best", local_start=False)
    starts = []
    real = price_margin.MarginStart.__init__

    def spy(self, *a, **kw):
        real(self, *a, **kw)
        starts.append((self.surely, self.at_most))

    runs = {}
    with mock.patch.object(price_margin.MarginStart, "__init__", spy):
        for round_bytes in (0.0, 12800.0, 1e9):
            runs[round_bytes] = solve_simulated(x, sizes, 1, "best", prices, local_start=False, round_bytes=round_bytes)
    (out0, p0, plain), (out1, p1, few), (out2, p2, many) = runs.values()
    rows = plain.log[plain.check_from - 1][1] // 20  # the first band's, in one gather
    assert 8 * 10 < starts[0][0] <= rows <= starts[0][1] and starts[0] == starts[1] == starts[2]
    assert price_rows.ahead_rows(12800.0, 8, 20, 4 * (16 + 34)) == 10
    assert torch.equal(out0, out1) and torch.equal(out0, out2) and torch.equal(p0, p1) and torch.equal(p0, p2)
    assert plain.margin_rows == few.margin_rows == many.margin_rows
    assert few.log[: few.check_from] == plain.log[: plain.check_from]  # no rows ahead: the sum, then the rows
    margin = plain.log[plain.check_from - 2 : plain.check_from]
    assert [kind for kind, _, _ in margin] == ["sum", "gather"], margin
    assert (
        many.check_from == plain.check_from - 1 and many.log[: many.check_from - 1] == plain.log[: plain.check_from - 2]
    )
    # converged random scores: the band holds at most a few tokens a rank, and no more come
    x = make_scores(3, 8 * 300, 16, "gauss", torch.float32)
    _, prices, _ = solve_simulated(x, [300] * 8, 1, "best")
    with mock.patch.object(price_margin.MarginStart, "__init__", spy):
        out, p, plain = solve_simulated(x, [300] * 8, 1, "best", prices)
        out1, p1, many = solve_simulated(x, [300] * 8, 1, "best", prices, round_bytes=1e9)
    surely, at_most = starts[-1]
    assert surely <= plain.log[plain.check_from - 1][1] // 20 <= at_most < 300
    assert many.log[many.check_from - 1] == ("gather", 8 * (10 + at_most) * 20, 8 * (10 + at_most) * 20)
    assert torch.equal(out, out1) and torch.equal(p, p1)


def test_rows_ahead_of_a_band_whose_fixed_tokens_overfill_an_expert_are_dropped():
    """A cold call on tied fp64 scores (a quarter of the tokens alike, one rank holding most):
    the margin's first rows come with its counts, the fixed tokens then overfill an expert, so
    its band grows before any gather: the rows that came are dropped, and the grown band's
    counts and rows follow as by bytes alone (a sum, then a gather of the same size). The
    same assignment and prices."""
    sizes = [10, 80, 10, 1]
    x = torch.randn(sum(sizes), 16, generator=torch.Generator().manual_seed(35), dtype=torch.float64)
    x[::4] = x[0].clone()
    plain_out, plain_p, plain = price_balanced_assignment(split(x, sizes), 2, ShardReduce(4), extras="lowest")
    out, p, stats = price_balanced_assignment(split(x, sizes), 2, ShardReduce(4), extras="lowest", round_bytes=1e9)
    assert all(torch.equal(a, b) for a, b in zip(out, plain_out, strict=True)) and torch.equal(p, plain_p)
    margin = ("sum", 16 + 4 + price_prices.GAP_BINS + 1)
    at = [entry[:2] for entry in plain.log].index(margin)
    assert [entry[:2] for entry in plain.log[at : at + 2]] == [margin, margin]  # counted, overfilled, counted
    assert stats.log[at][0] == "gather" and stats.log[at + 1 : at + 3] == plain.log[at + 1 : at + 3]
    assert stats.margin_rows == plain.margin_rows


def test_negative_caps_are_refused():
    x = make_scores(0, 20, 4, "gauss")
    for name in ("max_price_iters", "max_cycles"):
        with pytest.raises(ValueError, match=f"{name} must be None or an int >= 0, got -1"):
            price_balanced_assignment(split(x, [10, 10]), 1, ShardReduce(2), **{name: -1})


def test_rows_sent_ahead_cost_at_most_their_share_of_a_round():
    """`ahead_rows`: the most rows a rank can send ahead, after its counts in whole rows, whose
    bytes, received from every rank, cost at most `AHEAD_SHARE` of a round; none without a
    price."""
    assert price_rows.ahead_rows(0.0, 8, 24, 8) == 0
    cases = [(1.25e6, 8, 24, 8), (1.25e6, 1024, 59, 8), (2000.0, 4, 49, 8), (500.0, 4, 49, 8), (1e6, 8, 7, 8)]
    cases += [(1.25e6, 8, 20, 4 * (64 + 34))]  # the margin's counts at E = 64 over 20 rows
    for round_bytes, world, width, head_bytes in cases:
        n = price_rows.ahead_rows(round_bytes, world, width, head_bytes)
        head = -(-head_bytes // width)
        share = price_rows.AHEAD_SHARE * round_bytes
        assert n == 0 or (n + head) * world * width <= share, (round_bytes, world, n)
        assert (n + head + 1) * world * width > share, (round_bytes, world, n)
    assert price_rows.ahead_rows(1.25e6, 8, 24, 8) == 1626 and price_rows.ahead_rows(1e6, 8, 7, 8) == 4462


def test_the_header_carries_each_ranks_tag_and_a_solve_can_take_it():
    """`agree`, the header run by a caller first (`GroupBalance`, with its ranks' re-run codes as
    tags): the tags come back in rank order, and a solve given it runs no header of its own,
    with the same collectives (the header counted with them), prices and assignment as one that
    agrees itself. A header agreed on other options, or with a failed rank, is refused."""
    sizes = [10, 0, 20]
    x = make_scores(3, sum(sizes), 6, "gauss")
    red = ShardReduce(3)
    header = price_base.agree(split(x, sizes), 2, red, tags=[2, 0, 5])
    assert header.tags == [2, 0, 5] and header.sizes == sizes and not header.failed
    got, p, stats = price_balanced_assignment(split(x, sizes), 2, red, header=header)
    ref, p_ref, ref_stats = price_balanced_assignment(split(x, sizes), 2, ShardReduce(3))
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True)) and torch.equal(p, p_ref)
    assert stats.log == ref_stats.log and red.rounds == ref_stats.rounds, (stats.log, ref_stats.log)
    with pytest.raises(ValueError, match="other options"):
        price_balanced_assignment(split(x, sizes), 2, red, header=header, round_bytes=1e6)
    with pytest.raises(ValueError, match=r"ranks \[1\] of the group failed"):
        price_balanced_assignment(split(x, sizes), 2, red, header=dataclasses.replace(header, failed=[1]))


def test_bad_input_on_one_rank_raises_for_all():
    x = make_scores(0, 20, 4, "gauss")
    parts = split(x, [10, 10])
    parts[1] = parts[1].clone()
    parts[1][3, 2] = float("nan")
    with pytest.raises(ValueError, match=r"finite.*ranks \[1\]"):
        price_balanced_assignment(parts, 1, ShardReduce(2))
    with pytest.raises(ValueError, match="shape"):
        price_balanced_assignment([x[:10], x[10:, 0]], 1, ShardReduce(2))
    with pytest.raises(ValueError, match="same E"):
        price_balanced_assignment([x[:10], x[10:, :3]], 1, ShardReduce(2))


# ---- gloo: the same code over torch.distributed, against the gathered path


def check_group(group, world: int, rank: int, seed: int) -> None:
    """Against the gathered path, assignment for assignment (Gaussian fp64: a unique optimum),
    every rank holding the same result; a warm second call; a bad input raising everywhere."""
    gathered = GroupBalance(group, balanced_assignment, method="gather")
    prices = GroupBalance(group, balanced_assignment)
    me = dist.get_rank(group)
    for case, (t, e, k, extras) in enumerate([(40, 8, 1, "best"), (33, 16, 3, "best"), (25, 6, 2, "lowest")]):
        sizes = [t + 7 * j if j != 1 else 0 for j in range(world)]  # uneven, one rank empty
        x = make_scores(seed + case, sum(sizes), e, "gauss")
        mine = split(x, sizes)[me]
        for call in range(2):  # cold, then warm from the first call's prices
            got = prices(mine, k, extras=extras)
            ref = gathered(mine, k, extras=extras)
            assert torch.equal(same_order(got), same_order(ref)), (case, call, me)
        assert prices.stats.price_updates == 0, prices.stats
        full = torch.zeros(sum(sizes), k, dtype=torch.int64)
        start = sum(sizes[:me])
        full[start : start + sizes[me]] = got
        dist.all_reduce(full, group=group)  # each row written by its owner once
        assert torch.equal(same_order(full), same_order(balanced_assignment(x, k, extras=extras))), case
    # the price of a round reaches the solver
    priced = GroupBalance(group, balanced_assignment, round_bytes=3e6)
    with mock.patch("moe.parallel.global_base.price_balanced_assignment", wraps=price_balanced_assignment) as solve:
        assert torch.equal(same_order(priced(mine, k, extras=extras)), same_order(prices(mine, k, extras=extras)))
    assert [c.kwargs["round_bytes"] for c in solve.call_args_list] == [3e6, 0.0]
    # a far start, no update, rows of their slots alone: the certificate's rounds gather new
    # rows (fixed tokens that fail) from several ranks and send rows again (short of a column,
    # and every row whole at the last check), each by its key
    sizes = [0 if j == 2 else 60 + 5 * j for j in range(world)]
    x = make_scores(seed + 30, sum(sizes), 24, "gauss")
    far = 0.05 * float((x.amax(1) - x.amin(1)).amax()) * torch.linspace(-1, 1, 24, dtype=torch.float64)
    with mock.patch.object(price_margin, "SENT", 0):
        (got,), _, stats = price_balanced_assignment(split(x, sizes)[me : me + 1], 2, GroupReduce(group), prices=far,
                                                     max_price_iters=0)  # fmt: skip
    first = next(values for kind, values, _ in stats.log if kind == "gather")  # the margin's rows, in bytes
    width = price_rows.RowLayout.of(sum(sizes), 24, 2, x.dtype).width(2, keyed=False)
    assert stats.checks >= 2 and first // width < stats.margin_rows, stats  # rows new to the certificate
    start = sum(sizes[:me])
    assert torch.equal(same_order(got), same_order(balanced_assignment(x, 2)[start : start + sizes[me]])), me
    # with a round priced, each check's counts and first rows in one gather of fixed size (at
    # 2000 bytes a few rows a rank, the rest in a second gather of uneven sizes): the same
    # collectives, prices and assignment as the simulation, and the same assignment as above
    # (and with 2 updates, the margin's first counts with its first rows: its band stands);
    # 500 W bytes a round: one certificate row of 49 bytes ahead a rank at any W
    small = 500.0 * world
    for iters, round_bytes in ((0, 1e9), (0, small), (2, 1e9)):
        opts = dict(prices=far, max_price_iters=iters, round_bytes=round_bytes)
        (got_r,), p_r, stats_r = price_balanced_assignment(split(x, sizes)[me : me + 1], 2, GroupReduce(group), **opts)
        sim, p_sim, sim_stats = price_balanced_assignment(split(x, sizes), 2, ShardReduce(world), **opts)
        ahead = [kind for kind, _, _ in stats_r.log[stats_r.check_from :]]
        assert stats_r.log == sim_stats.log and set(ahead) == {"gather"}, stats_r.log
        if iters == 0:
            assert stats_r.checks >= 2 and (len(ahead) > stats_r.checks) == (round_bytes == small), ahead
        else:  # the margin's first counts came with rows: one sum of them fewer than by bytes alone
            plain = price_balanced_assignment(split(x, sizes), 2, ShardReduce(world), prices=far, max_price_iters=2)[2]
            margin_sums = [
                sum(entry[:2] == ("sum", 24 + world + price_prices.GAP_BINS + 1) for entry in st.log)
                for st in (plain, stats_r)
            ]
            assert margin_sums[1] == margin_sums[0] - 1, (plain.log, stats_r.log)
        assert torch.equal(p_r, p_sim) and torch.equal(got_r, sim[me]), me
        assert torch.equal(same_order(got_r), same_order(got)), me
    # the pair rounds after one update from the previous scores' prices (the local start off:
    # one process has none): the same counts, moves and agreed prices on every rank as one
    # process solving the stacked problem
    sizes = [0 if j == 1 else 80 + 9 * j for j in range(world)]
    before, x = flat_scores(seed + 40, sum(sizes), 8)
    _, p0, _ = price_balanced_assignment([before], 2, ShardReduce(1))
    with mock.patch.object(price_base, "pair_rounds_pay", lambda *a: True):  # they run whatever they cost
        (got,), p_got, stats = price_balanced_assignment(split(x, sizes)[me : me + 1], 2, GroupReduce(group),
                                                         prices=p0, max_price_iters=1, local_start=False)  # fmt: skip
        (one,), p_one, one_stats = price_balanced_assignment([x], 2, ShardReduce(1), prices=p0, max_price_iters=1)
    assert stats.price_updates == one_stats.price_updates == 1 + price_prices.PAIR_ROUNDS + 2
    start = sum(sizes[:me])
    assert torch.equal(p_got, p_one) and torch.equal(got, one[start : start + sizes[me]]), me
    assert torch.equal(same_order(got), same_order(balanced_assignment(x, 2)[start : start + sizes[me]])), me
    # a cold call's local start: every rank's own solve, one gather of their prices (NaN from
    # the empty rank) and the same median, so the same prices and assignment as the simulation
    (got,), p_got, stats = price_balanced_assignment(split(x, sizes)[me : me + 1], 2, GroupReduce(group))
    sim, p_sim, sim_stats = price_balanced_assignment(split(x, sizes), 2, ShardReduce(world))
    assert ("gather", world * 8, world * 8 * 4) in stats.log and stats.rounds == sim_stats.rounds, stats
    assert torch.equal(p_got, p_sim) and torch.equal(got, sim[me]), me
    # a warm call from far prices, stalling after two updates: every rank's own prices ride on
    # the first update's sum (the empty rank's NaN among them) and both chains run; the same
    # collectives, kept chain, prices and assignment as the simulation
    far = p_sim + 0.03 * float((x.amax(1) - x.amin(1)).amax()) * torch.linspace(-1, 1, 8, dtype=torch.float64)
    with mock.patch.object(price_prices, "STALL", 0.0):
        mine = split(x, sizes)[me : me + 1]
        (got,), p_got, stats = price_balanced_assignment(mine, 2, GroupReduce(group), prices=far)
        sim, p_sim, sim_stats = price_balanced_assignment(split(x, sizes), 2, ShardReduce(world), prices=far)
    assert stats.log == sim_stats.log and stats.start == sim_stats.start
    assert stats.log[1][1] == price_prices.chain_values(8) + world * 8
    assert torch.equal(p_got, p_sim) and torch.equal(got, sim[me]), me
    bad = make_scores(seed, 10, 8, "gauss")
    if me == world - 1:
        bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match="finite"):
        prices(bad, 1)
    # options that decide which collectives run, differing on one rank: every rank raises (the
    # header agrees on them), where the ranks would have run different collectives
    good = make_scores(seed, 10, 8, "gauss")
    with pytest.raises(ValueError, match=r"same on every rank.*round_bytes from 0 to 1e\+06"):
        price_balanced_assignment([good], 1, GroupReduce(group), round_bytes=1e6 if me == 0 else 0.0)
    with pytest.raises(ValueError, match="the others differ"):
        price_balanced_assignment([good], 1, GroupReduce(group), local_start=me != world - 1)
    got = prices(make_scores(seed, 10, 8, "gauss"), 1)  # the group goes on working
    assert got.shape == (10, 1)


def in_a_backward(fn):
    """``fn()`` while autograd runs a backward, where activation checkpointing re-runs forwards."""
    out = []

    class Rerun(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            out.append(fn())
            return grad

    Rerun.apply(torch.ones(1, requires_grad=True)).sum().backward()
    return out[0]


def check_reruns(group, world: int) -> None:
    """Re-runs after three micro-batches' forwards (a pipeline schedule's order) route as their
    forwards: in the first step solved again from each forward's own start, in the second from
    the routes the forwards kept, with no solve. The scores tie (integers), so the last forward's
    start, the rule before, routes some otherwise. Scores no forward had: a warning, and a solve
    from the last forward's start, on every rank where one rank has none. Re-runs last first,
    with a rank without tokens: each finds its own forward. Ranks that disagree on re-running:
    every rank raises."""
    me = dist.get_rank(group)
    balance = GroupBalance(group, balanced_assignment)
    gen = torch.Generator().manual_seed(7)
    tied = [torch.randint(0, 3, (20 + 7 * me + m, 8), generator=gen).float() for m in range(3)]
    # a call's collectives are the solve's: the header carries the tags (and failure notices)
    with count_collectives() as calls:
        balance(tied[0], 2)
    assert calls == [balance.stats.rounds] and balance.stats.log[0][0] == "max", (calls, balance.stats.log[:1])
    balance = GroupBalance(group, balanced_assignment)
    wrapped = mock.patch("moe.parallel.global_base.price_balanced_assignment", wraps=price_balanced_assignment)
    for step in range(2):
        with wrapped as solve:
            routes = [balance(s, 2) for s in tied]
            starts = [c.kwargs["prices"] for c in solve.call_args_list]
            again = in_a_backward(lambda: [balance(s, 2) for s in tied])
        assert all(torch.equal(a, b) for a, b in zip(again, routes, strict=True)), (step, me)
        reruns = [c.kwargs["prices"] for c in solve.call_args_list[3:]]
        if step == 0:
            assert len(reruns) == 3 and all(a is b for a, b in zip(reruns, starts, strict=True)), step
        else:
            assert reruns == [], step
        assert len(balance._kept) == 0, step  # each re-run takes its forward's entry
    # re-runs last first (one backward of summed losses), rank 0 without tokens in both
    # micro-batches and rank 1 with the same scores in both (W > 2): the group's fingerprints
    # find each re-run's own forward on every rank
    reverse = GroupBalance(group, balanced_assignment)
    pair = [torch.zeros(0, 8)] * 2 if me == 0 else [tied[0]] * 2 if me == 1 and world > 2 else tied[:2]
    for step in range(2):
        routes2 = [reverse(s, 2) for s in pair]
        again = in_a_backward(lambda: [reverse(s, 2) for s in reversed(pair)])[::-1]
        assert all(torch.equal(a, b) for a, b in zip(again, routes2, strict=True)), (step, me)
    others = sum(
        not torch.equal(price_balanced_assignment([s], 2, GroupReduce(group), prices=starts[-1])[0][0], r)
        for s, r in zip(tied[:2], routes[:2], strict=True)
    )
    others = torch.tensor(others)
    dist.all_reduce(others, group=group)
    assert others > 0, "the scores must tie: the last forward's start routes the same"
    balance(tied[0], 2)
    last = balance._start
    with pytest.warns(RuntimeWarning, match="match none"), wrapped as solve:
        in_a_backward(lambda: balance(tied[1], 2))
    assert solve.call_args.kwargs["prices"] is last
    # a forward's scores found on one rank alone: every rank solves, from the last start
    balance(tied[0], 2)
    last = balance._start
    with pytest.warns(RuntimeWarning, match="match none"), wrapped as solve:
        in_a_backward(lambda: balance(tied[0] if me == 0 else tied[1], 2))
    assert solve.call_args.kwargs["prices"] is last
    with pytest.raises(ValueError, match="disagree on whether this call is an activation-checkpointing re-run"):
        if me == 0:
            in_a_backward(lambda: balance(tied[0], 2))
        else:
            balance(tied[0], 2)
    assert balance(tied[2], 2).shape == (tied[2].shape[0], 2)  # the group goes on working


def worker(rank: int, world: int, store: str) -> None:
    init(rank, world, store)
    check_group(dist.group.WORLD, world, rank, seed=10)
    check_reruns(dist.group.WORLD, world)
    if world == 4:  # the two-rank groups, in the same launch
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        check_group(pairs[rank // 2], 2, rank, seed=20 + rank // 2)
    red = GroupReduce()
    assert red.world == world and red.ranks == [rank]
    dist.destroy_process_group()


def test_gloo_two_and_four_ranks():
    spawn(worker, 4)


@pytest.mark.slow
def test_gloo_eight_ranks():
    spawn(worker, 8)
