"""The pick under prices and the greedy fill of the dropped slots.

Legend: T tokens, E experts, K experts per token.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..common import drop_by_score
from ..exchange import _host, fill_passes, held_mask
from .buffers import _Work
from .capacities import _loads
from .prices import _top2


def _top_values(a_ET: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """K+1 largest entries per token (K < E), ties broken by lowest expert index.

    Returns values (K+1, T) and indices (K+1, T); the last row is the best expert *not* taken.
    """
    work = a_ET.clone()
    vals, idxs = [], []
    for j in range(k + 1):
        v, i = work.max(dim=0)  # first maximal index on ties
        vals.append(v)
        idxs.append(i)
        if j < k:
            work.scatter_(0, i[None], float("-inf"))
    return torch.stack(vals), torch.stack(idxs)


def _select(s_ET: Tensor, p: Tensor, k: int, cap_E: Tensor, work: _Work) -> tuple[Tensor, Tensor]:
    """Each token takes its K best experts under prices; a full expert keeps the tokens with the
    largest margins over their next choice (ties: lowest token index) and drops the rest.

    Returns (T, K) expert indices, -1 where a slot was dropped, and each token's margin (T,):
    how much better its K-th pick is than the next.
    """
    num_experts, num_tokens = s_ET.shape
    a = work.shifted(s_ET, p)
    if k == 1:  # fast path: no copy of the scores
        best, idx = a.max(dim=0)  # first maximal index on ties
        vals = torch.stack([best, _top2(a, work)[1]])
        idx = idx[None]
    else:
        vals, idx = _top_values(a, k)
    expert = idx[:k].T.reshape(-1)
    margin_TK = vals[:k] - vals[k]
    keep = drop_by_score(expert, margin_TK.T.reshape(-1), num_experts, cap_E)
    return torch.where(keep, expert, -1).view(num_tokens, k), margin_TK[k - 1]


def _swap_in(s_ET: Tensor, out: Tensor, t: int, deficit: Tensor) -> int:
    """Give token t one more slot when every expert with room already holds t.

    Some other token u moves from an expert f (that t lacks) to an expert d with room (that u
    lacks), and t takes f. Such a (u, f, d) always exists under the capacity rule of
    `expert_capacities` (docs/routing.md); the best-scoring one is applied in place. Returns u.
    """
    num_experts = s_ET.shape[0]
    held = held_mask(out, num_experts)
    f = out.clamp(min=0)  # (T, K): expert of each slot
    best, arg = None, None
    for d in torch.nonzero(deficit > 0).flatten().tolist():
        ok = (out >= 0) & ~held[:, t][f] & ~held[d][:, None]
        ok[t] = False
        gain = s_ET[f, t] - s_ET.gather(0, f.T).T + s_ET[d][:, None]
        gain = torch.where(ok, gain, float("-inf"))
        g, flat = gain.flatten().max(0)
        if bool(torch.isfinite(g)) and (best is None or g > best):
            best, arg = g, (int(flat) // out.shape[1], int(flat) % out.shape[1], d)
    if arg is None:
        raise RuntimeError("balanced_assignment: no feasible exchange found (capacities violate the balance rule)")
    u, j, d = arg
    slot = int(torch.nonzero(out[t] < 0)[0])
    out[t, slot] = out[u, j]
    out[u, j] = d
    return u


def _fill(s_ET: Tensor, out: Tensor, cap_E: Tensor, p: Tensor | None = None) -> list[int]:
    """Complete a partial assignment in place, greedily: each pass gives every short token its
    best expert with room under prices ``p`` (experts keep the claimants with the largest
    margins); when a pass places nothing (every expert with room already holds the short
    tokens) one exchange (`_swap_in`) makes room. The passes run on the host, over the short
    tokens; at most T * K of them. Returns the tokens such exchanges moved (they were complete).
    """
    num_experts = s_ET.shape[0]
    prices = np.zeros(num_experts) if p is None else p.detach().double().cpu().numpy().ravel()
    cap = cap_E.cpu().numpy()
    on_host = out.device.type == "cpu"
    slots = _host(out)  # on CPU out's own memory, elsewhere a copy written back at the end
    moved = []
    while True:
        short = np.flatnonzero((slots < 0).any(axis=1))
        if short.size == 0:
            break
        deficit = cap - np.bincount(slots[slots >= 0], minlength=num_experts)
        sub = slots[short]
        if short.size == s_ET.shape[1] and s_ET.device.type == "cpu":  # every token: no copy of the scores
            s_short = s_ET.detach()
        else:
            s_short = s_ET.detach().index_select(1, torch.from_numpy(short).to(s_ET.device)).cpu()
        if s_short.dtype not in (torch.float32, torch.float64):  # exact in float64
            s_short = s_short.double()
        s_short = s_short.numpy()
        fill_passes(s_short, sub, deficit, prices)  # float64 against the float64 prices, a block at a time
        slots[short] = sub
        stuck = np.flatnonzero((sub < 0).any(axis=1))
        if stuck.size:
            if not on_host:
                out.copy_(torch.from_numpy(slots))
            moved.append(_swap_in(s_ET, out, int(short[stuck[0]]), cap_E - _loads(out, num_experts)))
            if not on_host:
                slots = _host(out)
    if not on_host:
        out.copy_(torch.from_numpy(slots))
    return moved
