"""Global BASE without gathering the scores: the exact balanced assignment over every rank's
tokens, agreed through the experts' prices and the few tokens at their margin.

Legend: W ranks, T tokens of one shard (N over the group), E experts, K experts per token,
M margin rows (tokens near a boundary under the prices).

The problem is the one `moe.routing.balanced.balanced_assignment` solves on the stacked scores
(N, E): the same normalisation (every token's best at 0, divided by the group's largest range,
the same jitter at the same global token index), the same capacities and ``extras`` rule, the
same exchange cycles and certificate. Each rank keeps its rows; per call they agree on:

1. a header (one max of 8 + 3W values): shapes, dtypes, which ranks' scores are invalid or not
   finite, the token counts, the scale. A bad input on one rank raises on every rank;
2. the prices: from a previous call's, or, without them, from a local start: every rank solves
   its own tokens alone (no collective) and one gather of W x E float32 gives every rank the
   per-expert median of those prices (a rank's tokens are a sample of the group's; the median
   keeps one rank's outlying price off the start). Then damped Jacobi updates, one sum of
   E x 18 int32 counts each (`price_prices`), until the loads miss the capacities by at most
   E slots in all, or at most 40 updates from zero prices and 20 from given ones, a previous
   call's or the local start's (`PRICE_ITERS`); from given ones, also once two updates have
   taken less than a fifth off the miss (stalled: a trained router's scores, where each
   further update buys little and costs a round). Where those (warm) updates stall or reach
   their cap, 3 pair rounds follow (`price_prices.pair_prices`) when their E x E x 4
   int32 counts (and their 4 rounds, at ``round_bytes`` each where given) cost less than the
   eighth of the tokens the margin would otherwise hold: the
   tokens counted by the pair of experts they stand between and their margin, from which
   every rank moves the prices alike; one max of the prices and the last move then agrees
   on their bits;
3. the margin: every token picks its K best under the prices; those whose K-th choice is
   ahead of the next by less than a band are margin rows, the rest are fixed. The band is the
   last price move (what the prices are known to), at least 1e-6. One sum of E + W + 33 values
   (the fixed tokens' loads, the margin rows per rank, every token counted by its margin in
   bins growing 2x) and one gather of the margin rows give every rank the same residual
   problem, which each solves the same way: the greedy fill into the room the fixed tokens
   leave, then exchange cycles (`moe.routing.exchange`). A row carries the token's K + 3 best
   experts under the prices, its slots first, not all E, and travels as bytes: the experts
   (uint8 up to 256) and their fp32 scores, 5 (K + 3) bytes against K + 4E for every column
   (`RowLayout`), and no index: the rows come in rank order, and each rank knows which of its
   tokens it sent; the other columns count as ``UNSENT``, below every score. Fewer than 2E
   rows in the band widen it first, to the bin edge with enough below it (one more sum): so
   thin a margin leaves the cycles too few moves to take up the loads' last misses, the
   certificate's prices move far from the picks' and many fixed tokens fail. Where the price
   updates reach their cap or stall and no pair rounds follow, the prices are further off
   than their last move says, and the margin holds at least an eighth of the tokens
   (`CAPPED_SHARE`). Each expert has its own band, which a token takes at the widest of
   its slots': where the fixed tokens overfill experts, their bands alone grow 4x (one more
   sum each), so a cluster of near-equal tokens on the wrong side of one boundary widens
   that boundary, not every token's. Where the fill finds no completion, or the cycles on the
   gathered rows alone (no collective; the certificate's first round reuses them) leave a
   row on a column it did not carry, every band grows 4x: such rows cannot fill some
   experts on their own columns, the certificate's prices for those fall far below the
   picks' and many fixed tokens fail. The latter only while more fixed tokens would fail
   against those prices than a 4x band would add (one sum of 2 values), else the
   certificate takes the failing ones. A wider band sends only the tokens it adds (the
   prices, and so a token's row, stay), one gather each;
4. the certificate: the cycles' final distances are prices under which no margin row can gain
   on the columns it carries. Every rank checks its fixed tokens against them, and its margin
   rows on the columns they do not carry (one sum of 2W values); a fixed token that fails
   joins the margin rows with its slots, a margin row that fails travels again with its K + 3
   best columns under the new prices, added to those it carried (one gather for both, each
   row keyed by its place among the gathered rows, -1 for a new one: 4 bytes more), and
   the cycles go on. When none fails, no cycle over the whole group
   gains more than the tolerance: the optimality condition of the transportation problem, as
   in the single-process solver (docs/routing.md).

Every step is a deterministic function of summed integers, maxima and gathered rows, so every
rank computes the same result. Every loop is bounded: the bands grow geometrically to the
whole problem (then the residual is the gathered problem), each certificate round adds a row
or a column a row did not carry (one of its K + 3 best under the new prices beats what it
holds, and the carried ones passed), and after `LAST_CHECK` rounds every row travels whole.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..routing.balanced import _Capacities, _check, _check_extras, _fill, _jitter_pattern, _sub_transposed
from ..routing.config import check_float
from ..routing.exchange import _Graph, held_mask, violations
from .price_prices import capacities, jacobi_prices, pair_prices, pair_rounds_pay
from .price_rows import SENT, UNSENT, RowLayout, margin_row_bytes, pack_rows, unpack_rows
from .reduction import Reduction, ShardReduce

__all__ = ["PriceStats", "price_balanced_assignment"]

_DTYPES = {torch.float32: 1, torch.float64: 2}
BAND = 1.0  # the first margin band, in units of the last price move
MIN_BAND = 1e-6
MIN_ROWS = 2  # per expert: a thinner margin leaves the cycles too few moves, and many fixed tokens fail
CAPPED_SHARE = 1 / 8  # of the tokens, at least, at the margin when the price updates reach their cap or stall
PRICE_ITERS = (40, 20)  # the cap on the price updates, cold and warm started
LAST_CHECK = 63  # certificate rounds before every row travels with every column (the whole problem)
GAP_BINS = 32  # the margin's counts also count the tokens by margin, in bins growing 2x from MIN_BAND


@dataclass
class PriceStats:
    """What one solve cost: collectives, values received per rank, rows that travelled."""

    rounds: int = 0
    values: int = 0
    bytes: int = 0
    margin_rows: int = 0  # rows gathered onto every rank (the margin and the certificate's)
    price_updates: int = 0  # collectives that moved the prices: Jacobi updates, pair rounds and their max
    cycles: int = 0
    checks: int = 0  # certificate rounds
    log: list = field(default_factory=list)


def _header(parts_TE: list[Tensor], k: int, red: Reduction) -> tuple[list[int], float, float, torch.dtype]:
    """Agree on the shapes, dtypes, validity, token counts and scale: (sizes, big, half, dtype)."""
    world, n_fixed = red.world, 8
    rows, errors = [], {}
    for rank, scores in zip(red.ranks, parts_TE, strict=True):
        h = torch.zeros(n_fixed + 3 * world, dtype=torch.float64)
        try:
            _check(scores, k)
        except ValueError as err:
            errors[rank] = err
            h[n_fixed + rank] = 1
            rows.append(h)
            continue
        dtype = torch.promote_types(scores.dtype, torch.float32)
        num_tokens, num_experts = scores.shape
        h[:6] = torch.tensor([num_experts, -num_experts, k, -k, _DTYPES[dtype], -_DTYPES[dtype]], dtype=torch.float64)
        if num_tokens:
            lo, hi = scores.amin(dim=1).to(dtype), scores.amax(dim=1).to(dtype)
            big, half = torch.stack([torch.maximum(hi.abs(), lo.abs()).amax(), (hi * 0.5 - lo * 0.5).amax()]).tolist()
            if big != big or abs(big) == float("inf"):
                h[n_fixed + 2 * world + rank] = 1
            else:
                h[6], h[7] = big, half
        h[n_fixed + world + rank] = num_tokens
        rows.append(h)
    device = next((p.device for p in parts_TE if isinstance(p, Tensor)), torch.device("cpu"))
    out = red.max([h.to(device) for h in rows]).cpu()
    bad, sizes, nonfinite = (out[n_fixed + i * world : n_fixed + (i + 1) * world] for i in range(3))
    if bad.any():
        if errors:
            raise next(iter(errors.values()))
        raise ValueError(f"the scores on ranks {bad.nonzero().flatten().tolist()} of the group are invalid (see there)")
    if out[0] != -out[1] or out[2] != -out[3] or out[4] != -out[5]:
        raise ValueError(
            f"the scores must have the same E, k and dtype on every rank of the group: E from {int(-out[1])} "
            f"to {int(out[0])}, k from {int(-out[3])} to {int(out[2])}"
        )
    if nonfinite.any():
        raise ValueError(f"scores must be finite: found NaN or Inf on ranks {nonfinite.nonzero().flatten().tolist()}")
    dtype = {v: d for d, v in _DTYPES.items()}[int(out[4])]
    return [int(n) for n in sizes.tolist()], float(out[6]), float(out[7]), dtype


def _normalise(parts_TE, red, sizes, big, half, dtype, jitter) -> tuple[list[Tensor], list[int], float]:
    """Each shard as `moe.routing.balanced.inputs._normalise` would do it within the stacked
    problem: (E, T) with the group's scale and the jitter at the global token index. Returns
    (the shards, their first global index, the scores' units in one of theirs: 0 where every
    token's scores are all equal, which the jitter alone orders)."""
    starts = [sum(sizes[:r]) for r in red.ranks]
    xs, los, his = [], [], []
    for x in parts_TE:
        xs.append(x)
        los.append(x.amin(dim=1).to(dtype) if x.shape[0] else x.new_zeros(0, dtype=dtype))
        his.append(x.amax(dim=1).to(dtype) if x.shape[0] else x.new_zeros(0, dtype=dtype))
    scale, unit = 2 * half, 1.0
    if big > 1e30 or 0 < big < 1e-30:  # differences could overflow or underflow: to [-1, 1] first
        xs = [x.to(dtype) / big for x in xs]
        los, his = [lo / big for lo in los], [hi / big for hi in his]
        local = [(hi - lo).amax() if hi.numel() else hi.new_zeros(()) for lo, hi in zip(los, his, strict=True)]
        scale = float(red.max([v.reshape(1) for v in local]))
        unit = big
    out = []
    for x, hi, start in zip(xs, his, starts, strict=True):
        s = _sub_transposed(x, hi, x.new_empty(x.shape[::-1], dtype=dtype))
        if scale > 0:
            s.div_(scale)
        if jitter > 0:
            s.add_(_jitter_pattern(s.shape[0], s.shape[1], dtype, s.device, first=start), alpha=jitter)
        out.append(s)
    return out, starts, unit * scale  # 0: every token's scores equal, only the jitter to solve


def price_balanced_assignment(
    parts_TE: list[Tensor],
    k: int,
    red: Reduction,
    *,
    extras: str = "best",
    eps: float = 1e-6,
    prices: Tensor | None = None,
    max_price_iters: int | None = None,
    max_cycles: int | None = None,
    local_start: bool = True,
    round_bytes: float = 0.0,
) -> tuple[list[Tensor], Tensor | None, PriceStats]:
    """The exact balanced assignment of the stacked problem, each shard keeping its rows.

    Args:
        parts_TE: the local shards' scores, one (T, E) tensor per rank in ``red.ranks``.
        k, extras, eps: as in `balanced_assignment` (the same capacities, tolerance, jitter).
        red: the collectives (`GroupReduce` over a process group, `ShardReduce` in one process).
        prices: (E,) a previous call's prices to start from (the returned ones), or None. They
            are in the scores' units, so they hold when the group's scale (the largest
            per-token range, which one token sets) changes between calls.
        max_price_iters: cap on the price updates (each one collective); None: `PRICE_ITERS`, 40 from
            zero prices and 20 from given ones. Where the cap is reached, or the updates from
            given prices stall (`price_prices.STALL`), the margin holds at least `CAPPED_SHARE`
            of the tokens.
        max_cycles: cap on the exchange cycles; None allows N * K + E.
        local_start: without ``prices`` and on more than one rank, start from the per-expert
            median of every rank's prices for its own tokens alone (`_local_start`: one gather
            of W x E float32, and a solve of the local tokens); False: from zero prices.
        round_bytes: what one more round of collectives costs, as the bytes a rank receives in
            the time of its latency (e.g. 50 us at 25 GB/s: 1.25e6); the pair rounds run only
            where their bytes and rounds at this price cost less than the wide margin they
            spare (`price_prices.pair_rounds_pay`). 0: bytes alone, the least traffic.
            ``prices`` given or not, ``local_start``, ``max_price_iters`` and ``round_bytes``
            must be the same on every rank (`GroupBalance` keeps them so): they decide which
            collectives run.

    Returns (expert_idx (T, K) int64 per shard, the final prices (E,) float64 in the scores'
    units (mean zero; zeros where every token's scores are all equal), or None when there was
    nothing to solve or the scores' range exceeds float64's, the costs). The result is the
    same on every rank, exactly balanced over the group, and within the single-process
    solver's bound of the optimum.
    """
    _check_extras(extras)
    check_float("round_bytes", round_bytes, 0)
    stats = PriceStats()
    rounds0, values0, bytes0 = red.rounds, red.values, red.bytes
    sizes, big, half, dtype = _header(parts_TE, k, red)
    total = sum(sizes)
    num_experts = parts_TE[0].shape[1]
    device = parts_TE[0].device
    if total == 0 or k == num_experts:
        res = [torch.arange(k, device=device).expand(x.shape[0], k).clone() for x in parts_TE]
        return res, None, _finish(stats, red, rounds0, values0, bytes0)
    with torch.inference_mode():
        s_parts, starts, unit = _normalise(parts_TE, red, sizes, big, half, dtype, eps / 2)
        caps = _Capacities(total, num_experts, k, extras, device)
        # the same on every rank: the scale is agreed (0: only the jitter to solve; beyond
        # float64's range, fp64 scores spanning it: prices in their units would not be finite)
        units_ok = 0 < unit < float("inf")
        start = prices.to(torch.float64) / unit if prices is not None and units_ok else None
        if prices is None and units_ok and local_start and red.world > 1:
            start = _local_start(parts_TE, k, red, extras, eps, unit, max_cycles)
        if max_price_iters is None:
            max_price_iters = PRICE_ITERS[start is not None]
        p, stats.price_updates, width, converged = jacobi_prices(
            s_parts, caps, k, red, start, max_iters=max_price_iters, tol=num_experts
        )
        row = margin_row_bytes(total, num_experts, k, dtype)
        if (
            start is not None
            and not converged
            and max_price_iters > 0
            and pair_rounds_pay(num_experts, CAPPED_SHARE * total * row, round_bytes)
        ):
            # warm, stalled or capped: the pair rounds cost less than the wide margin they spare
            # (their windows suit a previous call's prices, a few 1e-3 off; the cold updates'
            # slow modes are further, and there they widened the margin)
            p, n, width = pair_prices(s_parts, caps, k, red, p)
            stats.price_updates += n
            converged = True
        cap = capacities(caps, p)
        delta = max(eps, 8 * torch.finfo(dtype).eps)
        budget = total * k + num_experts if max_cycles is None else max_cycles
        # capped or stalled: the prices are further off than their last move
        min_rows = min(max(MIN_ROWS * num_experts, 0 if converged else int(CAPPED_SHARE * total)), total)
        out, p_final, ok = _solve_margin(
            s_parts, starts, sizes, p, cap, caps, k, red, delta, budget, width, min_rows, stats
        )
        if not ok:
            warnings.warn(
                f"price_balanced_assignment: the exchange-cycle budget (max_cycles={budget}) ran out before the "
                "optimality certificate passed; the assignment is balanced but may be suboptimal",
                RuntimeWarning,
                stacklevel=2,
            )
    p_out = p_final * unit if units_ok else torch.zeros_like(p_final) if unit == 0 else None
    return [o.clone() for o in out], p_out, _finish(stats, red, rounds0, values0, bytes0)


def _local_start(
    parts_TE: list[Tensor], k: int, red: Reduction, extras: str, eps: float, unit: float, max_cycles: int | None = None
):
    """Prices to start a call without a previous one from (E,) float64 in the normalised units,
    or None: every rank solves its own tokens alone, exactly (this solver on one rank: no
    collective), and one gather of their prices (W x E float32, NaN from a rank with nothing
    to solve) gives every rank the same per-expert median. The median, not the mean: one rank
    whose tokens crowd onto an expert would move that expert's start far off (docs/parallel.md,
    "Local start")."""
    num_experts = parts_TE[0].shape[1]
    rows = []
    for scores in parts_TE:
        mine = None
        if scores.shape[0]:
            with warnings.catch_warnings():  # a start only: a capped local solve changes nothing
                warnings.simplefilter("ignore", RuntimeWarning)
                _, mine, _ = price_balanced_assignment(
                    [scores], k, ShardReduce(1), extras=extras, eps=eps, max_cycles=max_cycles
                )
        if mine is None:
            mine = torch.full((num_experts,), float("nan"), dtype=torch.float64)
        # in the group's normalised units before float32: fp64 scores beyond its range stay finite
        rows.append((mine / unit).to(scores.device, torch.float32)[None])
    agreed = torch.nanmedian(red.gather(rows, [1] * red.world).cpu().to(torch.float64), dim=0).values
    return agreed if bool(agreed.isfinite().all()) else None


def _finish(stats, red, rounds0, values0, bytes0) -> PriceStats:
    stats.rounds, stats.values = red.rounds - rounds0, red.values - values0
    stats.bytes = red.bytes - bytes0
    stats.log = red.log[-stats.rounds :] if stats.rounds else []
    return stats


def _pick(s_ET: Tensor, p_E1: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Each token's K best experts under the prices (T, K) and its margin over the next (T,)."""
    vals, idx = torch.topk(s_ET - p_E1, k + 1, dim=0)
    return idx[:k].T.contiguous(), vals[k - 1] - vals[k]


def _solve_margin(s_parts, starts, sizes, p, cap, caps, k, red, delta, budget, width, min_rows, stats):
    """Steps 3 and 4 of the module docstring, the band widened to hold at least ``min_rows``
    tokens. Returns (slots per shard, prices, certified)."""
    num_experts = s_parts[0].shape[0]
    dtype = s_parts[0].dtype
    world = red.world
    p1 = p.to(dtype)[:, None]
    picks = [_pick(s, p1, k) for s in s_parts]
    cols = min(num_experts, k + SENT)
    lay = RowLayout.of(sum(sizes), num_experts, k, dtype)
    band = torch.full((num_experts,), max(BAND * width, MIN_BAND), dtype=torch.float64)  # per expert held
    edges = MIN_BAND * 2.0 ** torch.arange(GAP_BINS, dtype=torch.float64)  # the last is far above 4
    extra = (cap.cpu() > caps.base).numpy() if caps.movable else None
    # the rows gathered so far: a wider band sends only the tokens it adds (the prices, and so
    # a token's row, stay), each gather a block in rank order after the ones before
    s_res = torch.empty(num_experts, 0, dtype=lay.score)
    had = [torch.zeros_like(m, dtype=torch.bool) for _, m in picks]
    had_sizes = [0] * world
    mine = [([], [], []) for _ in s_parts]  # per shard: its tokens sent, their rows, their columns
    while True:  # the bands grow until the fixed tokens leave room the margin rows can fill
        last = bool((band > 4.0).all())  # past 4 every token is at the margin: the whole problem
        near = [_in_band(out, m, band) if not last else torch.ones_like(m, dtype=torch.bool) for out, m in picks]
        counts = []
        for rank, (out, m), nr in zip(red.ranks, picks, near, strict=True):
            c = torch.zeros(num_experts + world + GAP_BINS + 1, dtype=torch.int64, device=out.device)
            c.index_add_(0, out[~nr].flatten(), torch.ones_like(out[~nr].flatten()))
            c[num_experts + rank] = int(nr.sum())
            by_gap = torch.bucketize(m, edges.to(m.device, m.dtype), right=True)  # i: below edges[i], not below i-1
            c[num_experts + world :] = torch.bincount(by_gap, minlength=GAP_BINS + 1)
            counts.append(c)
        summed = red.sum(counts).cpu()
        room = cap.cpu() - summed[:num_experts]
        m_sizes = summed[num_experts : num_experts + world].tolist()
        if sum(m_sizes) < min_rows and not last:  # to the first edge with enough rows below it: one more count
            below = summed[num_experts + world : num_experts + world + GAP_BINS].cumsum(0)
            band.clamp_(min=float(edges[min(int((below < min_rows).sum()), GAP_BINS - 1)]))  # far prices: past 4
            continue
        if not bool((room >= 0).all()):  # the fixed tokens overfill these experts: their bands grow
            band[room < 0] *= 4
            continue
        new_sizes = [m - h for m, h in zip(m_sizes, had_sizes, strict=True)]  # the bands only grow
        if sum(new_sizes):
            added = [(nr & ~h).nonzero().flatten() for nr, h in zip(near, had, strict=True)]
            made = [
                pack_rows(s, p1, out, lc, None, cols, lay)
                for s, (out, _), lc in zip(s_parts, picks, added, strict=True)
            ]
            rows = red.gather([r for r, _ in made], new_sizes).cpu()
            for rank, lc, (_, got), (lcs, at, gots) in zip(red.ranks, added, made, mine, strict=True):
                first = s_res.shape[1] + sum(new_sizes[:rank])
                lcs.append(lc)
                at.append(torch.arange(first, first + lc.numel()))
                gots.append(got)
            s_res = torch.cat([s_res, unpack_rows(rows, lay, cols, keyed=False)[2]], 1)
            had, had_sizes = near, m_sizes
        slots = torch.full((s_res.shape[1], k), -1, dtype=torch.int64)
        try:
            _fill(s_res, slots, room, p.to(dtype).cpu())
        except RuntimeError as err:  # no completion with these fixed tokens: a wider band
            if last:  # impossible
                raise AssertionError("price_balanced_assignment: the whole problem could not be filled") from err
            band *= 4
            continue
        # the cycles on the gathered rows alone (no collective); the certificate's first round
        # reuses them. Where a row still holds a column it did not carry, the rows cannot fill
        # some experts on their own columns: the certificate's prices for those would fall far
        # below the picks' and most fixed tokens would fail (docs/benchmarks.md, "The
        # far-expert failure, traced"). A wider band brings the rows that can, where it sends
        # fewer than the fixed tokens that would fail.
        # the search starts from the prices the fixed tokens were picked under, so the
        # certificate's prices rise from them only where a margin row's move needs it and few
        # fixed tokens can fail (from the searches' own distances, warm started at W=16, a
        # thousand did)
        start = p.cpu().numpy().astype(s_res.numpy().dtype)
        alone = _graph(s_res, slots, delta, extra)
        cancelled = alone.cancel(budget, start)
        if (
            last
            or not _holds_unsent(s_res, torch.from_numpy(alone.out))
            or _fails_fewer(s_parts, picks, near, band * 4, torch.from_numpy(cancelled[2]).to(dtype), red, delta)
        ):
            break
        band *= 4
    # which residual row each local token is (-1: fixed), and the global index of each
    # residual row that a local shard sent (-1: another rank's, which this one never writes)
    ids = torch.full((s_res.shape[1],), -1, dtype=torch.int64)
    at_row = [torch.full(nr.shape, -1, dtype=torch.int64, device=nr.device) for nr in near]
    sent = []  # per shard: the columns its gathered rows carry
    for s, ar, st, (lcs, at, gots) in zip(s_parts, at_row, starts, mine, strict=True):
        lc, at = torch.cat(lcs), torch.cat(at)
        ar[lc] = at.to(lc.device)
        ids[at] = lc.cpu() + st
        sent.append(_Sent(s.shape[1], num_experts, s.device))
        sent[-1].set(lc, torch.cat(gots, 1))
    stats.margin_rows = ids.numel()
    fixed = [(~nr) for nr in near]
    outs = [out.clone() for out, _ in picks]
    applied, ok = 0, False
    graph = alone
    for check in range(LAST_CHECK + 2):  # each round adds a row or a column; at LAST_CHECK, every row whole
        if check:
            graph = _graph(s_res, slots, delta, extra)
            cancelled = graph.cancel(budget - applied, start)
        done, n, dist = cancelled
        applied, start = applied + n, dist
        slots = torch.from_numpy(graph.out)
        stats.cycles, stats.checks = applied, check + 1
        prices = torch.from_numpy(dist).to(torch.float64)
        if not done:
            break
        _write(outs, ids, slots, starts, sizes, red)
        q = prices.to(dtype).to(s_parts[0].device)
        bad, short = [], []  # fixed tokens that fail; gathered rows whose missing columns fail
        for s, out, fx, sn in zip(s_parts, outs, fixed, sent, strict=True):
            local = fx.nonzero().flatten()
            part = (~fx).nonzero().flatten()  # the gathered rows: those that lack a column
            part = part[~sn.of(part).all(0)]
            if check == LAST_CHECK:
                bad.append(local)
                short.append(part)
                continue
            bad.append(local[violations(s.index_select(1, local), q, out.index_select(0, local), delta)])
            short.append(part[_short(s.index_select(1, part), q, out.index_select(0, part), sn.of(part), delta)])
        counts = []
        for rank, b, sh in zip(red.ranks, bad, short, strict=True):
            c = torch.zeros(2 * world, dtype=torch.int64, device=b.device)
            c[rank], c[world + rank] = b.numel(), sh.numel()
            counts.append(c)
        summed = red.sum(counts).cpu()
        b_sizes = (summed[:world] + summed[world:]).tolist()
        if sum(b_sizes) == 0:
            ok = True
            break
        width = num_experts if check == LAST_CHECK else cols  # under the new prices; a short row adds columns
        made = [  # a new row keyed -1, a short one by its residual row; their best under the new prices
            pack_rows(s, q[:, None], out, torch.cat([b, sh]), torch.cat([torch.full_like(b, -1), ar[sh]]), width, lay)
            for s, out, b, sh, ar in zip(s_parts, outs, bad, short, at_row, strict=True)
        ]
        more = red.gather([r for r, _ in made], b_sizes).cpu()
        again, new_slots, new_s = unpack_rows(more, lay, width)
        old = again >= 0
        added = ids.numel() + torch.cumsum(~old, 0) - 1  # where each new row goes
        ids = torch.cat([ids, torch.full((int((~old).sum()),), -1, dtype=torch.int64)])
        for rank, fx, sn, b, sh, ar, st, (_, got) in zip(
            red.ranks, fixed, sent, bad, short, at_row, starts, made, strict=True
        ):
            fx[b] = False
            sn.set(torch.cat([b, sh]), got)
            first = sum(b_sizes[:rank])  # this rank's new rows lead its block
            rows_b = added[first : first + b.numel()]
            ar[b] = rows_b.to(ar.device)
            ids[rows_b] = b.cpu() + st
        # their slots are the ones held already; the columns they carried before stay
        s_res[:, again[old]] = torch.where(new_s[:, old] == UNSENT, s_res[:, again[old]], new_s[:, old])
        new = ~old
        slots = torch.cat([slots, new_slots[new]])
        s_res = torch.cat([s_res, new_s[:, new]], 1)
        if extra is not None:
            extra = graph.extra
        stats.margin_rows = ids.numel()
    _write(outs, ids, slots, starts, sizes, red)
    shift = prices - prices.mean()
    return outs, shift, ok


def _in_band(out_TK: Tensor, margin_T: Tensor, band_E: Tensor) -> Tensor:
    """(T,) bool: the tokens whose margin is below the band of the widest of their slots'."""
    return margin_T < band_E.to(margin_T.device, margin_T.dtype)[out_TK].amax(1)


def _graph(s_res: Tensor, slots_MK: Tensor, delta: float, extra) -> _Graph:
    """The exchange-cycle graph of the gathered rows, on copies of their slots and of the
    movable extra slots (the search writes both)."""
    return _Graph(s_res.numpy(), slots_MK.numpy().copy(), delta, None if extra is None else extra.copy())


def _fails_fewer(s_parts, picks, near, wider: Tensor, q_E: Tensor, red, delta: float) -> bool:
    """Whether fewer fixed tokens fail against the prices ``q`` than a band of ``wider``
    would add to the margin (one sum of 2 values): the cheaper of the two to send."""
    counts = []
    for s, (out, m), nr in zip(s_parts, picks, near, strict=True):
        local = (~nr).nonzero().flatten()
        fails = violations(s.index_select(1, local), q_E.to(s.device), out.index_select(0, local), delta).numel()
        adds = int(_in_band(out, m, wider).sum()) - int(nr.sum())
        counts.append(torch.tensor([fails, adds], dtype=torch.int64, device=s.device))
    fails, adds = red.sum(counts).tolist()
    return fails <= adds


def _holds_unsent(s_res: Tensor, slots_MK: Tensor) -> bool:
    """Whether a gathered row holds a column it did not carry (``UNSENT``)."""
    held = slots_MK.clamp(min=0)
    return bool(((s_res.gather(0, held.T) == UNSENT) & (slots_MK.T >= 0)).any())


class _Sent:
    """The columns one shard's gathered rows carry: (E, n) bool for its n gathered tokens, kept
    for those alone (a (E, T) mask would cost a quarter of the float32 scores)."""

    def __init__(self, num_tokens: int, num_experts: int, device) -> None:
        self.at = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)  # column in cols, or -1
        self.cols = torch.zeros(num_experts, 0, dtype=torch.bool, device=device)

    def set(self, local: Tensor, got_En: Tensor) -> None:
        """Tokens ``local`` (distinct) carry the columns ``got`` too."""
        new = local[self.at[local] < 0]
        n = self.cols.shape[1]
        self.at[new] = torch.arange(n, n + new.numel(), device=self.at.device)
        self.cols = torch.cat([self.cols, self.cols.new_zeros(self.cols.shape[0], new.numel())], 1)
        self.cols[:, self.at[local]] |= got_En

    def of(self, local: Tensor) -> Tensor:
        """(E, n): the columns gathered tokens ``local`` carry."""
        return self.cols[:, self.at[local]]


def _short(s_ET: Tensor, q_E: Tensor, out_TK: Tensor, sent_ET: Tensor, delta: float) -> Tensor:
    """Which gathered rows the certificate cannot pass on the columns they carry: a slot at a
    column not carried, or a column not carried that beats the worst slot by more than
    ``delta`` under the prices ``q`` (the carried ones passed in the cycles)."""
    a = s_ET - q_E.view(-1, 1)
    held = held_mask(out_TK, s_ET.shape[0])
    worst_held = torch.where(held, a, float("inf")).amin(dim=0)
    best_missing = torch.where(sent_ET, float("-inf"), a).amax(dim=0)
    return torch.nonzero((held & ~sent_ET).any(0) | (best_missing - worst_held > delta)).flatten()


def _write(outs, ids, slots, starts, sizes, red) -> None:
    """The gathered rows' slots into each shard's assignment."""
    for rank, out, start in zip(red.ranks, outs, starts, strict=True):
        mine = (ids >= start) & (ids < start + sizes[rank])
        if bool(mine.any()):
            out[ids[mine] - start] = slots[mine].to(out.device)
