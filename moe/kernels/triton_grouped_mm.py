"""Triton grouped GEMM: forward, dgrad and wgrad over rows sorted by expert.

Legend: M rows, I inner (contraction) dim, N output dim, E experts, BM/BI/BN/BK tile sizes.

Forward (and dgrad, which is the forward with the weight transposed):
    y[rows of e] = x[rows of e] @ w[e]          x (M, I), w (E, I, N) by strides, y (M, N)
  One program per (row tile, column tile). Row tiles never straddle two experts: a host-built
  schedule lists, for every expert, its tiles of BM rows (tile_expert, tile_row). Each program
  loops over I in BK steps, accumulating in fp32, and masks the ragged edges of M, I and N.
wgrad:
    dw[e] = x[rows of e].T @ dy[rows of e]      (I, N) per expert
  One program per (expert, I tile, N tile), looping over that expert's rows in BM steps; an
  expert with no rows writes zeros.

Triton's CPU interpreter multiplies bf16 operands of tl.dot wrongly (it uses their raw bits) and
truncates fp32 -> bf16 stores, so under ``TRITON_INTERPRET=1`` the operands are upcast to fp32
first (constexpr UPCAST) and the kernels write fp32, which torch then rounds to the result dtype.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from .dtypes import MATMUL_DTYPES

__all__ = ["triton_available", "triton_forward", "triton_wgrad"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Triton kernels run fp32, bf16 and fp16 on CUDA devices, and on CPU under the interpreter."""
    return dtype in MATMUL_DTYPES and (device.type == "cuda" or (device.type == "cpu" and _INTERPRET))


@triton.jit
def _mma(acc, a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b, accumulated in fp32 (operands upcast first under the interpreter)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return acc + tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _fwd_kernel(
    x_ptr, w_ptr, y_ptr, tile_expert_ptr, tile_row_ptr, row_end_ptr, a_rows_ptr, c_rows_ptr, c_scale_ptr,
    I, N,
    stride_xm, stride_xi, stride_we, stride_wi, stride_wn, stride_ym, stride_yn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    GATHER_A: tl.constexpr, SCATTER_C: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)  # int64 offsets: E*I*N and M*I pass 2^31
    row0 = tl.load(tile_row_ptr + tile).to(tl.int64)
    row_end = tl.load(row_end_ptr + e)
    rows = row0 + tl.arange(0, BM)
    in_rows = rows < row_end
    a_rows = rows
    if GATHER_A:  # row m reads x[a_rows[m]]: the permutation's gather, fused into the A-load
        a_rows = tl.load(a_rows_ptr + rows, mask=in_rows, other=0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        ks = k0 + tl.arange(0, BK)
        a = tl.load(
            x_ptr + a_rows[:, None] * stride_xm + ks[None, :] * stride_xi,
            mask=in_rows[:, None] & (ks[None, :] < I),
            other=0.0,
        )
        b = tl.load(
            w_ptr + e * stride_we + ks[:, None] * stride_wi + cols[None, :] * stride_wn,
            mask=(ks[:, None] < I) & (cols[None, :] < N),
            other=0.0,
        )
        acc = _mma(acc, a, b, UPCAST, PRECISION)
    c_rows = rows
    if SCATTER_C:  # row m, times c_scale[m], goes to y[c_rows[m]]: the weighted scatter, fused
        c_rows = tl.load(c_rows_ptr + rows, mask=in_rows, other=0).to(tl.int64)
        acc = acc * tl.load(c_scale_ptr + rows, mask=in_rows, other=0.0).to(tl.float32)[:, None]
    tl.store(
        y_ptr + c_rows[:, None] * stride_ym + cols[None, :] * stride_yn,
        acc.to(y_ptr.dtype.element_ty),
        mask=in_rows[:, None] & (cols[None, :] < N),
    )


@triton.jit
def _wgrad_kernel(
    x_ptr, dy_ptr, dw_ptr, offs_ptr, a_rows_ptr, b_rows_ptr, b_scale_ptr,
    I, N,
    stride_xm, stride_xi, stride_dym, stride_dyn, stride_dwe, stride_dwi, stride_dwn,
    BM: tl.constexpr, BI: tl.constexpr, BN: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    GATHER_A: tl.constexpr, GATHER_B: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0).to(tl.int64)  # int64 offsets: E*I*N and M*I pass 2^31
    ii = tl.program_id(1).to(tl.int64) * BI + tl.arange(0, BI)
    cols = tl.program_id(2).to(tl.int64) * BN + tl.arange(0, BN)
    start = tl.load(offs_ptr + e).to(tl.int64)
    end = tl.load(offs_ptr + e + 1).to(tl.int64)
    acc = tl.zeros((BI, BN), dtype=tl.float32)
    for m0 in range(start, end, BM):
        ms = m0 + tl.arange(0, BM)
        in_rows = ms < end
        a_rows = ms
        if GATHER_A:  # x rows read through the permutation
            a_rows = tl.load(a_rows_ptr + ms, mask=in_rows, other=0).to(tl.int64)
        b_rows = ms
        if GATHER_B:  # dy rows read through the permutation, times a per-row scale
            b_rows = tl.load(b_rows_ptr + ms, mask=in_rows, other=0).to(tl.int64)
        a = tl.load(
            x_ptr + a_rows[None, :] * stride_xm + ii[:, None] * stride_xi,
            mask=in_rows[None, :] & (ii[:, None] < I),
            other=0.0,
        )
        b = tl.load(
            dy_ptr + b_rows[:, None] * stride_dym + cols[None, :] * stride_dyn,
            mask=in_rows[:, None] & (cols[None, :] < N),
            other=0.0,
        )
        if GATHER_B:
            scale = tl.load(b_scale_ptr + ms, mask=in_rows, other=0.0).to(tl.float32)
            b = (b.to(tl.float32) * scale[:, None]).to(b.dtype)
        acc = _mma(acc, a, b, UPCAST, PRECISION)
    tl.store(
        dw_ptr + e * stride_dwe + ii[:, None] * stride_dwi + cols[None, :] * stride_dwn,
        acc.to(dw_ptr.dtype.element_ty),
        mask=(ii[:, None] < I) & (cols[None, :] < N),
    )


def _precision(dtype: torch.dtype) -> str:
    # fp32 in full IEEE precision, as torch's own matmul by default (tl.dot would use TF32)
    return "ieee" if dtype == torch.float32 else "tf32"


def _blocks(dtype: torch.dtype) -> tuple[int, int, int]:
    if _INTERPRET:  # small tiles keep the interpreter quick
        return 16, 16, 16
    return (64, 128, 64) if dtype != torch.float32 else (64, 64, 32)


def _schedule(counts_E: Tensor, bm: int) -> tuple[Tensor, Tensor, Tensor]:
    """Row tiles of at most BM rows that never straddle two experts: expert, first row, and
    each expert's end row, on the counts' device (the grid size needs the number of tiles on
    the host: a sync unless the counts are there already)."""
    ends = torch.cumsum(counts_E, 0)
    starts = ends - counts_E
    tiles = (counts_E + bm - 1) // bm
    tile_expert = torch.repeat_interleave(torch.arange(counts_E.numel(), device=counts_E.device), tiles)
    first_tile = torch.cumsum(tiles, 0) - tiles
    within = torch.arange(tile_expert.numel(), device=counts_E.device) - first_tile[tile_expert]
    return tile_expert.to(torch.int32), (starts[tile_expert] + within * bm).to(torch.int32), ends.to(torch.int32)


def triton_forward(
    x_MI: Tensor,
    w_EIN: Tensor,
    counts_E: Tensor,
    out_dtype: torch.dtype,
    *,
    a_rows: Tensor | None = None,
    c_rows: Tensor | None = None,
    c_scale: Tensor | None = None,
    out_rows: int | None = None,
) -> Tensor:
    """(M, I) x (E, I, N) by strides -> (M, N), accumulated in fp32 and stored in out_dtype.

    Fusions: ``a_rows`` (M,) makes row m read ``x[a_rows[m]]`` (x then has any number of rows);
    ``c_rows`` (M,) with ``c_scale`` (M,) writes ``c_scale[m] * row m`` to row ``c_rows[m]`` of
    a zero-filled (out_rows, N) result (the indices must be distinct: no atomics)."""
    x_MI = x_MI.contiguous()
    m = a_rows.shape[0] if a_rows is not None else x_MI.shape[0]
    i = x_MI.shape[1]
    n = w_EIN.shape[2]
    store = torch.float32 if _INTERPRET else out_dtype
    scatter = c_rows is not None
    shape = (out_rows, n) if scatter else (m, n)
    y = (torch.zeros if scatter else torch.empty)(shape, device=x_MI.device, dtype=store)
    if m == 0 or n == 0:
        return y.to(out_dtype)
    bm, bn, bk = _blocks(x_MI.dtype)
    tile_expert, tile_row, row_end = (t.to(x_MI.device, non_blocking=True) for t in _schedule(counts_E, bm))
    grid = (tile_expert.numel(), triton.cdiv(n, bn))
    dummy = tile_row  # pointer arguments a disabled fusion never reads
    _fwd_kernel[grid](
        x_MI, w_EIN, y, tile_expert, tile_row, row_end,
        dummy if a_rows is None else a_rows, dummy if c_rows is None else c_rows,
        dummy if c_scale is None else c_scale.contiguous(), i, n,
        x_MI.stride(0), x_MI.stride(1), *w_EIN.stride(), y.stride(0), y.stride(1),
        BM=bm, BN=bn, BK=bk, UPCAST=_INTERPRET, PRECISION=_precision(x_MI.dtype),
        GATHER_A=a_rows is not None, SCATTER_C=scatter,
    )  # fmt: skip
    return y.to(out_dtype)


def triton_wgrad(
    x_MI: Tensor,
    dy_MN: Tensor,
    counts_E: Tensor,
    *,
    a_rows: Tensor | None = None,
    b_rows: Tensor | None = None,
    b_scale: Tensor | None = None,
) -> Tensor:
    """dW (E, I, N) = X_e.T @ dY_e per expert, in x's dtype; zeros for an expert with no rows.

    Fusions: ``a_rows`` reads row m of X as ``x[a_rows[m]]``; ``b_rows`` with ``b_scale`` reads
    row m of dY as ``b_scale[m] * dy[b_rows[m]]``."""
    x_MI, dy_MN = x_MI.contiguous(), dy_MN.contiguous()
    e, i, n = counts_E.numel(), x_MI.shape[1], dy_MN.shape[1]
    dw = torch.empty(e, i, n, device=x_MI.device, dtype=torch.float32 if _INTERPRET else x_MI.dtype)
    offs = torch.cat([counts_E.new_zeros(1), torch.cumsum(counts_E, 0)]).to(x_MI.device, torch.int32, non_blocking=True)
    bm, bn, bk = _blocks(x_MI.dtype)
    grid = (e, triton.cdiv(i, bk), triton.cdiv(n, bn))
    _wgrad_kernel[grid](
        x_MI, dy_MN, dw, offs,
        offs if a_rows is None else a_rows, offs if b_rows is None else b_rows,
        offs if b_scale is None else b_scale.contiguous(), i, n,
        x_MI.stride(0), x_MI.stride(1), dy_MN.stride(0), dy_MN.stride(1), *dw.stride(),
        BM=bm, BI=bk, BN=bn, UPCAST=_INTERPRET, PRECISION=_precision(x_MI.dtype),
        GATHER_A=a_rows is not None, GATHER_B=b_rows is not None,
    )  # fmt: skip
    return dw.to(x_MI.dtype)
