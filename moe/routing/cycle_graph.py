"""The exchange graph over a balanced assignment's candidate tokens (`_Graph`), with its
Bellman-Ford search for positive cycles and their application; `moe.routing.exchange` builds
it, cancels its cycles and certifies the result (the method is described there)."""

from __future__ import annotations

import numpy as np
import torch

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
