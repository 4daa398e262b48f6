"""Step 4 of global BASE by prices (`price_base`): the certificate that no token anywhere in the
group could gain under the prices of the residual problem that step 3 (`price_margin`)
gathered and solved.

Legend: W ranks, T tokens of one shard, E experts, K experts per token, M gathered rows.

The cycles' final distances are prices under which no margin row can gain on the columns it
carries. Every rank checks its fixed tokens against them, and its margin rows on the columns
they do not carry (one sum of 2W values); a fixed token that fails joins the margin rows with
its slots, a margin row that fails travels again with its K + 3 best columns under the new
prices, added to those it carried (one gather for both, each row keyed by its place among the
gathered rows, -1 for a new one: 4 bytes more), and the cycles go on. When none fails, no
cycle over the whole group gains more than the tolerance: the optimality condition of the
transportation problem, as in the single-process solver (docs/routing.md).

Where a round has a price (``round_bytes``, `price_rows.ahead_rows`), a check sends its
counts and its first rows in one gather of fixed size instead of the sum and then the gather: a
check that finds tokens to send then costs one round, not two, where every rank's fit (a second
gather brings the rest where they do not), for bytes that cost at most `price_rows.AHEAD_SHARE` of a round. Each
check sends no more rows ahead than a rank sent in the one before (the first, than twice the
most margin rows a rank sent, `AHEAD_FIRST`).

The loop is bounded: each round adds a row or a column a row did not carry (one of its K + 3
best under the new prices beats what it holds, and the carried ones passed); after
`LAST_CHECK` rounds every row travels whole.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..routing.exchange import held_mask, violations
from .price_margin import Margin, append_rows, residual_graph
from .price_rows import UNSENT, ahead_rows, gather_ahead, gather_rest, pack_rows, unpack_rows

__all__ = ["LAST_CHECK", "certify"]

LAST_CHECK = 63  # certificate rounds before every row travels with every column (the whole problem)
ROW_BLOCK = 1 << 15  # gathered rows updated at a time by a certificate round
# the first check's rows a rank sends ahead, at most, in its margin rows (the most a rank sent): on
# trained routers' replayed scores the first check's rows were 0.06-1.24 times a rank's margin rows,
# on random scores a few where a rank sent tens (docs/benchmarks.md, "A priced round sends the rows
# with their counts")
AHEAD_FIRST = 2


def certify(mg: Margin, s_parts, starts, sizes, k, red, delta, budget, stats, round_bytes: float = 0.0):
    """Step 4, from the cycles of step 3 (`price_margin.gather_margin`): rounds of checks until no
    fixed token and no gathered row could gain under the cycles' prices (or the budget runs
    out). Fills ``stats``' margin rows, cycles and checks. Returns (slots (T, K) per shard, the
    certificate's prices (E,) float64 with mean zero, certified: False where the cycle budget
    ran out first). ``round_bytes``: the price of a round (`price_rows.ahead_rows`)."""
    num_experts = s_parts[0].shape[0]
    dtype = s_parts[0].dtype
    world = red.world
    s_res, extra, lay, cols = mg.s_res, mg.extra, mg.lay, mg.cols
    mg.s_res = None  # held here alone: each round's rows go once the next ones are made
    # which residual row each local token is (-1: fixed), and the global index of each
    # residual row that a local shard sent (-1: another rank's, which this one never writes)
    ids = torch.full((s_res.shape[1],), -1, dtype=torch.int64)
    at_row = [torch.full(nr.shape, -1, dtype=torch.int64, device=nr.device) for nr in mg.near]
    sent = []  # per shard: the columns its gathered rows carry
    for s, ar, st, (lcs, at, gots) in zip(s_parts, at_row, starts, mg.mine, strict=True):
        lc, at = torch.cat(lcs), torch.cat(at)
        ar[lc] = at.to(lc.device)
        ids[at] = lc.cpu() + st
        sent.append(_Sent(s.shape[1], num_experts, s.device))
        sent[-1].set(lc, torch.cat(gots, 1))
    stats.margin_rows = ids.numel()
    fixed = [(~nr) for nr in mg.near]
    outs = [out.clone() for out, _ in mg.picks]
    applied, ok = 0, False
    # the most rows a rank sent in the last check: the next sends no more ahead; the first, no more than
    # `AHEAD_FIRST` times the most margin rows a rank sent (nor than a rank has tokens)
    most = min(max(sizes), AHEAD_FIRST * max(mg.sizes))
    graph, cancelled, start, slots = mg.graph, mg.cancelled, None, None  # the first round: step 3's cycles
    mg.graph = None  # held here alone, so that each round's graph goes once its cycles ran
    for check in range(LAST_CHECK + 2):  # each round adds a row or a column; at LAST_CHECK, every row whole
        if check:
            graph = residual_graph(s_res, slots, delta, extra)
            cancelled = graph.cancel(budget - applied, start)
        done, n, dist = cancelled
        applied, start = applied + n, dist
        slots = torch.from_numpy(graph.out)
        if extra is not None:
            extra = graph.extra
        graph = None  # its gains go before more rows come
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
        width = num_experts if check == LAST_CHECK else cols  # under the new prices; a short row adds columns
        ahead = min(ahead_rows(round_bytes, world, lay.width(width), 8), most)
        made = more = None
        if ahead:  # the rows, as many as fit, ride with the counts: no sum of its own
            made = _pack(s_parts, q, outs, bad, short, at_row, width, lay)
            b_sizes, more = _gather_ahead(made, bad, short, ahead, red)
        else:
            counts = []
            for rank, b, sh in zip(red.ranks, bad, short, strict=True):
                c = torch.zeros(2 * world, dtype=torch.int64, device=b.device)
                c[rank], c[world + rank] = b.numel(), sh.numel()
                counts.append(c)
            summed = red.sum(counts).cpu()
            b_sizes = (summed[:world] + summed[world:]).tolist()
        most = max(b_sizes)
        if most == 0:
            ok = True
            break
        if more is None:  # the counts came alone: the rows now, in the sizes they gave
            made = _pack(s_parts, q, outs, bad, short, at_row, width, lay)
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
        # their slots are the ones held already; the columns they carried before stay (a block
        # of rows at a time: late rounds can send nearly every row again, and the whole
        # problem's temporaries would hold several copies of the rows' scores)
        at, fresh = again[old], old.nonzero().flatten()
        for c0 in range(0, at.numel(), ROW_BLOCK):
            i, f = at[c0 : c0 + ROW_BLOCK], new_s[:, fresh[c0 : c0 + ROW_BLOCK]]
            s_res[:, i] = torch.where(f == UNSENT, s_res[:, i], f)
        new = ~old
        slots = torch.cat([slots, new_slots[new]])
        s_res = append_rows(s_res, new_s[:, new])
        stats.margin_rows = ids.numel()
    _write(outs, ids, slots, starts, sizes, red)
    return outs, prices - prices.mean(), ok


def _pack(s_parts, q, outs, bad, short, at_row, width, lay):
    """Per shard, its rows for the check's failing tokens (`pack_rows`): a new row keyed -1, a
    short one by its residual row; their best columns under the new prices."""
    return [
        pack_rows(s, q[:, None], out, torch.cat([b, sh]), torch.cat([torch.full_like(b, -1), ar[sh]]), width, lay)
        for s, out, b, sh, ar in zip(s_parts, outs, bad, short, at_row, strict=True)
    ]


def _gather_ahead(made, bad, short, ahead, red):
    """The check's counts (two int32 a rank) and its rows, the first ``ahead`` of each rank's
    with the counts (`price_rows.gather_ahead`), the rest in a second gather where a rank had
    more. Returns (rows per rank, every rank's rows in rank order, as the counts' sum and one
    gather would)."""
    heads = [torch.tensor([b.numel(), sh.numel()]) for b, sh in zip(bad, short, strict=True)]
    got, early = gather_ahead(heads, [r for r, _ in made], ahead, red)
    sizes = got.sum(1).tolist()
    return sizes, gather_rest([r for r, _ in made], early, sizes, red)


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
