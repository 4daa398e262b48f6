"""Triton kernels for permute (a row gather) and unpermute (a weighted combine per token).

Legend: T tokens, D model dim, K slots per token, M kept slots (sorted rows), BR/BT/BD tiles.

gather:  dst[r] = scale[r] * src[index[r]]          (scale optional)   grid (M / BR, D / BD)
combine: out[t] = sum_j weights[t, j] * y[row[t*K + j]], skipping row -1  grid (T / BT, D / BD)

The combine reads each token's K slots through the inverse map ``row`` (slot -> sorted row), so
it needs no atomics and sums in a fixed order: deterministic. Both accumulate in fp32. Backward:
permute's is the combine with unit weights, unpermute's is the gather scaled by the weights
(plus the row-wise dot product for the weights, done in torch).

Under ``TRITON_INTERPRET=1`` the kernels store fp32 and torch rounds to the result dtype (the
interpreter truncates fp32 -> bf16 stores).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["triton_combine", "triton_gather"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _gather_kernel(
    src_ptr, dst_ptr, index_ptr, scale_ptr, M, D, HAS_SCALE: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr
):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    row_ok = rows < M
    src_rows = tl.load(index_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    mask = row_ok[:, None] & (cols[None, :] < D)
    vals = tl.load(src_ptr + src_rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        vals = vals * tl.load(scale_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(dst_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], vals.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_kernel(y_ptr, row_ptr, w_ptr, out_ptr, T, D, K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    toks = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    tok_ok = toks < T
    col_ok = cols < D
    acc = tl.zeros((BT, BD), dtype=tl.float32)
    for j in tl.static_range(K):
        slot = toks.to(tl.int64) * K + j
        row = tl.load(row_ptr + slot, mask=tok_ok, other=-1).to(tl.int64)
        kept = tok_ok & (row >= 0)
        w = tl.load(w_ptr + slot, mask=kept, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row[:, None] * D + cols[None, :], mask=kept[:, None] & col_ok[None, :], other=0.0)
        acc += w[:, None] * y.to(tl.float32)
    tl.store(out_ptr + toks.to(tl.int64)[:, None] * D + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tok_ok[:, None] & col_ok[None, :])  # fmt: skip


def _tiles() -> tuple[int, int]:
    return (16, 32) if _INTERPRET else (32, 128)


def triton_gather(src_RD: Tensor, index_M: Tensor, scale_M: Tensor | None = None) -> Tensor:
    """(M, D): row r is ``scale[r] * src[index[r]]`` (no scale: a plain gather), src's dtype."""
    src_RD = src_RD.contiguous()
    m, d = index_M.numel(), src_RD.shape[1]
    dst = torch.empty(m, d, device=src_RD.device, dtype=torch.float32 if _INTERPRET else src_RD.dtype)
    if m and d:
        br, bd = _tiles()
        scale = scale_M.contiguous() if scale_M is not None else src_RD  # unused pointer when no scale
        grid = (triton.cdiv(m, br), triton.cdiv(d, bd))
        _gather_kernel[grid](
            src_RD, dst, index_M.contiguous(), scale, m, d, HAS_SCALE=scale_M is not None, BR=br, BD=bd
        )
    return dst.to(src_RD.dtype)


def triton_combine(y_MD: Tensor, row_of_slot_N: Tensor, weights_TK: Tensor) -> Tensor:
    """(T, D): each token's weighted sum of its kept rows (``row_of_slot`` -1 = dropped), y's dtype."""
    y_MD = y_MD.contiguous()
    t, k = weights_TK.shape
    d = y_MD.shape[1]
    out = torch.empty(t, d, device=y_MD.device, dtype=torch.float32 if _INTERPRET else y_MD.dtype)
    if t and d:
        bt, bd = _tiles()
        grid = (triton.cdiv(t, bt), triton.cdiv(d, bd))
        _combine_kernel[grid](y_MD, row_of_slot_N.contiguous(), weights_TK.contiguous(), out, t, d, K=k, BT=bt, BD=bd)
    return out.to(y_MD.dtype)
