"""How global BASE's rows travel between ranks: as bytes, a row naming the experts whose scores it
carries (`price_base`). A margin row carries a token's K slots and its `SENT` best other experts
under the prices, not all E: 5 (K + 3) bytes against K + 4E at E <= 256 in fp32; the columns a
row does not carry read back as `UNSENT`, below every normalised score."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "AHEAD_SHARE",
    "SENT",
    "UNSENT",
    "RowLayout",
    "ahead_rows",
    "as_bytes",
    "gather_ahead",
    "gather_rest",
    "margin_row_bytes",
    "of_bytes",
    "pack_rows",
    "unpack_rows",
]

UNSENT = -4.0  # the score of a column a row does not carry: below every normalised score, in [-1, 0]
SENT = 3  # columns a margin row carries beyond its K slots: its best under the prices
AHEAD_SHARE = 0.25  # of a round's price, the most the rows sent ahead with their counts may cost


def as_bytes(x: Tensor) -> Tensor:
    """(n, c) values as (n, c * itemsize) uint8, their bits unchanged."""
    n, c = x.shape
    return x.contiguous().view(-1).view(torch.uint8).view(n, c * x.element_size())  # flat: any 1-row stride


def of_bytes(b: Tensor, dtype) -> Tensor:
    """`as_bytes` back: (n, c) uint8 as (n, c / itemsize) values of ``dtype``."""
    return b.clone(memory_format=torch.contiguous_format).view(dtype)  # a fresh copy: aligned, dense strides


@dataclass(frozen=True)
class RowLayout:
    """How a row travels, as bytes: a key where it has one (int32 while the group's tokens fit,
    else int64), the experts it names (uint8 up to 256 experts, int16 up to 2^15) and their
    scores (the solve's dtype). A row of ``cols`` < E columns names them, its K slots first; a
    row of every column names its K slots alone and holds the scores in expert order. The
    margin's rows have no key (each rank knows which of its tokens it sent, in order); the
    certificate's name the residual row they add columns to, or -1 for a row new to it."""

    index: torch.dtype
    expert: torch.dtype
    score: torch.dtype
    num_experts: int
    k: int

    @staticmethod
    def of(total: int, num_experts: int, k: int, dtype) -> RowLayout:
        index = torch.int32 if total < 2**31 else torch.int64
        expert = torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 2**15 else torch.int32
        return RowLayout(index, expert, dtype, num_experts, k)

    def named(self, cols: int) -> int:
        """Experts a row of ``cols`` columns names."""
        return self.k if cols == self.num_experts else cols

    def width(self, cols: int, keyed: bool = True) -> int:
        """Bytes a row of ``cols`` columns takes, with or without its key."""
        key = self.index.itemsize if keyed else 0
        return key + self.named(cols) * self.expert.itemsize + cols * self.score.itemsize


def pack_rows(
    s_ET: Tensor,
    p_E1: Tensor,
    out_TK: Tensor,
    local: Tensor,
    keys: Tensor | None,
    cols: int,
    lay: RowLayout,
    want: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The rows that travel for tokens ``local``, (n, width) uint8 (`RowLayout`, led by ``keys``
    (n,) where given), and the columns they carry (E, n) bool: the slots and the ``cols`` - K
    best other experts under the prices; where ``want`` (n,) names an expert (not -1), the row
    carries it in place of the last of those if they lack it."""
    num_experts = s_ET.shape[0]
    s = s_ET.index_select(1, local)
    held = out_TK.index_select(0, local)
    if cols < num_experts:
        a = (s - p_E1).scatter_(0, held.T, float("-inf"))  # the slots aside: they come first, in order
        idx = torch.cat([held, torch.topk(a, cols - held.shape[1], dim=0).indices.T], 1)
        if want is not None:
            swap = (want >= 0) & ~(idx == want[:, None]).any(1)
            idx[swap, -1] = want[swap]
        vals, named = s.T.gather(1, idx), idx
    else:
        idx = torch.arange(num_experts, device=s.device).expand(s.shape[1], -1)
        vals, named = s.T, held
    sent = torch.zeros_like(s, dtype=torch.bool).scatter_(0, idx.T, True)
    parts = [] if keys is None else [keys[:, None].to(lay.index)]
    parts += [named.to(lay.expert), vals.to(lay.score)]
    return torch.cat([as_bytes(x) for x in parts], dim=1), sent


def unpack_rows(rows: Tensor, lay: RowLayout, cols: int, keyed: bool = True) -> tuple[Tensor | None, Tensor, Tensor]:
    """`pack_rows` back: the keys (n,) (None without), slots (n, K), scores (E, n) (the transpose
    of row-major (n, E)), ``UNSENT`` where a row carries no column."""
    at, n_named = lay.index.itemsize if keyed else 0, lay.named(cols) * lay.expert.itemsize
    keys = of_bytes(rows[:, :at], lay.index)[:, 0].long() if keyed else None
    named = of_bytes(rows[:, at : at + n_named], lay.expert).long()
    s = of_bytes(rows[:, at + n_named :], lay.score)
    # (E, n) views of (n, E) rows, made at once: the rows append to the gathered ones (and the
    # exchange graph reads them) without another copy
    if cols < lay.num_experts:
        return (
            keys,
            named[:, : lay.k],
            torch.full((rows.shape[0], lay.num_experts), UNSENT, dtype=lay.score).scatter_(1, named, s).T,
        )
    return keys, named[:, : lay.k], s.T


def margin_row_bytes(total: int, num_experts: int, k: int, dtype) -> int:
    """Bytes of one margin row (no key, its K slots and `SENT` more columns) in a group of
    ``total`` tokens."""
    return RowLayout.of(total, num_experts, k, dtype).width(min(num_experts, k + SENT), keyed=False)


def ahead_rows(round_bytes: float, world: int, row_bytes: int, head_bytes: int) -> int:
    """Rows each rank sends ahead in one gather of fixed size, after its counts (``head_bytes``,
    in whole rows of ``row_bytes``), where a round is priced at ``round_bytes``: a rank receives
    every rank's block, and those bytes cost at most `AHEAD_SHARE` of a round. 0 without a price
    (bytes alone: the counts' sum, then the rows in a gather of the sizes it gave)."""
    head = -(-head_bytes // row_bytes)
    return max(int(AHEAD_SHARE * round_bytes // (world * row_bytes)) - head, 0)


def gather_ahead(heads: list[Tensor], rows: list[Tensor], ahead: int, red) -> tuple[Tensor, Tensor]:
    """One gather of fixed size: per local shard its counts ``heads`` ((n,) values below 2^31, as
    many on every rank; int32 bytes in whole rows), then the first ``ahead`` of its ``rows``
    ((n, width) uint8, the same width on every rank), zeros beyond them. Returns every rank's
    counts (W, n) int64 and first rows (W, ``ahead``, width), of which rank r's first
    min(n_r, ``ahead``) are its own."""
    width, length = rows[0].shape[1], 4 * heads[0].numel()
    head = -(-length // width)
    blocks = []
    for h, r in zip(heads, rows, strict=True):
        block = r.new_zeros(head + ahead, width)
        block.view(-1)[:length] = as_bytes(h.to(r.device, torch.int32)[None])[0]
        n = min(ahead, r.shape[0])
        block[head : head + n] = r[:n]
        blocks.append(block)
    got = red.gather(blocks, [head + ahead] * red.world).cpu().view(red.world, head + ahead, width)
    return of_bytes(got[:, :head].reshape(red.world, -1)[:, :length], torch.int32).long(), got[:, head:]


def gather_rest(rows: list[Tensor], early: Tensor, sizes: list[int], red) -> Tensor:
    """Every rank's rows in rank order, as one gather of ``sizes`` would give them, from those
    `gather_ahead` sent (``early``) and one more gather of the rest where a rank had more
    (``rows``: the local shards' whole rows)."""
    ahead = early.shape[1]
    rest = [max(n - ahead, 0) for n in sizes]
    late = red.gather([r[ahead:] for r in rows], rest).cpu() if any(rest) else early.new_zeros(0, early.shape[2])
    late = late.split(rest)
    return torch.cat([p for r, n in enumerate(sizes) for p in (early[r, : min(n, ahead)], late[r])])
