"""Global BASE without gathering the scores: the exact balanced assignment over every rank's
tokens, agreed through the experts' prices and the few tokens at their margin.

Legend: W ranks, T tokens of one shard (N over the group), E experts, K experts per token,
M margin rows (tokens near a boundary under the prices).

The problem is the one `moe.routing.balanced.balanced_assignment` solves on the stacked scores
(N, E): the same normalisation (every token's best at 0, divided by the group's largest range,
the same jitter at the same global token index), the same capacities and ``extras`` rule, the
same exchange cycles and certificate. Each rank keeps its rows; per call they agree on:

1. a header (`agree`, one max of 16 + 3W values): shapes, dtypes, the options that decide
   which collectives run (``round_bytes``, ``prices`` given or not, ``local_start``,
   ``max_price_iters``, ``extras``, ``eps``, ``max_cycles``), each rank's status (its scores
   invalid, its failure before the solve, or a caller's tag), which ranks' scores are not
   finite, the token counts, the scale. A bad input or differing options on one rank raise on
   every rank. A caller may run it first (`GroupBalance`: its layer's only status collective
   before routing) and pass it in;
2. the prices: from a previous call's, or, without them, from a local start: every rank solves
   its own tokens alone (no collective) and one gather of W x E float32 gives every rank the
   per-expert median of those prices (a rank's tokens are a sample of the group's; the median
   keeps one rank's outlying price off the start). Then damped Jacobi updates, one sum of E x
   18 + 33 int32 counts each (the thresholds' histograms and the tokens by margin; and each
   more chain's, below: `price_prices`), until the loads miss the capacities by at most E
   slots in all, or at most 40 updates from zero prices and 20 from
   given ones, a previous call's or the local start's (`PRICE_ITERS`); from given ones, also
   once two updates have taken less than a fifth off the miss (stalled: a trained router's
   scores, where each further update buys little and costs a round). A warm call runs the local
   start too, without a round of its own: every rank's prices for its own tokens ride on the
   first update's sum (W x E more int32 values, the bits of each rank's float32 row at its
   place and zeros elsewhere, so the sum is every row, bit for bit), and a chain of updates
   from their median runs beside the given prices' from the second update on, its counts in the
   same sums. The updates end once a chain converges or both have stopped, and the solve keeps
   the prices of the one whose loads missed less when last measured (at its prices where it
   stopped early, one move before them where it reached its cap), with its last move as the
   band: a previous call's prices are the optimum of other tokens, and on a trained router's
   scores they can sit further from this call's than the ranks' own solves of it. Where the
   kept updates stall or reach their cap, 3 pair rounds follow (`price_prices.pair_prices`)
   when their E x E x 4 int32 counts (and their 4 rounds, at ``round_bytes`` each where given)
   cost less than the eighth of the tokens the margin would otherwise hold: the tokens counted
   by the pair of experts they stand between and their margin, from which every rank moves the
   prices alike; one max of the prices and the last move then agrees on their bits, and one sum
   of the loads checks them, with the margin's first counts at them (step 3) on it: where the
   loads miss by more than before, they run again with a narrower window, and where no try
   helps the prices stay as they were (at E = 256 they cost more);
3. the margin (`price_margin`): every token picks its K best under the prices; those whose
   K-th choice is ahead of the next by less than a band (the last price move, per expert, grown
   where the fixed tokens overfill an expert or the gathered rows cannot fill one) travel as
   rows of their K + 3 best experts, and every rank solves the same residual problem: the
   fill into the room the fixed tokens leave, then exchange cycles. Where the price updates
   reach their cap or stall and no pair rounds follow (or none lowered the loads' miss), the
   prices are further off than their last move says, and the margin holds at least an
   eighth of the tokens (`CAPPED_SHARE`);
4. the certificate (`price_certificate`): every rank checks its tokens against the cycles' final
   prices; those that could gain travel too, and the cycles go on until none can: the
   optimality condition of the transportation problem, as in the single-process solver
   (docs/routing.md). Where a round is priced (``round_bytes``), each check's counts carry
   its first rows (a round's share of them: `price_rows.ahead_rows`), so a check that
   sends rows takes one round, not two.

Every step is a deterministic function of summed integers, maxima and gathered rows, so every
rank computes the same result. Every loop is bounded: the bands grow geometrically to the
whole problem (then the residual is the gathered problem), each certificate round adds a row
or a column a row did not carry (one of its K + 3 best under the new prices beats what it
holds, and the carried ones passed), and after `price_certificate.LAST_CHECK` rounds every row travels
whole.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..routing.balanced import _Capacities, _check, _check_extras, _jitter_pattern, _sub_transposed, balanced_prices
from ..routing.config import check_float
from .price_certificate import certify
from .price_margin import MarginStart, gather_margin
from .price_prices import capacities, jacobi_prices, pair_prices, pair_rounds_pay
from .price_rows import margin_row_bytes
from .reduction import Reduction

__all__ = ["Header", "PriceStats", "agree", "fail_agreement", "price_balanced_assignment"]

_DTYPES = {torch.float32: 1, torch.float64: 2}
MIN_ROWS = 2  # per expert: a thinner margin leaves the cycles too few moves, and many fixed tokens fail
CAPPED_SHARE = 1 / 8  # of the tokens, at least, at the margin when the price updates reach their cap or stall
PRICE_ITERS = (40, 20)  # the cap on the price updates, cold and warm started


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
    start: str = "zero"  # the prices the updates kept: "given" (a previous call's), "local" or "zero"
    check_from: int = 0  # where in ``log`` the certificate's collectives begin
    log: list = field(default_factory=list)


# each rank's status in the header, in its own slot (so the max is every rank's): its scores
# invalid, it failed before the solve (`fail_agreement`), or fine with the caller's tag
_INVALID, _FAILED, _TAGGED = 1, 2, 3
_N_FIXED = 16  # the header's values before its three blocks of W: E, k, dtype, scale, 4 settings (each +-)


@dataclass(frozen=True)
class Header:
    """What the ranks agreed on before a solve (`agree`)."""

    sizes: list[int]  # every rank's T
    big: float  # the largest |score|
    half: float  # half the largest per-token range
    dtype: torch.dtype  # the solve's
    settings: tuple[float, ...]  # the options that decide which collectives run (`_settings`)
    prices_given: bool  # as declared in them
    tags: list[int]  # every rank's tag (0 where the caller gave none)
    failed: list[int]  # the group ranks that failed before the solve; where any, nothing else is read
    since: tuple[int, int, int]  # the reduction's rounds, values and bytes before it


def _settings(round_bytes, local_start, prices_given, extras, max_price_iters, eps, max_cycles) -> tuple[float, ...]:
    """The options that decide which collectives run, as numbers (the flags and the update cap
    as one): every rank must share them."""
    check_float("round_bytes", round_bytes, 0)
    for name, value in (("max_price_iters", max_price_iters), ("max_cycles", max_cycles)):
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ValueError(f"price_balanced_assignment: {name} must be None or an int >= 0, got {value!r}")
    iters = -1 if max_price_iters is None else max_price_iters
    options = int(local_start) + 2 * bool(prices_given) + 4 * (extras == "lowest") + 8 * (iters + 1)
    return (float(round_bytes), float(options), float(eps), float(-1 if max_cycles is None else max_cycles))


def agree(
    parts_TE: list[Tensor],
    k: int,
    red: Reduction,
    *,
    tags: list[int] | None = None,
    prices_given: bool = False,
    extras: str = "best",
    eps: float = 1e-6,
    max_price_iters: int | None = None,
    max_cycles: int | None = None,
    local_start: bool = True,
    round_bytes: float = 0.0,
) -> Header:
    """The header: one max of 16 + 3W float64 agreeing on the shapes, dtypes, validity, token
    counts, scale and options of `price_balanced_assignment` (its arguments, ``prices`` as
    ``prices_given``), and each local shard's ``tags`` (ints >= 0, e.g. what a caller decides
    with the group before solving). Bad scores or differing options on one rank raise on every
    rank; where a rank failed before the solve (`fail_agreement`), only ``failed`` is read."""
    _check_extras(extras)
    settings = _settings(round_bytes, local_start, prices_given, extras, max_price_iters, eps, max_cycles)
    tags = [0] * len(parts_TE) if tags is None else tags
    if any(not isinstance(t, int) or not 0 <= t < 2**52 for t in tags):
        raise ValueError(f"agree: tags must be ints in [0, 2^52) (exact in the header's float64), got {tags}")
    world, n_fixed = red.world, _N_FIXED
    rows, errors = [], {}
    for rank, scores, tag in zip(red.ranks, parts_TE, tags, strict=True):
        h = torch.zeros(n_fixed + 3 * world, dtype=torch.float64)
        try:
            _check(scores, k)
        except ValueError as err:
            errors[rank] = err
            h[n_fixed + rank] = _INVALID
            rows.append(h)
            continue
        dtype = torch.promote_types(scores.dtype, torch.float32)
        num_tokens, num_experts = scores.shape
        h[:6] = torch.tensor([num_experts, -num_experts, k, -k, _DTYPES[dtype], -_DTYPES[dtype]], dtype=torch.float64)
        h[8:n_fixed] = torch.tensor([v for s in settings for v in (s, -s)], dtype=torch.float64)
        h[n_fixed + rank] = _TAGGED + tag
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
    since = (red.rounds, red.values, red.bytes)
    agreed = Header([], 0.0, 0.0, torch.float32, settings, prices_given, [], [], since)
    return _read(red.max([h.to(device) for h in rows]).cpu(), world, errors, agreed)


def fail_agreement(red: Reduction, device: torch.device) -> None:
    """A rank that failed before the solve: the header's max with its slot marked failed, so
    every other rank raises there instead of waiting in the solve's next collective."""
    rows = []
    for rank in red.ranks:
        h = torch.zeros(_N_FIXED + 3 * red.world, dtype=torch.float64, device=device)
        h[_N_FIXED + rank] = _FAILED
        rows.append(h)
    red.max(rows)


def _read(out: Tensor, world: int, errors: dict, agreed: Header) -> Header:
    """``agreed`` (this rank's settings and counts) with what the header's max ``out`` says."""
    n_fixed = _N_FIXED
    status, sizes, nonfinite = (out[n_fixed + i * world : n_fixed + (i + 1) * world] for i in range(3))
    failed = (status == _FAILED).nonzero().flatten().tolist()
    if failed:
        return dataclasses.replace(agreed, failed=failed)
    bad = status == _INVALID
    if bad.any():
        if errors:
            raise next(iter(errors.values()))
        raise ValueError(f"the scores on ranks {bad.nonzero().flatten().tolist()} of the group are invalid (see there)")
    if out[0] != -out[1] or out[2] != -out[3] or out[4] != -out[5]:
        raise ValueError(
            f"the scores must have the same E, k and dtype on every rank of the group: E from {int(-out[1])} "
            f"to {int(out[0])}, k from {int(-out[3])} to {int(out[2])}"
        )
    if any(out[i] != -out[i + 1] for i in range(8, n_fixed, 2)):
        others = any(out[i] != -out[i + 1] for i in range(10, n_fixed, 2))
        raise ValueError(
            "price_balanced_assignment: round_bytes, prices (given or not), local_start, max_price_iters, extras, "
            "eps and max_cycles must be the same on every rank of the group (they decide which collectives run): "
            f"round_bytes from {float(-out[9]):g} to {float(out[8]):g}{', and the others differ' if others else ''}"
        )
    if nonfinite.any():
        raise ValueError(f"scores must be finite: found NaN or Inf on ranks {nonfinite.nonzero().flatten().tolist()}")
    dtype = {v: d for d, v in _DTYPES.items()}[int(out[4])]
    tags = [int(v) - _TAGGED for v in status.tolist()]
    sizes = [int(n) for n in sizes.tolist()]
    return dataclasses.replace(agreed, sizes=sizes, big=float(out[6]), half=float(out[7]), dtype=dtype, tags=tags)


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
    header: Header | None = None,
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
            of W x E float32, and a solve of the local tokens); False: from zero prices. With
            ``prices``, on more than one rank, the local start rides on the first update and
            its updates run beside the given prices' (above); False: the given prices alone.
        round_bytes: what one more round of collectives costs, as the bytes a rank receives in
            the time of its latency (e.g. 50 us at 25 GB/s: 1.25e6); the pair rounds run only
            where their bytes and rounds at this price cost less than the wide margin they
            spare (`price_prices.pair_rounds_pay`), and each certificate check sends its
            first rows with its counts (`price_rows.ahead_rows`). 0: bytes alone, the
            least traffic.
            ``prices`` given or not, ``local_start``, ``max_price_iters`` and ``round_bytes``
            must be the same on every rank (`GroupBalance` keeps them so): they decide which
            collectives run.
        header: the group's `agree` on these scores and options, where the caller ran it (its
            round then counted there); None: the solve's first round runs it. The caller keeps
            ``prices`` alike on every rank (their values, not only given or not, which its
            header may have declared otherwise).

    Returns (expert_idx (T, K) int64 per shard, the final prices (E,) float64 in the scores'
    units (mean zero; zeros where every token's scores are all equal), or None when there was
    nothing to solve or the scores' range exceeds float64's, the costs). The result is the
    same on every rank, exactly balanced over the group, and within the single-process
    solver's bound of the optimum.
    """
    stats = PriceStats()
    options = dict(extras=extras, eps=eps, max_price_iters=max_price_iters, max_cycles=max_cycles)
    options.update(local_start=local_start, round_bytes=round_bytes)
    if header is None:
        header = agree(parts_TE, k, red, prices_given=prices is not None, **options)
    else:
        _check_extras(extras)
        # prices given or not as the header declared them: its caller keeps them alike itself
        mine = _settings(round_bytes, local_start, header.prices_given, extras, max_price_iters, eps, max_cycles)
        if mine != header.settings:
            raise ValueError("price_balanced_assignment: the header was agreed on other options than this call's")
    if header.failed:
        raise ValueError(f"ranks {header.failed} of the group failed before the solve (see their errors)")
    sizes, big, half, dtype = header.sizes, header.big, header.half, header.dtype
    rounds0, values0, bytes0 = header.since  # the header's round counted with the solve's
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
        wants_local = units_ok and local_start and red.world > 1
        if wants_local and prices is None:
            start = _local_start(parts_TE, k, red, extras, eps, unit, max_cycles)
        if max_price_iters is None:
            max_price_iters = PRICE_ITERS[start is not None]
        late = None  # a warm call's local start: it rides on the first update and joins the second
        if wants_local and prices is not None and max_price_iters > 1:  # its chain joins the second
            late = _local_rows(parts_TE, k, red, extras, eps, unit, max_cycles), _rows_median
        p, stats.price_updates, width, converged, _, which, gaps = jacobi_prices(
            s_parts, caps, k, red, [start], max_iters=max_price_iters, tol=num_experts, late=late
        )
        given = prices is not None and start is not None
        stats.start = "zero" if start is None else "given" if given and which == 0 else "local"
        row = margin_row_bytes(total, num_experts, k, dtype)
        spared = CAPPED_SHARE * total * row  # what a margin of the capped eighth would send
        first = None  # the margin's first counts, where they rode on the pair rounds' check
        if (
            stats.start != "zero"
            and not converged
            and max_price_iters > 0
            and pair_rounds_pay(num_experts, spared, round_bytes)
        ):
            # stalled or capped: the pair rounds cost less than the wide margin they spare
            # (their windows suit prices a few 1e-3 off; the cold updates' slow modes are
            # further, and there they widened the margin)
            q, n, q_width, first = pair_prices(
                s_parts, caps, k, red, p, lambda q_E, w: MarginStart(s_parts, q_E, w, k, red)
            )
            stats.price_updates += n
            if first is not None:  # else the prices as they were, and the margin of a stalled call
                p, width, converged = q, q_width, True
        cap = capacities(caps, p)
        delta = max(eps, 8 * torch.finfo(dtype).eps)
        budget = total * k + num_experts if max_cycles is None else max_cycles
        # capped or stalled: the prices are further off than their last move
        min_rows = min(max(MIN_ROWS * num_experts, 0 if converged else int(CAPPED_SHARE * total)), total)
        if first is None:  # at the updates' prices, their tokens by margin counted where they stopped
            first = MarginStart(s_parts, p, width, k, red, gaps, min_rows)
        margin = gather_margin(s_parts, sizes, first, cap, caps, k, red, delta, budget, min_rows, round_bytes)
        stats.check_from = red.rounds - rounds0
        out, p_final, ok = certify(margin, s_parts, starts, sizes, k, red, delta, budget, stats, round_bytes)
        if not ok:
            warnings.warn(
                f"price_balanced_assignment: the exchange-cycle budget (max_cycles={budget}) ran out before the "
                "optimality certificate passed; the assignment is balanced but may be suboptimal",
                RuntimeWarning,
                stacklevel=2,
            )
    p_out = p_final * unit if units_ok else torch.zeros_like(p_final) if unit == 0 else None
    return [o.clone() for o in out], p_out, _finish(stats, red, rounds0, values0, bytes0)


def _local_prices(parts_TE: list[Tensor], k: int, extras: str, eps: float, unit: float, max_cycles: int | None):
    """Per shard, its own tokens' prices (E,) float64 in the normalised units, rounded to
    float32 (what travels), NaN where it has nothing to solve: every rank solves its own tokens
    alone, exactly (the single-process solver's certified prices, `balanced_prices`: no
    collective)."""
    out = []
    for scores in parts_TE:
        mine = None
        if scores.shape[0]:  # a start only: a capped local solve changes nothing
            _, mine, _ = balanced_prices(scores, k, extras=extras, eps=eps, max_cycles=max_cycles)
        if mine is None:
            mine = torch.full((scores.shape[1],), float("nan"), dtype=torch.float64)
        # in the group's normalised units before float32: fp64 scores beyond its range stay finite
        out.append((mine / unit).to(scores.device, torch.float32))
    return out


def _median(rows_WE: Tensor) -> Tensor | None:
    """The per-expert median of every rank's prices (W, E), NaN rows left out, float64; None
    where no rank had any."""
    agreed = torch.nanmedian(rows_WE.cpu().to(torch.float64), dim=0).values
    return agreed if bool(agreed.isfinite().all()) else None


def _local_start(
    parts_TE: list[Tensor], k: int, red: Reduction, extras: str, eps: float, unit: float, max_cycles: int | None = None
):
    """Prices to start a call without a previous one from (E,) float64 in the normalised units,
    or None: one gather of every rank's own prices (`_local_prices`, W x E float32) gives every
    rank the same per-expert median. The median, not the mean: one rank whose tokens crowd onto
    an expert would move that expert's start far off (docs/parallel.md, "Local start")."""
    rows = [r[None] for r in _local_prices(parts_TE, k, extras, eps, unit, max_cycles)]
    return _median(red.gather(rows, [1] * red.world))


def _local_rows(
    parts_TE: list[Tensor], k: int, red: Reduction, extras: str, eps: float, unit: float, max_cycles: int | None = None
) -> list[Tensor]:
    """The same prices as `_local_start`'s gather would bring, made to travel in a sum: per
    shard a (W x E,) int32 block holding the bits of its own float32 row at its rank and zeros
    elsewhere, so the sum is every rank's row, bit for bit (one term each, NaN included). A
    warm call adds it to its first price update's int32 counts (`price_prices.jacobi_prices`'
    ``late``) instead of a round of its own; `_rows_median` reads it back."""
    blocks = []
    for rank, mine in zip(red.ranks, _local_prices(parts_TE, k, extras, eps, unit, max_cycles), strict=True):
        block = torch.zeros(red.world, mine.numel(), dtype=torch.int32, device=mine.device)
        block[rank] = mine.view(torch.int32)
        blocks.append(block.flatten())
    return blocks


def _rows_median(summed: Tensor) -> Tensor | None:
    """`_median` of the rows `_local_rows`' blocks sum to (W, E): their float32 bits (in int32;
    a sum over a list of int32 tensors may come back widened, the values exact)."""
    return _median(summed.to(torch.int32).contiguous().view(torch.float32))


def _finish(stats, red, rounds0, values0, bytes0) -> PriceStats:
    stats.rounds, stats.values = red.rounds - rounds0, red.values - values0
    stats.bytes = red.bytes - bytes0
    stats.log = red.log[-stats.rounds :] if stats.rounds else []
    return stats
