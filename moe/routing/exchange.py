"""Exchange cycles between experts: improving and certifying a balanced assignment.

Legend: T tokens, E experts, K slots per token, C candidate tokens.

The edge a -> b of the exchange graph moves one token from expert a to expert b, with the best
score change over the tokens at a that do not hold b. A cycle a0 -> a1 -> ... -> a0 keeps every
load fixed and every token's experts distinct (a token moved along two edges leaves two experts
and joins two it did not hold), so applying a cycle of positive total gain keeps the assignment
feasible and improves it. A complete assignment with no positive cycle is optimal: that is the
optimality condition of the transportation problem (no negative cycle in the residual graph),
docs/routing.md.

Movable extra slots (``movable=True`` in `cancel_cycles`): when T * K = b * E + r with r > 0, any
loads with r experts at b + 1 and the others at b are allowed. That is the fixed-load problem
with one more token, the holder, that takes the E - r slots left unused: every expert has room
for b + 1, the holder holds exactly the experts at b, and its score is 0 everywhere. A move of
the holder, a -> c from an expert at b to one at b + 1, gains 0; a cycle through it carries real
tokens along a path from c to a, so a ends at b + 1 and c at b. The holder belongs to every
candidate set, so the certificate covers the choice of the r experts too.

The search is sequential and touches only the candidates' (E, C) scores and the (E, E) graph,
so it runs on the host in numpy: one copy of the candidates' scores and slots there, one copy of
the slots back. The certificate (the tokens the final prices could fault, against them) runs
where the scores are.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = ["cancel_cycles", "fill_passes", "held_mask", "keep_top_claims", "violations"]


def held_mask(out_TK: Tensor, num_experts: int) -> Tensor:
    """(E, T) bool: which experts each token already holds (-1 slots hold nothing)."""
    held = torch.zeros(num_experts + 1, out_TK.shape[0], dtype=torch.bool, device=out_TK.device)
    held.scatter_(0, torch.where(out_TK < 0, num_experts, out_TK).T, True)
    return held[:num_experts]


def violations(s_ET: Tensor, prices_E: Tensor, out_TK: Tensor, band: float) -> Tensor:
    """Token indices whose best expert not held beats their worst held expert by more than
    ``band`` under ``prices`` (score minus price).

    With ``band = delta`` and prices from a converged Bellman-Ford, no violation means no move,
    hence no cycle, gains more than ``delta`` per move: the optimality certificate. With a
    negative band it lists the tokens near a boundary, the candidates for cycles.
    """
    num_experts = s_ET.shape[0]
    a = s_ET - prices_E.view(-1, 1)
    if out_TK.shape[1] == 1 and band >= 0:  # one held expert: the best expert overall decides
        return torch.nonzero(a.amax(dim=0) - a.gather(0, out_TK.T)[0] > band).flatten()
    held = held_mask(out_TK, num_experts)
    worst_held = torch.where(held, a, float("inf")).amin(dim=0)
    best_free = torch.where(held, float("-inf"), a).amax(dim=0)
    return torch.nonzero(best_free - worst_held > band).flatten()


SCAN_WHOLE = 1 << 15  # positions below which a touched group is rescanned whole (cheaper than finding its edges)
GAIN_BLOCK = 1 << 15  # positions whose gains a graph makes at a time (`_Graph._position_gains`)


class _Graph:
    """The exchange graph over the C candidate tokens, kept up to date as tokens move.

    Holds the candidates' scores (E, C) and slots (C, K). The C * K slots sit in positions
    grouped by their expert: a cycle keeps every load, so each group keeps its size, and a slot
    that moves along a cycle takes the position that the slot leaving its new expert frees.
    ``g[pos]`` (C * K, E) is the gain of moving the slot at ``pos`` to every expert (-inf to
    the experts its token holds), and the edge a -> b is the largest ``g[pos, b]`` over a's
    group, so a cycle
    recomputes only its tokens' columns of ``g`` and the edges out of the experts it touches,
    each rescanned only where its largest gain left. Bellman-Ford reads the edges transposed
    and less ``delta``, as ``w_in``, kept alongside.

    ``extra`` (E,) bool, for movable extra slots: the experts at b + 1, which the holder (module
    docstring) does not hold. Its edges join ``w_in`` (not ``gain``, which stays the real tokens'
    best); each group then has one position more, free (``slot`` -1, gains -inf), since a
    group gains one slot when its expert goes from b to b + 1. Non-candidates never move, so
    the candidates at an expert stay within one of their first count and one free position
    suffices. None: loads fixed.
    """

    def __init__(self, s_EC: np.ndarray, out_CK: np.ndarray, delta: float, extra: np.ndarray | None = None) -> None:
        self.out, self.delta, self.extra = out_CK, delta, extra
        self.s_CE = np.ascontiguousarray(s_EC.T)
        num_experts = s_EC.shape[0]
        flat = out_CK.ravel()  # slot i is slot i % K of candidate i // K
        size = np.bincount(flat, minlength=num_experts)
        if extra is None:
            self.slot = np.argsort(flat, kind="stable")  # the slot at each position
            self.pos = np.empty_like(self.slot)
            self.pos[self.slot] = np.arange(self.slot.size)  # the position of each slot
            self.end = np.cumsum(size)
            self.begin = self.end - size
            group = flat[self.slot]
        else:
            self.end = np.cumsum(size + 1)
            self.begin = self.end - size - 1
            order = np.argsort(flat, kind="stable")
            expert = flat[order]
            at = self.begin[expert] + np.arange(order.size) - (np.cumsum(size) - size)[expert]
            self.slot = np.full(int(self.end[-1]), -1, dtype=np.int64)
            self.slot[at] = order
            self.pos = np.empty_like(order)
            self.pos[order] = at
            group = np.repeat(np.arange(num_experts), size + 1)
        g = self._position_gains()
        # every edge at once: a scatter-max of each position's gains into its expert's row
        # (torch's scatter_reduce on the same memory: 5x faster than numpy's reduceat here)
        self.gain = np.full((num_experts, num_experts), -np.inf, dtype=s_EC.dtype)  # gain[a, b]: a -> b
        group = torch.from_numpy(group)[:, None].expand(-1, num_experts)
        torch.from_numpy(self.gain).scatter_reduce_(0, group, torch.from_numpy(g), reduce="amax")
        self.g = g
        self._rebuild_w_in()
        self.through = np.empty_like(self.w_in)
        self.parent = np.empty(num_experts + 1, dtype=np.int64)
        self.rows = np.arange(num_experts)

    def _rebuild_w_in(self) -> None:
        """``w_in[b, a] = gain[a, b] - delta``, with the holder's edges (gain 0) where better."""
        self.w_in = np.ascontiguousarray(self.gain.T - self.delta)
        if self.extra is not None:  # w_in[c, a] for a at b, c at b + 1
            holder = self.extra[:, None] & ~self.extra[None, :]
            np.maximum(self.w_in, -self.delta, out=self.w_in, where=holder)

    def _holder_moves(self, a: list[int], b: list[int]) -> np.ndarray:
        """(N,) bool: which moves a[i] -> b[i] the holder makes (its edge, gain 0, beats every
        real token's)."""
        if self.extra is None:
            return np.zeros(len(a), dtype=bool)
        src, dst = np.asarray(a), np.asarray(b)
        return ~self.extra[src] & self.extra[dst] & (self.gain[src, dst] < 0)

    def _position_gains(self) -> np.ndarray:
        """(positions, E): `_gains` of the slot at every position, in position order (-inf at a
        free one), made ``GAIN_BLOCK`` positions at a time. With many candidates (a group's
        margin, millions of rows) the whole (C * K, E) of `_gains` and its copy in position
        order would hold twice the graph's own memory at once."""
        k = self.out.shape[1]
        g = np.empty((self.slot.size, self.s_CE.shape[1]), dtype=self.s_CE.dtype)
        for p0 in range(0, self.slot.size, GAIN_BLOCK):
            slot = self.slot[p0 : p0 + GAIN_BLOCK]
            block = g[p0 : p0 + slot.size]
            live = np.flatnonzero(slot >= 0)
            if live.size < slot.size:
                block.fill(-np.inf)
            if live.size:
                tokens, j = np.divmod(slot[live], k)
                held = self.out[tokens]  # (n, K)
                rows = np.arange(live.size)
                s = self.s_CE[tokens]  # (n, E), a copy: written in place below
                s -= s[rows, held[rows, j]][:, None]  # the same differences as `_gains`
                s[rows[:, None], held] = -np.inf
                block[live] = s
        return g

    def _gains(self, tokens: np.ndarray) -> np.ndarray:
        """(len(tokens) * K, E): the gain of moving each slot of these candidates (token-major)
        to every expert, -inf to the experts the token holds."""
        held = self.out[tokens]  # (N, K)
        s = self.s_CE[tokens]  # (N, E)
        rows = np.arange(tokens.size)
        if held.shape[1] == 1:  # fewer and smaller calls: this runs once per cycle
            gain = s - s[rows, held[:, 0]][:, None]
            gain[rows, held[:, 0]] = -np.inf
            return gain
        gain = s[:, None, :] - s[rows[:, None], held][:, :, None]  # (N, K, E)
        gain[rows[:, None, None], np.arange(held.shape[1])[None, :, None], held[:, None, :]] = -np.inf
        return gain.reshape(-1, s.shape[1])

    def _movers(self, a: list[int], b: list[int]) -> np.ndarray:
        """For the moves a[i] -> b[i]: the position of the lowest-index token with the best such
        move, (N,)."""
        found = np.empty(len(a), dtype=np.int64)
        k = self.out.shape[1]
        for i, (src, dst) in enumerate(zip(a, b, strict=True)):
            lo = self.begin[src]
            hit = (self.g[lo : self.end[src], dst] == self.gain[src, dst]).nonzero()[0] + lo
            found[i] = hit[np.argmin(self.slot[hit] // k)] if hit.size > 1 else hit[0]
        return found

    def _apply(self, cycles: list[list[int]]) -> None:
        """Move one token along every edge of these node-disjoint cycles (each in move order)."""
        a = [v for cycle in cycles for v in cycle]
        b = [v for cycle in cycles for v in cycle[1:] + cycle[:1]]
        nxt, at = [], 0  # nxt[i]: the move out of b[i]
        for cycle in cycles:
            nxt.extend(range(at + 1, at + len(cycle)))
            nxt.append(at)
            at += len(cycle)
        holder = self._holder_moves(a, b)
        if holder.any():
            self._apply_with_holder(a, b, nxt, holder)
            return
        pos = self._movers(a, b)
        slot = self.slot[pos]
        self.out.ravel()[slot] = b
        new = pos[nxt]  # each slot takes the position the move out of its new expert frees
        self.slot[new] = slot
        self.pos[slot] = new
        self._refresh(slot, b)

    def _refresh(self, slot: np.ndarray, nodes: list[int], full: bool = False) -> None:
        """After the slots ``slot`` moved along cycles through ``nodes``: their tokens' gains
        and the edges out of every expert whose group changed. An edge a -> b is the largest
        gain of a's group to b, so it needs a scan of the group only where a rewritten
        position held that largest gain and holds less now; elsewhere it is the larger of
        itself and the rewritten positions' gains (``full``: scan every edge of the touched
        experts, for a caller that changed other positions too)."""
        k = self.out.shape[1]
        if k == 1:
            tokens, touched = slot, nodes
            at = self.pos[tokens]
        else:
            tokens = np.bincount(slot // k, minlength=self.out.shape[0]).nonzero()[0]
            held = np.bincount(self.out[tokens].ravel(), minlength=self.gain.shape[0])
            held[nodes] += 1  # an expert the holder joined lost a slot that no token now holds
            touched = held.nonzero()[0].tolist()
            at = self.pos[(tokens[:, None] * k + np.arange(k)).ravel()]
        full = full or self.g.shape[0] < SCAN_WHOLE  # small groups: a whole scan costs less
        before = None if full else self.g[at]  # the gains of the slots that left these positions (a copy)
        after = self._gains(tokens)
        self.g[at] = after
        if k == 1 and not full:  # node-disjoint cycles: one rewritten position per touched expert, at[i] in b[i]'s
            self._raise_edges(np.asarray(touched), before, after)
            return
        for e in touched:
            lo, hi = self.begin[e], self.end[e]
            inside = None if full else (at >= lo) & (at < hi)
            if full or not inside.any():
                row = np.maximum.reduce(self.g[lo:hi], axis=0)
            else:
                edge = self.gain[e]
                gone, came = before[inside].max(0), after[inside].max(0)
                row = np.maximum(edge, came)
                rescan = np.flatnonzero((gone >= edge) & (came < edge))  # the largest gain may have left
                if rescan.size:
                    row[rescan] = self.g[lo:hi, rescan].max(0)
            self.gain[e] = row
            self.w_in[:, e] = row - self.delta
            if self.extra is not None and not self.extra[e]:  # the holder's edges out of e
                col = self.w_in[:, e]
                np.maximum(col, -self.delta, out=col, where=self.extra)

    def _raise_edges(self, experts: np.ndarray, before: np.ndarray, after: np.ndarray) -> None:
        """`_refresh` where each of ``experts`` had one position rewritten, from ``before`` to
        ``after`` (one row each): all edges at once, a group scanned only for the columns
        whose largest gain left."""
        edge = self.gain[experts]
        row = np.maximum(edge, after)
        rescan = (before >= edge) & (after < edge)  # the largest gain may have left
        for i in np.flatnonzero(rescan.any(1)):  # one call per expert: a small group is cheaper whole
            lo, hi = self.begin[experts[i]], self.end[experts[i]]
            cols = np.flatnonzero(rescan[i])
            if 4 * cols.size > row.shape[1]:
                row[i] = np.maximum.reduce(self.g[lo:hi], axis=0)
            else:
                row[i, cols] = self.g[lo:hi, cols].max(0)
        self.gain[experts] = row
        self.w_in[:, experts] = row.T - self.delta
        if self.extra is not None:  # the holder's edges out of the experts at b
            at_base = experts[~self.extra[experts]]
            if at_base.size:
                cols = self.w_in[:, at_base]
                np.maximum(cols, -self.delta, out=cols, where=self.extra[:, None])
                self.w_in[:, at_base] = cols

    def _apply_with_holder(self, a: list[int], b: list[int], nxt: list[int], holder: np.ndarray) -> None:
        """`_apply` when the holder makes some of the moves (``holder``). Its move a -> c frees
        no position at a, so the slot arriving at a takes a's free position; at c no slot
        arrives, so the position of the slot leaving c becomes free."""
        real = np.flatnonzero(~holder)
        nxt = np.asarray(nxt)
        prev = np.empty_like(nxt)
        prev[nxt] = np.arange(nxt.size)  # prev[i]: the move into a[i]
        pos = np.full(len(a), -1, dtype=np.int64)
        pos[real] = self._movers([a[i] for i in real], [b[i] for i in real])
        slot = self.slot[pos[real]]
        new = pos[nxt[real]]
        for j, i in enumerate(real.tolist()):
            if holder[nxt[i]]:  # the holder leaves b[i]: the slot takes b[i]'s free position
                lo, hi = self.begin[b[i]], self.end[b[i]]
                new[j] = lo + np.flatnonzero(self.slot[lo:hi] < 0)[0]
        freed = pos[real[holder[prev[real]]]]  # the slots leaving experts that the holder joins
        self.slot[freed] = -1
        self.g[freed] = -np.inf
        self.out.ravel()[slot] = np.asarray(b)[real]
        self.slot[new] = slot
        self.pos[slot] = new
        src, dst = np.asarray(a)[holder], np.asarray(b)[holder]
        self.extra[src], self.extra[dst] = True, False  # a goes to b + 1, c to b
        self._refresh(slot, list(a), full=True)  # the edges out of every node, the holder's included
        for v in np.concatenate([src, dst]).tolist():  # the edges into the experts it left or joined
            row = self.w_in[v]
            np.subtract(self.gain[:, v], self.delta, out=row)
            if self.extra[v]:
                np.maximum(row, -self.delta, out=row, where=~self.extra)

    def cancel(self, max_cycles: int, start: np.ndarray | None = None) -> tuple[bool, int, np.ndarray]:
        """Apply positive cycles until none is left (True) or ``max_cycles`` ran out with one
        still found (False). Returns that flag, the cycles applied and the final distances.
        ``start``: prices the longest-path search starts from (zeros when None). A search that
        finds no cycle then runs once more from ``start``, so the final distances come from it
        over the final assignment, without the rises that moves undone since kept."""
        applied = 0
        dist = np.zeros(self.gain.shape[0], dtype=self.gain.dtype) if start is None else start
        while True:
            cycles, dist = self._search(dist)
            if not cycles and start is not None:
                cycles, dist = self._search(start)
            if not cycles:
                return True, applied, dist
            if applied >= max_cycles:
                return False, applied, dist
            cycles = cycles[: max_cycles - applied]
            applied += len(cycles)
            self._apply(cycles)

    def _search(self, start: np.ndarray) -> tuple[list[list[int]], np.ndarray]:
        """Node-disjoint cycles whose moves gain more than ``delta`` each on average, and the
        longest-path distances (E,): converged ones (prices) when there is no cycle, the ones
        reached so far otherwise (a warm start for the next search).

        Bellman-Ford for longest paths, from the distances ``start`` (any start is sound: a
        cycle of the parent pointers set here is always a positive cycle, and distances that
        no edge can raise prove that no positive cycle is left; starting from the last
        search's distances saves most rounds after a few tokens moved). The start is shifted
        so its largest value is 0: the distances only grow within a search, and in float32
        large values would swallow gains of the order of ``delta``. Cycles of a functional
        graph never share a node. Converged distances are prices under which every move gains
        at most ``delta``. At most E + 1 rounds. (Measured and rejected: collecting more
        disjoint cycles after the first ones by taking their nodes out; the later cycles gain
        less and more cycles are applied in all.)
        """
        n = self.w_in.shape[0]
        dist = start - start.max()  # a constant shift changes nothing but keeps the values small
        parent, through, rows = self.parent, self.through, self.rows
        parent.fill(n)  # n: no parent (a sink that points to itself)
        steps = max(1, (n + 1).bit_length())
        for rnd in range(n + 1):
            np.add(self.w_in, dist, out=through)  # through[b, a] = dist[a] + w(a -> b)
            arg = through.argmax(axis=1)  # first maximal index on ties
            cand = through[rows, arg]
            changed = cand > dist
            if not np.count_nonzero(changed):
                return [], dist
            np.maximum(dist, cand, out=dist)
            np.copyto(parent[:n], arg, where=changed)
            if rnd % 2 == 0 and rnd < n:  # look for a parent cycle every other round (and the last)
                continue
            reach = parent
            for _ in range(steps):  # n + 1 steps along the pointers, by doubling
                reach = reach[reach]
            ends = np.bincount(reach[:n], minlength=n + 1)[:n]  # n + 1 steps end on a cycle or at the sink
            if np.count_nonzero(ends):
                return _parent_cycles(parent[:n].tolist(), ends.nonzero()[0].tolist()), dist
        raise AssertionError("Bellman-Ford changed for E + 1 rounds without a parent cycle")  # impossible


def _parent_cycles(par: list[int], on_cycles: list[int]) -> list[list[int]]:
    """The cycles of the functional graph v -> par[v] through the nodes ``on_cycles`` (each
    node lies on a cycle; several may name the same one), each in move order a -> b."""
    seen, cycles = set(), []
    for start in on_cycles:
        if start in seen:
            continue
        cycle, v = [start], par[start]
        while v != start:
            cycle.append(v)
            v = par[v]
        seen.update(cycle)
        cycle.reverse()  # parent points backwards along the moves
        cycles.append(cycle)
    return cycles


def fill_passes(s_EN: np.ndarray, out_NK: np.ndarray, deficit_E: np.ndarray, p_E: np.ndarray) -> None:
    """The greedy passes of `balanced._fill` on the host, over N short tokens, in place: each
    pass gives every short token its best expert with room that it does not hold (prices
    ``p``); an expert keeps its ``deficit`` claimants with the largest margins over their next
    choice (ties: lowest token index). Stops when all are placed or a pass places nothing."""
    num_experts, n = s_EN.shape
    rows = np.arange(n)
    a = s_EN.T - p_E[None]  # (N, E)
    while True:
        short = (out_NK < 0).any(axis=1).nonzero()[0]
        if short.size == 0:
            return
        held = np.zeros((short.size, num_experts + 1), dtype=bool)
        held[np.arange(short.size)[:, None], out_NK[short]] = True  # -1 marks the extra column
        allowed = ~held[:, :num_experts] & (deficit_E > 0)[None]
        sub = np.where(allowed, a[short], -np.inf)
        best = sub.argmax(axis=1)  # first maximal index on ties
        top = sub[rows[: short.size], best]
        sub[rows[: short.size], best] = -np.inf
        ok = np.flatnonzero(np.isfinite(top))
        if ok.size == 0:
            return
        margin = top[ok] - sub[ok].max(axis=1)  # inf when only one expert is allowed
        win = ok[keep_top_claims(best[ok], margin, deficit_E)]
        tok = short[win]
        out_NK[tok, (out_NK[tok] < 0).argmax(axis=1)] = best[win]
        deficit_E -= np.bincount(best[win], minlength=num_experts)


def keep_top_claims(expert_N: np.ndarray, score_N: np.ndarray, room_E: np.ndarray) -> np.ndarray:
    """(N,) bool: which of N claims each expert keeps, its ``room`` ones with the highest score
    (ties: the earlier claim). The numpy counterpart of `moe.routing.common.drop_by_score`."""
    order = np.lexsort((-score_N, expert_N))  # by expert, score down, position up (stable)
    expert = expert_N[order]
    rank = np.arange(order.size) - np.searchsorted(expert, expert)  # place among its expert's claims
    keep = np.zeros(order.size, dtype=bool)
    keep[order] = rank < room_E[expert]
    return keep


def _host(x: Tensor) -> np.ndarray:
    """A host numpy array of ``x``: on CPU x's own memory (writes to it reach x), elsewhere a
    copy (bf16 and fp16 scores are normalised to fp32 before they get here)."""
    return x.detach().cpu().numpy()


def cancel_cycles(
    s_ET: Tensor,
    out_TK: Tensor,
    *,
    max_cycles: int,
    delta: float,
    candidates: Tensor | None = None,
    band: float = 0.005,
    basis: tuple[Tensor, Tensor] | None = None,
    movable: bool = False,
) -> bool:
    """Improve a complete balanced assignment ``out`` by positive exchange cycles, in place
    (cycles keep every load, so the capacities are those of ``out``).

    Cycles are searched among the ``candidates`` (sorted token indices; all tokens if None),
    typically the tokens within ``band`` of a boundary under some prices. When no cycle is left, the
    Bellman-Ford distances are prices that certify the candidates; every token is checked
    against them in one pass, and if any fails, the candidates become the tokens within twice
    the band of a boundary under those prices (the failing ones included) and the search goes on.
    Returns True when every token passes (the assignment is then optimal up to ``delta`` per
    move), False if ``max_cycles`` cycles were applied first. Scores must lie within [-1, 1].

    ``basis = (prices (E,), margin (T,))`` says how the candidates were chosen: every other token
    holds its K best experts under ``prices``, ahead of the rest by at least ``margin[t]``. Under
    new prices such a token is still ahead unless its margin is below the spread of the price
    changes (the largest minus the smallest), so the first check reads only those tokens.

    ``movable``: the extra slots may change experts (module docstring): the loads must then be b
    or b + 1 with b = T * K // E, and the result is optimal among all such loads.
    """
    return _cancel(
        s_ET, out_TK, max_cycles=max_cycles, delta=delta, candidates=candidates, band=band, basis=basis, movable=movable
    )[0]


def _cancel(
    s_ET: Tensor,
    out_TK: Tensor,
    *,
    max_cycles: int,
    delta: float,
    candidates: Tensor | None = None,
    band: float = 0.005,
    basis: tuple[Tensor, Tensor] | None = None,
    movable: bool = False,
    start: Tensor | None = None,
) -> tuple[bool, Tensor]:
    """`cancel_cycles`, returning also the prices (E,) of its last search, which certify the
    result where it passes. ``start`` (E,): prices every search ends from once it finds no
    cycle (`_Graph.cancel`), so the prices rise from them only where a move needs it; None:
    from zeros."""
    if bool((out_TK < 0).any()):
        raise ValueError("cancel_cycles needs a complete assignment (found slots of -1)")
    num_experts, num_tokens = s_ET.shape
    base, spare = divmod(out_TK.numel(), num_experts)
    movable = movable and spare > 0  # without spare slots the loads are fixed anyway
    if movable:
        loads = torch.bincount(out_TK.flatten(), minlength=num_experts)
        if not bool(((loads == base) | (loads == base + 1)).all()):
            raise ValueError(f"cancel_cycles(movable=True) needs loads of {base} or {base + 1}, got {loads.tolist()}")
    tok = torch.arange(num_tokens, device=s_ET.device) if candidates is None else candidates
    is_candidate = torch.zeros(num_tokens, dtype=torch.bool, device=s_ET.device).index_fill_(0, tok, True)
    band = max(band, 1e-3)
    applied = 0
    first = None if start is None else _host(start.reshape(-1).to(s_ET.dtype))  # the searches only read it
    while True:
        extra = _host(torch.bincount(out_TK.flatten(), minlength=num_experts) > base).copy() if movable else None
        graph = _Graph(_host(s_ET.index_select(1, tok)), _host(out_TK.index_select(0, tok)), delta, extra)
        done, n, dist = graph.cancel(max_cycles - applied, first)
        applied += n
        out_TK[tok] = torch.from_numpy(graph.out).to(out_TK.device)
        prices = torch.from_numpy(dist).to(device=s_ET.device, dtype=s_ET.dtype)
        if not done:
            return False, prices
        if basis is None:
            bad = violations(s_ET, prices, out_TK, delta)
        else:
            shift = prices - basis[0].view(-1)
            reach = float(shift.max() - shift.min()) + delta + 1e-5  # 1e-5: far above rounding in [-1, 1]
            near = torch.nonzero((basis[1] < reach) & ~is_candidate).flatten()
            bad = near[violations(s_ET.index_select(1, near), prices, out_TK.index_select(0, near), delta)]
        if bad.numel() == 0 or bool(is_candidate[bad].all()):  # candidates pass by construction
            return True, prices
        band *= 2  # grow geometrically: a few rebuilds at most
        tok = torch.unique(torch.cat([tok, bad, violations(s_ET, prices, out_TK, -band)]))
        is_candidate.index_fill_(0, tok, True)
        basis = None  # the new candidates come from these prices: check every token from now on
