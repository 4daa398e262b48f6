"""Exact-balance expert assignment (BASE layers) as a transportation problem.

Legend: T tokens, E experts, K experts per token, S tokens in a price sample.

Every token gets K distinct experts and expert e gets exactly ``cap[e]`` tokens, where
``cap = expert_capacities(T, E, K)`` (the first ``T*K % E`` experts take one token more).
Among such assignments we maximise the total score.

The optimum is described by E dual prices p: token t takes the K experts with the largest
``s[t, e] - p[e]``. The solver estimates those prices (coarse to fine), lets every token pick
under them, and then completes and certifies the assignment with exchange cycles between
experts (`moe.routing.exchange`). docs/routing.md gives the math.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .common import drop_by_score
from .exchange import cancel_cycles, held_mask

__all__ = ["balanced_assignment", "balanced_assignment_ref", "expert_capacities", "assignment_score"]

_NEG = -1.0e4  # stand-in score for a forbidden (token, expert) pair after normalisation to [-1, 0]


def expert_capacities(num_tokens: int, num_experts: int, k: int = 1, *, device=None) -> Tensor:
    """Tokens per expert under exact balance: (E,) int64.

    ``T*K`` slots are split as evenly as possible; when ``T*K % E = r > 0`` the experts with the
    lowest indices, ``0 .. r-1``, receive one slot more than the others.
    """
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    base, extra = divmod(num_tokens * k, num_experts)
    caps = torch.full((num_experts,), base, dtype=torch.int64, device=device)
    caps[:extra] += 1
    return caps


def assignment_score(scores_TE: Tensor, expert_idx_TK: Tensor) -> Tensor:
    """Total score of an assignment (dropped slots, ``-1``, count zero): scalar in float64."""
    valid = expert_idx_TK >= 0
    picked = scores_TE.double().gather(1, expert_idx_TK.clamp(min=0))
    return (picked * valid).sum()


def _check(scores: Tensor, k: int, name: str = "scores") -> None:
    if not isinstance(scores, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(scores).__name__}")
    if scores.dim() != 2:
        raise ValueError(f"{name} must have shape (T, E), got {tuple(scores.shape)}")
    if not scores.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {scores.dtype}")
    num_experts = scores.shape[1]
    if num_experts < 1:
        raise ValueError(f"{name} must have E >= 1 experts (columns), got E = {num_experts}")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1 or k > num_experts:
        raise ValueError(f"k must be an int in [1, E={num_experts}], got {k!r}")
    if scores.numel() and not bool(torch.isfinite(scores).all()):  # host sync 1
        raise ValueError(f"{name} must be finite: found NaN or Inf in a tensor of shape {tuple(scores.shape)}")


def _normalise(scores: Tensor) -> Tensor:
    """(T, E) -> (E, T), float32 or float64, every token's best score at 0 and all scores in [-1, 0].

    Subtracting a per-token constant and dividing by one positive scale does not change the
    optimal assignment, and makes every later tolerance relative.
    """
    s = scores.to(torch.promote_types(scores.dtype, torch.float32))
    s = s - s.amax(dim=1, keepdim=True)
    scale = (-s.amin()).clamp(min=torch.finfo(s.dtype).tiny)
    return (s / scale).T.contiguous()


def _top_values(a_ET: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """K+1 largest entries per token, ties broken by lowest expert index.

    Returns values (K+1, T) and indices (K+1, T); the last row is the best expert *not* taken
    (-inf when K = E).
    """
    num_experts = a_ET.shape[0]
    work = a_ET.clone()
    vals, idxs = [], []
    for j in range(k + 1):
        if j == num_experts:
            vals.append(torch.full_like(vals[0], float("-inf")))
            idxs.append(torch.zeros_like(idxs[0]))
            break
        v, i = work.max(dim=0)  # first maximal index on ties
        vals.append(v)
        idxs.append(i)
        if j < k:
            work.scatter_(0, i[None], float("-inf"))
    return torch.stack(vals), torch.stack(idxs)


def _margins(a_ET: Tensor, k: int) -> Tensor:
    """(E, T): how far each expert's price may rise before token t stops picking it (> 0), or
    must fall before t picks it (< 0), the other prices fixed."""
    if k == 1:  # fast path: two reductions instead of a sort
        m1 = a_ET.amax(dim=0)
        is_max = a_ET >= m1
        m2 = a_ET.masked_fill(is_max, float("-inf")).amax(dim=0)
        return torch.where(is_max, (m1 - m2).clamp(max=1.0), a_ET - m1)
    top = a_ET.topk(k + 1, dim=0).values if k < a_ET.shape[0] else None
    kth = top[k - 1] if top is not None else a_ET.amin(dim=0)
    nxt = top[k] if top is not None else torch.full_like(kth, -1.0)
    return torch.where(a_ET >= kth, a_ET - nxt, a_ET - kth)


def _jacobi_prices(s_ET: Tensor, target_E: Tensor, k: int, iters: int, p: Tensor, omega: float = 0.7) -> Tensor:
    """Damped Jacobi updates of the prices (E, 1), warm-started from ``p``; also returns the
    largest price move of the last update (a scalar tensor).

    Each update moves every expert's price to the value at which exactly ``target[e]`` tokens
    would pick it were the other prices fixed (the midpoint between two order statistics of
    the margins), damped by ``omega``. Fractional targets interpolate. One host sync (to size
    the order statistics), none inside the loop.
    """
    num_experts, num_tokens = s_ET.shape
    last = s_ET.new_zeros(())
    if num_tokens == 0 or iters <= 0:
        return p, last
    qsize = min(num_tokens, int(target_E.max()) + 2)
    pos = (target_E - 0.5).clamp(0, num_tokens - 1)
    lo_i = pos.floor().long().clamp(max=qsize - 1)
    hi_i = (lo_i + 1).clamp(max=qsize - 1)
    w = (pos - lo_i).to(s_ET.dtype)
    rows = torch.arange(num_experts, device=s_ET.device)
    for _ in range(iters):
        q = _margins(s_ET - p, k).topk(qsize, dim=1).values
        step = omega * (q[rows, lo_i] * (1 - w) + q[rows, hi_i] * w).clamp(-1.0, 1.0)
        p = p + step[:, None]
        last = step.abs().max()
    return p, last


def _prices(s_ET: Tensor, cap_E: Tensor, k: int, max_iters: int) -> Tensor:
    """Prices (E, 1) after ``max_iters`` damped Jacobi updates from zero.

    Two shortcuts were measured and rejected: coarse starts from strided token samples (their
    sampling noise leaves the prices further from the optimum than the all-zero start) and
    freezing tokens far from any boundary after a few updates (on skewed scores the prices
    still move far, and the frozen tokens then cost more exchange cycles than they saved).
    """
    p = s_ET.new_zeros(s_ET.shape[0], 1)
    return _jacobi_prices(s_ET, cap_E.to(s_ET.dtype), k, max_iters, p)[0]


def _select(s_ET: Tensor, p: Tensor, k: int, cap_E: Tensor) -> Tensor:
    """Each token takes its K best experts under prices; a full expert keeps the tokens with the
    largest margins over their next choice (ties: lowest token index) and drops the rest.

    Returns (T, K) expert indices, -1 where a slot was dropped or only forbidden experts remained.
    """
    num_experts, num_tokens = s_ET.shape
    vals, idx = _top_values(s_ET - p, k)
    expert = idx[:k].T.reshape(-1)
    margin = (vals[:k] - vals[k]).T.reshape(-1)
    allowed = (s_ET.gather(0, idx[:k]) > _NEG / 2).T.reshape(-1)
    expert = torch.where(allowed, expert, num_experts)  # forbidden picks get a capacity-0 bin
    cap_ext = torch.cat([cap_E, cap_E.new_zeros(1)])
    keep = drop_by_score(expert, margin, num_experts + 1, cap_ext)
    return torch.where(keep, expert, -1).view(num_tokens, k)


def _swap_in(s_ET: Tensor, out: Tensor, t: int, deficit: Tensor) -> None:
    """Give token t one more slot when every expert with room already holds t.

    Some other token u moves from an expert f (that t lacks) to an expert d with room (that u
    lacks), and t takes f. Such a (u, f, d) always exists under the capacity rule of
    `expert_capacities` (docs/routing.md); the best-scoring one is applied in place.
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


def _fill(s_ET: Tensor, out: Tensor, cap_E: Tensor, p: Tensor | None = None) -> None:
    """Complete a partial assignment in place, greedily: each pass gives every short token its
    best expert with room under prices ``p`` (experts keep the claimants with the largest
    margins); a pass that places nothing (every expert with room already holds the short
    tokens) falls back to one exchange. At most T * K passes.
    """
    num_experts = s_ET.shape[0]
    while True:
        missing = out < 0
        short = torch.nonzero(missing.any(dim=1)).flatten()
        if short.numel() == 0:
            return
        deficit = cap_E - torch.bincount(out[out >= 0], minlength=num_experts)
        forbid = held_mask(out[short], num_experts) | (deficit <= 0)[:, None]
        sub = s_ET[:, short].masked_fill(forbid, _NEG)
        pick = _select(sub, sub.new_zeros(num_experts, 1) if p is None else p, 1, deficit)[:, 0]
        placed = pick >= 0
        if not bool(placed.any()):
            _swap_in(s_ET, out, int(short[0]), deficit)
            continue
        first_missing = missing[short].int().argmax(dim=1)
        out[short[placed], first_missing[placed]] = pick[placed]


def _round_robin(num_tokens: int, num_experts: int, k: int, device) -> Tensor:
    """A feasible balanced assignment: slot i (token-major) goes to expert i mod E."""
    return (torch.arange(num_tokens * k, device=device) % num_experts).view(num_tokens, k)


def balanced_assignment(
    scores_TE: Tensor,
    k: int = 1,
    *,
    max_iters: int = 6,
    eps: float = 1e-6,
    max_cycles: int = 256,
) -> Tensor:
    """Assign every token K distinct experts with exactly balanced loads, maximising the score.

    Args:
        scores_TE: (T, E) finite floating scores (higher is better). Not differentiated.
        k: experts per token, 1 <= k <= E.
        max_iters: price iterations (damped Jacobi, coarse to fine); a fixed count.
        eps: an exchange cycle is applied only when it gains more than ``eps`` per move, relative
            to the score range of the input; gains below that count as ties.
        max_cycles: cap on the exchange cycles applied to complete and certify the assignment.

    Returns:
        expert_idx (T, K) int64. Expert e receives exactly ``expert_capacities(T, E, k)[e]``
        tokens (loads differ by at most one; the extra tokens go to the lowest-index experts).
        Whenever fewer than ``max_cycles`` cycles were needed (checked on every token) the
        assignment is optimal up to ``eps`` per move; otherwise it is completed greedily.

    Algorithm (docs/routing.md): estimate the E dual prices; every token picks its K best experts
    under them and full experts keep their highest-margin tokens; then exchange cycles between
    experts place the dropped slots and remove every improvement. Every loop is bounded.

    Host syncs: one for the input check, one to size the price search, and per exchange cycle
    one per Bellman-Ford round (early exit; typically 2-6). None inside the price iterations.
    Deterministic: ties go to the lowest expert index, then the lowest token index.
    """
    _check(scores_TE, k)
    if max_iters < 0 or max_cycles < 0 or eps < 0:
        raise ValueError(f"max_iters, max_cycles and eps must be >= 0, got {max_iters}, {max_cycles}, {eps}")
    num_tokens, num_experts = scores_TE.shape
    device = scores_TE.device
    if num_tokens == 0:
        return torch.empty(0, k, dtype=torch.int64, device=device)
    if k == num_experts:  # every token takes every expert
        return torch.arange(k, device=device).expand(num_tokens, k).clone()
    with torch.no_grad():
        s = _normalise(scores_TE)
        cap = expert_capacities(num_tokens, num_experts, k, device=device)
        p = _prices(s, cap, k, max_iters)
        out = _select(s, p, k, cap)
        _fill(s, out, cap, p)
        cancel_cycles(s, out, cap, max_cycles=max_cycles, delta=eps, prices_E=p, band=0.005)
        _fill(s, out, cap)  # only does work if the cycle budget ran out first
    return out


def balanced_assignment_ref(scores_TE: Tensor, k: int = 1, *, eps: float = 1e-9) -> Tensor:
    """Reference solver: a round-robin balanced start, then exchange cycles until none is left.

    Exactly optimal (up to ``eps`` per move, relative to the score range); slow (one cycle per
    step over all tokens), for tests and small inputs.
    """
    _check(scores_TE, k)
    num_tokens, num_experts = scores_TE.shape
    out = _round_robin(num_tokens, num_experts, k, scores_TE.device)
    if num_tokens == 0:
        return out
    with torch.no_grad():
        s = _normalise(scores_TE.double())
        cap = expert_capacities(num_tokens, num_experts, k, device=scores_TE.device)
        cancel_cycles(s, out, cap, max_cycles=10**9, delta=eps)
    return out
