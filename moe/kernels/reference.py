"""Pure-torch references for the expert kernels: the executable spec the fast paths are tested
against. Written for clarity, not speed (Python loops over experts and slots).

Legend: T tokens, D model dim, K slots per token, E experts, M rows (sorted slots),
I inner (contraction) dim, N output dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["grouped_mm_ref", "permute_ref", "unpermute_ref"]


def grouped_mm_ref(
    x_MI: Tensor, w_EIN: Tensor, counts_E: Tensor, *, trans_w: bool = False, out_dtype: torch.dtype | None = None
) -> Tensor:
    """Rows [offs[e], offs[e+1]) of x times w[e] (w[e].T when ``trans_w``, w then (E, N, I)).

    Accumulates in fp32 (fp64 for fp64 input) and returns ``out_dtype`` (default x's).
    Differentiable through autograd.
    """
    acc = torch.promote_types(x_MI.dtype, torch.float32)
    out = []
    start = 0
    for e, n in enumerate(counts_E.tolist()):
        w = w_EIN[e].to(acc)
        out.append(x_MI[start : start + n].to(acc) @ (w.T if trans_w else w))
        start += n
    n_out = w_EIN.shape[1] if trans_w else w_EIN.shape[2]
    y = torch.cat(out) if out else x_MI.new_zeros(0, n_out, dtype=acc)
    return y.to(out_dtype or x_MI.dtype)


def permute_ref(x_TD: Tensor, expert_idx_TK: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Slots sorted by expert, stable (token order kept within an expert), slots of -1 skipped.

    Returns x_sorted (M, D), the flat slot index t*K + j of each sorted row (M,), counts (E,).
    """
    k = expert_idx_TK.shape[1]
    slots = [
        (int(e), t * k + j)
        for e in range(num_experts)
        for t in range(expert_idx_TK.shape[0])
        for j in range(k)
        if int(expert_idx_TK[t, j]) == e
    ]
    slot = torch.tensor([s for _, s in slots], dtype=torch.int64, device=x_TD.device)
    counts = torch.tensor([sum(1 for e2, _ in slots if e2 == e) for e in range(num_experts)], dtype=torch.int64)
    return x_TD[slot // k], slot, counts.to(x_TD.device)


def unpermute_ref(y_MD: Tensor, slot_M: Tensor, weights_TK: Tensor) -> Tensor:
    """y_TD[t] = sum over t's kept slots j of weights[t, j] * (row of slot t*K + j), in fp32 or wider."""
    num_tokens, k = weights_TK.shape
    acc = torch.promote_types(y_MD.dtype, torch.float32)
    out = [y_MD.new_zeros(y_MD.shape[1], dtype=acc) for _ in range(num_tokens)]
    for row, s in enumerate(slot_M.tolist()):
        t, j = divmod(s, k)
        out[t] = out[t] + weights_TK[t, j].to(acc) * y_MD[row].to(acc)
    if not out:
        return y_MD.new_zeros(0, y_MD.shape[1])
    return torch.stack(out).to(y_MD.dtype)
