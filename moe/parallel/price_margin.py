"""Step 3 of global BASE by prices (`price_base`): the tokens near a boundary under the agreed
prices, gathered onto every rank and solved there as one residual problem. Step 4, the
certificate that no token anywhere in the group could gain under the residual's prices, is
`price_certificate`.

Legend: W ranks, T tokens of one shard, E experts, K experts per token, M gathered rows.

3. the margin: every token picks its K best under the prices; those whose K-th choice is ahead
   of the next by less than a band are margin rows, the rest are fixed. The band is the last
   price move (what the prices are known to), at least 1e-6. One sum of E + W + 33 values (the
   fixed tokens' loads, the margin rows per rank, every token counted by its margin in bins
   growing 2x; where the pair rounds ran, on the sum that checks them: `MarginStart`) and one
   gather of the margin rows give every rank the same residual problem,
   which each solves the same way: the greedy fill into the room the fixed tokens leave, then
   exchange cycles (`moe.routing.exchange`). A row carries the token's K + 3 best experts under
   the prices, its slots first, not all E, and travels as bytes: the experts (uint8 up to 256)
   and their fp32 scores, 5 (K + 3) bytes against K + 4E for every column (`RowLayout`), and no
   index: the rows come in rank order, and each rank knows which of its tokens it sent; the
   other columns count as ``UNSENT``, below every score. Fewer rows in the band than asked for
   (2E, or an eighth of the tokens where the price updates reached their cap or stalled and no
   pair rounds followed or helped: `price_base`) widen it first, to the bin edge with enough
   below it (one more sum; none where the price updates stopped, since each of their sums
   counted the tokens by margin at its prices too): so thin a margin leaves the cycles too
   few moves to take up the loads' last misses, the certificate's prices move far from the
   picks' and many fixed tokens fail. Each expert has its own band, which a token takes at the
   widest of its slots': where the fixed tokens overfill experts, their bands alone grow 4x (one more sum each), so a
   cluster of near-equal tokens on the wrong side of one boundary widens that boundary, not
   every token's. Where the fill finds no completion, every band grows 4x. Where the cycles on
   the gathered rows alone (no collective; the certificate's first round reuses them) leave a
   row on a column it did not carry, the rows cannot fill those experts on their own columns:
   the certificate's prices for them would fall far below the picks' and many fixed tokens
   fail. While more fixed tokens would fail against those prices than every band 4x would add
   (one sum of 3 values, with the margin's counts under each way it may grow: the way taken
   needs no count of its own), the margin grows, else the certificate takes the failing ones. It
   grows by a pull on the experts short of rows where rows travel (W > 1) and that adds rows,
   but at most an eighth of what every band 4x would (`PULL_SHARE`), else by every band 2x
   (`GROW`; the test against 4x stands for the steps it may take; on one rank, where the band
   costs no bytes, 4x): a
   pull takes the tokens whose K-th choice under the prices is ahead of a short expert by less
   than 4x that expert's band (4x the larger of its band and its last pull when it grows again,
   up to 4), and the rows it adds carry that expert. Where the rows can fill every expert but
   the cycles raise some experts' prices above the others' by more than 64 of their bands (`_risen`:
   the rows want more of them than the room left, and too few rows hold one to give it up),
   those experts' bands alone grow 4x while more fixed tokens would fail against the cycles'
   prices than the growth adds (one sum of 3 values and the grown margin's counts), so the
   tokens that hold them nearest their margin come instead of every token within the rise. A
   wider margin sends only the tokens it adds (the prices, and so a token's row, stay), one
   gather each.
The loop is bounded: the bands grow geometrically to the whole problem (then the residual is
the gathered problem; a pull grows only while it adds rows and stays at most 4, at most about
ten times an expert from the least band).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..routing.balanced import _fill
from ..routing.cycle_graph import _Graph
from ..routing.exchange import violations
from .price_prices import GAP_BINS, MIN_BAND, gap_counts, gap_edges, pick
from .price_rows import (
    SENT,
    UNSENT,
    RowLayout,
    ahead_rows,
    gather_ahead,
    gather_rest,
    pack_rows,
    unpack_rows,
)

__all__ = ["GAP_BINS", "Margin", "MarginStart", "append_rows", "gather_margin", "residual_graph"]

BAND = 1.0  # the first margin band, in units of the last price move
PULL_SHARE = 8  # a pull, not every band 4x, where it adds at most 1 / PULL_SHARE of what they would
STEP = 4  # a band's growth: where fixed tokens overfill, where the fill fails, and as weighed
# every band's growth where rows travel and cannot fill an expert: the last step overshoots the
# band needed by up to this factor, and its rows cost bytes (docs/benchmarks.md, "Finer steps")
GROW = 2
# an expert's rise under the cycles, in its bands, past which its band grows before the
# certificate runs (`_risen`): random scores rise by up to about 2, trained routers' replayed
# layers by up to 24, where a growth cost up to 4 rounds for 0.08 points of bytes or none; the
# call traced rose by 2,500 and its certificate sent 11,241 rows (docs/benchmarks.md, "An
# expert the cycles price out")
RISE = STEP**3


class MarginStart:
    """The margin's first counts at the agreed prices ``p`` (E,), before any collective: every
    token's pick, the first band (the last price move ``width``, at least `MIN_BAND`) and each
    rank's counts to sum (`_margin_counts`). With ``gaps``, the group's tokens by margin at
    ``p`` (`price_prices.gap_counts`, summed where the price updates stopped), a band that
    surely holds fewer than ``min_rows`` tokens (fewer lie below the first bin edge at or above
    it) starts at the first edge with enough below it: the band its first sum would have
    widened it to, without that sum. Where the band lies in the bin of that edge, it may hold
    enough and stays (the same band as without ``gaps``: starting at the edge there cost a
    replayed call 3% more rows and spared no round, docs/benchmarks.md, "The margin's counts
    on the rounds before it"). ``summed``: the counts' sum, where it rode on an earlier
    collective (`price_prices.pair_prices`), else None. ``surely`` and ``at_most``: the group's
    tokens the first band surely holds and at most holds, by ``gaps`` (0 and None without): a
    rank sends no more rows ahead of its counts than the group can have, and none where the
    group surely has more than every rank can send (`gather_margin`)."""

    def __init__(self, s_parts, p, width: float, k: int, red, gaps: Tensor | None = None, min_rows: int = 0):
        num_experts = s_parts[0].shape[0]
        self.p = p
        self.p1 = p.to(s_parts[0].dtype)[:, None]
        self.picks = [pick(s, self.p1, k) for s in s_parts]
        b = max(BAND * width, MIN_BAND)
        edges = gap_edges()
        if gaps is not None and b <= 4.0:  # past 4 the margin is the whole problem
            below = gaps[:GAP_BINS].cumsum(0)  # the tokens below each edge
            above = int((edges < b).sum())  # the first edge at or above the band bounds its rows
            if above < GAP_BINS and int(below[above]) < min_rows:
                b = max(b, float(edges[min(int((below < min_rows).sum()), GAP_BINS - 1)]))
        # the group's tokens surely in the first band (below an edge at or under it) and at most
        # in it (below the first edge above it), where counted; else 0 and every token
        within = int((edges <= b).sum())
        self.surely = int(gaps[:within].sum()) if gaps is not None else 0
        self.at_most = int(gaps[: within + 1].sum()) if gaps is not None else None
        self.band = torch.full((num_experts,), b, dtype=torch.float64)  # per expert held
        self.pull = torch.zeros(num_experts, dtype=torch.float64)  # per expert short of rows
        self.by_gap = [gap_counts(m) for _, m in self.picks]
        last, near, want, self.counts = _margin_counts(
            s_parts, self.p1, self.picks, self.by_gap, self.band, self.pull, red
        )
        self.first = (last, near, want)
        self.summed: Tensor | None = None


@dataclass
class Margin:
    """What step 3 leaves the certificate."""

    picks: list  # per shard: (slots (T, K), margin (T,)) under the agreed prices
    near: list  # per shard: (T,) bool, the tokens gathered
    mine: list  # per shard: (its tokens sent, their residual rows, their columns), a block per gather
    s_res: Tensor  # (E, M) the gathered rows' scores (row-major (M, E) transposed), UNSENT where not carried
    graph: _Graph  # the exchange cycles on the gathered rows alone
    cancelled: tuple  # its search's (done, cycles applied, distances)
    extra: object  # the movable extra slots (extras="best"), or None
    lay: RowLayout
    cols: int  # the columns a row carries
    sizes: list  # the rows each rank sent, every rank's


def gather_margin(
    s_parts, sizes, first: MarginStart, cap, caps, k, red, delta, budget, min_rows, round_bytes: float = 0.0
) -> Margin:
    """Step 3: the bands grow until the fixed tokens leave room the gathered rows can fill on
    the columns they carry. ``round_bytes``: the price of a round; where set, and the first
    counts did not ride on an earlier collective, they travel with the first band's rows
    (`_counts_ahead`)."""
    num_experts = s_parts[0].shape[0]
    dtype = s_parts[0].dtype
    world = red.world
    p, p1, picks, by_gap = first.p, first.p1, first.picks, first.by_gap
    cols = min(num_experts, k + SENT)
    lay = RowLayout.of(sum(sizes), num_experts, k, dtype)
    band, pull = first.band, first.pull
    edges = gap_edges()
    extra = (cap.cpu() > caps.base).numpy() if caps.movable else None
    # the rows gathered so far: a wider band sends only the tokens it adds (the prices, and so
    # a token's row, stay), each gather a block in rank order after the ones before
    s_res = torch.empty(0, num_experts, dtype=lay.score).T
    had = [torch.zeros_like(m, dtype=torch.bool) for _, m in picks]
    had_sizes = [0] * world
    mine = [([], [], []) for _ in s_parts]  # per shard: its tokens sent, their rows, their columns
    graph = None
    # the margin and its summed counts for the next pass: the first band's (where their sum rode
    # on the pair rounds' check, without a round of its own), then a widening's (summed with
    # its weighing)
    early = None  # the first band's rows where they came with its counts, kept while it stands
    if first.summed is not None:
        summed = first.summed
    else:
        head = 4 * (num_experts + GAP_BINS + 2)  # a rank's own counts as int32
        ahead = min(ahead_rows(round_bytes, world, lay.width(cols, keyed=False), head), max(sizes))
        if first.at_most is not None:  # no rank has more than the group
            ahead = min(ahead, first.at_most)
        if first.surely > world * ahead:  # a rank surely has more: the sum and one gather, no padding
            ahead = 0
        if ahead:
            summed, early = _counts_ahead(s_parts, first, cols, lay, ahead, red)
        else:
            summed = red.sum(first.counts).cpu()
    agreed = first.first, summed
    while True:
        if agreed is None:
            last, near, want, counts = _margin_counts(s_parts, p1, picks, by_gap, band, pull, red)
            summed = red.sum(counts).cpu()
        else:
            (last, near, want), summed, agreed = agreed[0], agreed[1], None
        room = cap.cpu() - summed[:num_experts]
        m_sizes = summed[num_experts : num_experts + world].tolist()
        if sum(m_sizes) < min_rows and not last:  # to the first edge with enough rows below it: one more count
            below = summed[num_experts + world : num_experts + world + GAP_BINS].cumsum(0)
            band.clamp_(min=float(edges[min(int((below < min_rows).sum()), GAP_BINS - 1)]))  # far prices: past 4
            early = None  # the wider band's rows go in one gather, as without them
            continue
        if not bool((room >= 0).all()):  # the fixed tokens overfill these experts: their bands grow
            band[room < 0] *= STEP
            early = None
            continue
        new_sizes = [m - h for m, h in zip(m_sizes, had_sizes, strict=True)]  # the bands only grow
        if sum(new_sizes):
            added = [(nr & ~h).nonzero().flatten() for nr, h in zip(near, had, strict=True)]
            if early is not None:  # the first band's rows: those that came with its counts, and the rest
                made, sent = early
                rows = gather_rest([r for r, _ in made], sent, new_sizes, red)
            else:
                made = [
                    pack_rows(s, p1, out, lc, None, cols, lay, w.index_select(0, lc))
                    for s, (out, _), lc, w in zip(s_parts, picks, added, want, strict=True)
                ]
                rows = red.gather([r for r, _ in made], new_sizes).cpu()
            for rank, lc, (_, got), (lcs, at, gots) in zip(red.ranks, added, made, mine, strict=True):
                row0 = s_res.shape[1] + sum(new_sizes[:rank])  # this rank's first row in the gather
                lcs.append(lc)
                at.append(torch.arange(row0, row0 + lc.numel()))
                gots.append(got)
            s_res = append_rows(s_res, unpack_rows(rows, lay, cols, keyed=False)[2])
            had, had_sizes = near, m_sizes
        early = None  # sent (or none to send): a later band sends only the rows it adds
        slots = torch.full((s_res.shape[1], k), -1, dtype=torch.int64)
        graph = None  # the last band's graph: its gains go before the fill's passes
        try:
            _fill(s_res, slots, room, p.to(dtype).cpu())
        except RuntimeError as err:  # no completion with these fixed tokens: a wider band
            if last:  # impossible
                raise AssertionError("price_balanced_assignment: the whole problem could not be filled") from err
            band *= STEP
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
        graph = residual_graph(s_res, slots, delta, extra)
        cancelled = graph.cancel(budget, p.cpu().numpy().astype(s_res.numpy().dtype))
        short = None if last else _unsent_columns(s_res, torch.from_numpy(graph.out))
        if short is None:
            return Margin(picks, near, mine, s_res, graph, cancelled, extra, lay, cols, had_sizes)
        if short.numel() == 0:
            # every expert filled; where the cycles priced some far above the others, the fixed
            # tokens holding them near their margin would fail: those bands alone grow while
            # that sends fewer (docs/benchmarks.md, "An expert the cycles price out")
            risen = _risen(cancelled[2], p, band)
            if risen.numel() == 0:
                return Margin(picks, near, mine, s_res, graph, cancelled, extra, lay, cols, had_sizes)
            grown = band.clone()
            grown[risen] *= STEP
            q = torch.from_numpy(cancelled[2]).to(dtype)
            (fails, _, _), next_counts = _widen_counts(
                s_parts, p1, picks, by_gap, near, band, pull, pull, q, red, delta, [(grown, pull)]
            )
            adds = int(next_counts[0][1][num_experts : num_experts + world].sum()) - sum(had_sizes)
            if fails <= adds or adds == 0:  # the certificate takes them (a growth that adds none ends it)
                return Margin(picks, near, mine, s_res, graph, cancelled, extra, lay, cols, had_sizes)
            band, agreed = grown, next_counts[0]
            continue
        # the tokens nearest to taking the experts short of rows, or every band GROW x (weighed
        # against every band 4x: what growing may take in all)
        pulled = pull.clone()
        pulled[short] = torch.maximum(pull[short], band[short]) * 4
        q = torch.from_numpy(cancelled[2]).to(dtype)
        # a pull and finer steps only where rows travel: on one rank the band costs no bytes
        ways = [(band * STEP, pull)] if world == 1 else [(band, pulled), (band * GROW, pull)]
        (fails, pull_adds, band_adds), next_counts = _widen_counts(
            s_parts, p1, picks, by_gap, near, band, pull, pulled, q, red, delta, ways
        )
        if fails <= band_adds:  # the certificate takes them (as it would beside a pull that grows on)
            return Margin(picks, near, mine, s_res, graph, cancelled, extra, lay, cols, had_sizes)
        pulls = world > 1 and 0 < PULL_SHARE * pull_adds <= band_adds and bool((pulled <= 4.0).all())
        way = 0 if world == 1 or pulls else 1
        band, pull = ways[way]
        agreed = next_counts[way]


def _in_band(out_TK: Tensor, margin_T: Tensor, band_E: Tensor) -> Tensor:
    """(T,) bool: the tokens whose margin is below the band of the widest of their slots'."""
    return margin_T < band_E.to(margin_T.device, margin_T.dtype)[out_TK].amax(1)


def _near(
    s_ET: Tensor, p_E1: Tensor, out_TK: Tensor, margin_T: Tensor, band_E: Tensor, pull_E: Tensor
) -> tuple[Tensor, Tensor]:
    """The margin's tokens, (T,) bool: those in their slots' band (`_in_band`), and those whose
    K-th choice under the prices is ahead of an expert with a pull by less than that pull; and
    for each token (T,) the pulled expert it is nearest to, relative to its pull (-1: none),
    which its row carries."""
    near = _in_band(out_TK, margin_T, band_E)
    want = torch.full_like(margin_T, -1, dtype=torch.int64)
    pulled = pull_E.nonzero().flatten().to(s_ET.device)
    if pulled.numel():
        last = out_TK[:, -1:].T  # (1, T): each token's K-th choice
        kth = s_ET.gather(0, last) - p_E1[last[0]].T  # the pulled rows alone, not all E
        a = s_ET.index_select(0, pulled) - p_E1.index_select(0, pulled)  # (P, T)
        rel = (kth - a) / pull_E.to(a.device, a.dtype)[pulled, None]
        rel.masked_fill_((out_TK.T[None] == pulled[:, None, None]).any(1), float("inf"))  # its own slots
        best, at = rel.min(0)
        hit = best < 1
        near |= hit
        want[hit] = pulled[at[hit]]
    return near, want


def append_rows(s_res: Tensor, new_EN: Tensor) -> Tensor:
    """The gathered rows' scores (E, M) with ``new`` (E, n) after them: (E, M + n), the
    transpose of row-major (M + n, E) rows, as ``s_res`` is (`unpack_rows`)."""
    return torch.cat([s_res.T, new_EN.T]).T


def residual_graph(s_res: Tensor, slots_MK: Tensor, delta: float, extra) -> _Graph:
    """The exchange-cycle graph of the gathered rows, on copies of their slots and of the
    movable extra slots (the search writes both). It reads the rows' scores in place: (E, M)
    is the transpose of row-major rows (`append_rows`), the (M, E) the graph reads; nothing
    writes them while it lives."""
    return _Graph(s_res.numpy(), slots_MK.numpy().copy(), delta, None if extra is None else extra.copy())


def _counts_ahead(s_parts, first: MarginStart, cols: int, lay: RowLayout, ahead: int, red):
    """The margin's first counts and its first band's rows in one gather of fixed size
    (`price_rows.gather_ahead`, where a round is priced): each rank's own counts as int32 (its
    fixed tokens' loads, its margin rows, its tokens by margin), summed on arrival into the E +
    W + 33 values the sum would give, then the first ``ahead`` rows of its margin tokens in
    token order. Returns (the summed counts, (each shard's rows and their columns as
    `pack_rows` made them, every rank's rows sent ahead))."""
    num_experts, world = s_parts[0].shape[0], red.world
    _, near, want = first.first
    heads, made = [], []
    for rank, c, s, (out, _), nr, w in zip(red.ranks, first.counts, s_parts, first.picks, near, want, strict=True):
        own = torch.cat([c[:num_experts], c[num_experts + rank : num_experts + rank + 1], c[num_experts + world :]])
        heads.append(own)
        lc = nr.nonzero().flatten()
        made.append(pack_rows(s, first.p1, out, lc, None, cols, lay, w.index_select(0, lc)))
    own, sent = gather_ahead(heads, [r for r, _ in made], ahead, red)
    summed = torch.cat([own[:, :num_experts].sum(0), own[:, num_experts], own[:, num_experts + 1 :].sum(0)])
    return summed, (made, sent)


def _margin_counts(s_parts, p_E1, picks, by_gap, band, pull, red):
    """The margin under the bands ``band`` and the pull ``pull``: whether it is the whole
    problem (every band past 4), its tokens per shard (T,) bool, the pulled expert each row
    carries (`_near`), and each rank's counts to sum (E + W + 33 values: its fixed tokens'
    loads, its margin rows, its tokens by margin, ``by_gap``)."""
    num_experts, world = s_parts[0].shape[0], red.world
    last = bool((band > 4.0).all())  # past 4 every token is at the margin: the whole problem
    near, want, counts = [], [], []
    for rank, s, (out, m), gaps in zip(red.ranks, s_parts, picks, by_gap, strict=True):
        nr, w = _near(s, p_E1, out, m, band, pull)
        nr = nr if not last else torch.ones_like(nr)
        c = torch.zeros(num_experts + world + GAP_BINS + 1, dtype=torch.int64, device=out.device)
        c.index_add_(0, out[~nr].flatten(), torch.ones_like(out[~nr].flatten()))
        c[num_experts + rank] = int(nr.sum())
        c[num_experts + world :] = gaps
        near.append(nr)
        want.append(w)
        counts.append(c)
    return last, near, want, counts


def _widen_counts(s_parts, p_E1, picks, by_gap, near, band, pull, pulled, q_E: Tensor, red, delta: float, ways):
    """Over the group, in one sum: the fixed tokens that fail against the prices ``q``, the
    tokens the margin would add with the pull ``pulled``, or with every band 4x, and the
    margin's counts (`_margin_counts`) under each of ``ways`` (band, pull), so that the one
    taken needs no round of its own. Returns those three numbers and, per way, (its margin,
    its summed counts). Where rows travel the first way is the pull (`gather_margin`),
    whose margin gives the tokens it adds."""
    sides = [_margin_counts(s_parts, p_E1, picks, by_gap, b, pl, red) for b, pl in ways]
    counts = []
    for i, (s, (out, m), nr) in enumerate(zip(s_parts, picks, near, strict=True)):
        local = (~nr).nonzero().flatten()
        fails = violations(s.index_select(1, local), q_E.to(s.device), out.index_select(0, local), delta).numel()
        n = int(nr.sum())
        # the pull's margin (not the whole problem: the bands that led here are not all past 4)
        pulled_near = sides[0][1][i] if red.world > 1 else _near(s, p_E1, out, m, band, pulled)[0]
        by_pull = int(pulled_near.sum()) - n
        by_band = int(_near(s, p_E1, out, m, band * STEP, pull)[0].sum()) - n
        three = torch.tensor([fails, by_pull, by_band], dtype=torch.int64, device=s.device)
        counts.append(torch.cat([three] + [side[3][i] for side in sides]))
    summed = red.sum(counts).cpu()
    each = (summed.numel() - 3) // len(ways)  # E + W + 33 values a way
    return summed[:3].tolist(), [(side[:3], summed[3 + w * each : 3 + (w + 1) * each]) for w, side in enumerate(sides)]


def _risen(dist_E, p_E: Tensor, band_E: Tensor) -> Tensor:
    """The experts whose price the cycles raised above the others' (their median move) by more
    than `RISE` times their band: the gathered rows want more of them than the room the fixed
    tokens leave, and too few gathered rows hold one to give it up, so every fixed token that
    holds one within that rise of its margin would fail."""
    moved = torch.from_numpy(dist_E).to(torch.float64) - p_E.cpu().to(torch.float64)
    return ((moved - moved.median()) > RISE * band_E).nonzero().flatten()


def _unsent_columns(s_res: Tensor, slots_MK: Tensor) -> Tensor:
    """The experts a gathered row holds without having carried their column (``UNSENT``):
    those the rows cannot fill on their own columns."""
    held = slots_MK.clamp(min=0)
    bad = (s_res.gather(0, held.T) == UNSENT) & (slots_MK.T >= 0)
    return torch.unique(held.T[bad])
