"""The permutation fused into the grouped GEMMs, so the sorted copy of the activations is never
materialised (as ScatterMoE does).

Legend: T tokens, K slots per token, M kept slots sorted by expert, I inner dim, N output dim.

    gather_grouped_mm(x_TD, w, info)              == grouped_mm(permute(x_TD)[0], w, info.counts)
    grouped_mm_scatter(h_MI, w, info, weights_TK) == unpermute(grouped_mm(h_MI, w, counts), info, weights_TK)

Triton backend: the first reads row m of A as ``x[token[m]]`` in the GEMM's A-load; the second
multiplies row m by its slot's gate in the epilogue and stores it at row ``slot[m]`` of a
(T*K, N) fp32 buffer (distinct rows: no atomics), whose K rows per token are then summed in a
fixed order. Other backends compose the unfused ops (the reference the fused kernels are
tested against). Backward, with G the output gradient gathered by token:
    gather:  dX = sum over a token's slots of dY @ w[e].T  (the scatter op with unit gates);
             dW[e] = x[token of e's rows].T @ dY_e          (wgrad reading x through token)
    scatter: dH0 = G @ w[e].T (the gather op); dH = gate * dH0; dgate = rowsum(dH0 * H);
             dW[e] = H_e.T @ (gate * G)_e                   (wgrad reading dOut through token)
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch import library as torch_library

from .grouped_mm import _check, _check_counts, _forward, _wgrad, resolve_backend
from .permute import PermuteInfo

__all__ = ["gather_grouped_mm", "grouped_mm_scatter"]


def _w_view(w: Tensor, trans_w: bool) -> Tensor:
    return w.transpose(1, 2) if trans_w else w


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums and products are taken in: fp32 for bf16 / fp16 / fp32, fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def _token(slot_M: Tensor, top_k: int) -> Tensor:
    return torch.div(slot_M, top_k, rounding_mode="floor")


@torch_library.custom_op("moe::gather_mm", mutates_args=())
def _gather_mm_op(
    x_TI: Tensor,
    w: Tensor,
    slot_M: Tensor,
    counts_E: Tensor,
    top_k: int,
    trans_w: bool,
    backend: str,
    out_dtype: torch.dtype,
) -> Tensor:
    _check_counts(counts_E, slot_M.shape[0])
    token_M = _token(slot_M, top_k)
    if backend == "triton":
        from .triton_grouped_mm import triton_forward

        return triton_forward(x_TI, _w_view(w, trans_w), counts_E, out_dtype, a_rows=token_M)
    return _forward(x_TI.index_select(0, token_M), w, counts_E, trans_w, backend, out_dtype)


@_gather_mm_op.register_fake
def _(x_TI, w, slot_M, counts_E, top_k, trans_w, backend, out_dtype):
    return x_TI.new_empty(slot_M.shape[0], w.shape[1] if trans_w else w.shape[2], dtype=out_dtype)


@torch_library.custom_op("moe::mm_scatter", mutates_args=())
def _mm_scatter_op(
    h_MI: Tensor,
    w: Tensor,
    slot_M: Tensor,
    scale_M: Tensor,
    counts_E: Tensor,
    num_tokens: int,
    top_k: int,
    trans_w: bool,
    backend: str,
) -> Tensor:
    _check_counts(counts_E, h_MI.shape[0])
    acc = _acc(h_MI.dtype)
    n = w.shape[1] if trans_w else w.shape[2]
    if backend == "triton":
        from .triton_grouped_mm import triton_forward

        slots = triton_forward(
            h_MI, _w_view(w, trans_w), counts_E, acc, c_rows=slot_M, c_scale=scale_M, out_rows=num_tokens * top_k
        )
        return slots.view(num_tokens, top_k, n).sum(1).to(h_MI.dtype)
    y = _forward(h_MI, w, counts_E, trans_w, backend, h_MI.dtype).to(acc) * scale_M.to(acc)[:, None]
    out = y.new_zeros(num_tokens, n).index_add(0, _token(slot_M, top_k), y)
    return out.to(h_MI.dtype)


@_mm_scatter_op.register_fake
def _(h_MI, w, slot_M, scale_M, counts_E, num_tokens, top_k, trans_w, backend):
    return h_MI.new_empty(num_tokens, w.shape[1] if trans_w else w.shape[2])


@torch_library.custom_op("moe::gather_wgrad", mutates_args=())
def _gather_wgrad_op(
    x: Tensor,
    dy: Tensor,
    counts_E: Tensor,
    a_rows: Tensor | None,
    b_rows: Tensor | None,
    b_scale: Tensor | None,
    trans_w: bool,
    backend: str,
) -> Tensor:
    """dW[e] = X_e.T @ dY_e with X's rows read as x[a_rows] and dY's as b_scale * dy[b_rows]."""
    if backend == "triton":
        from .triton_grouped_mm import triton_wgrad

        dw = triton_wgrad(x, dy, counts_E, a_rows=a_rows, b_rows=b_rows, b_scale=b_scale)
        return (dw.transpose(1, 2) if trans_w else dw).contiguous()
    x_rows = x if a_rows is None else x.index_select(0, a_rows)
    acc = _acc(dy.dtype)
    dy_rows = dy if b_rows is None else (dy.index_select(0, b_rows).to(acc) * b_scale.to(acc)[:, None]).to(dy.dtype)
    return _wgrad(x_rows, dy_rows, counts_E, trans_w, backend)


@_gather_wgrad_op.register_fake
def _(x, dy, counts_E, a_rows, b_rows, b_scale, trans_w, backend):
    i, n = x.shape[1], dy.shape[1]
    return x.new_empty(counts_E.shape[0], *((n, i) if trans_w else (i, n)))


def _gather_setup(ctx, inputs, output) -> None:
    x_TI, w, slot_M, counts_E, top_k, trans_w, backend, _ = inputs
    ctx.save_for_backward(x_TI, w, slot_M, counts_E)
    ctx.top_k, ctx.trans_w, ctx.backend = top_k, trans_w, backend


def _gather_backward(ctx, dy_MN):
    x_TI, w, slot_M, counts_E = ctx.saved_tensors
    dy_MN = dy_MN.to(x_TI.dtype).contiguous()
    dx = dw = None
    if ctx.needs_input_grad[0]:  # each token's slots summed: the scatter with unit gates
        ones = torch.ones(slot_M.shape[0], device=dy_MN.device, dtype=torch.float32)
        dx = _mm_scatter_op(dy_MN, w, slot_M, ones, counts_E, x_TI.shape[0], ctx.top_k, not ctx.trans_w, ctx.backend)
    if ctx.needs_input_grad[1]:
        dw = _gather_wgrad_op(x_TI, dy_MN, counts_E, _token(slot_M, ctx.top_k), None, None, ctx.trans_w, ctx.backend)
    return dx, dw, None, None, None, None, None, None


_gather_mm_op.register_autograd(_gather_backward, setup_context=_gather_setup)


def _scatter_setup(ctx, inputs, output) -> None:
    h_MI, w, slot_M, scale_M, counts_E, num_tokens, top_k, trans_w, backend = inputs
    ctx.save_for_backward(h_MI, w, slot_M, scale_M, counts_E)
    ctx.top_k, ctx.trans_w, ctx.backend = top_k, trans_w, backend


def _scatter_backward(ctx, dout_TN):
    h_MI, w, slot_M, scale_M, counts_E = ctx.saved_tensors
    dout_TN = dout_TN.to(h_MI.dtype).contiguous()
    dh = dw = dscale = None
    if ctx.needs_input_grad[0] or ctx.needs_input_grad[3]:
        dh0 = _gather_mm_op(dout_TN, w, slot_M, counts_E, ctx.top_k, not ctx.trans_w, ctx.backend, h_MI.dtype)
        acc = _acc(h_MI.dtype)
        if ctx.needs_input_grad[0]:
            dh = (dh0.to(acc) * scale_M.to(acc)[:, None]).to(h_MI.dtype)
        if ctx.needs_input_grad[3]:
            dscale = (dh0.to(acc) * h_MI.to(acc)).sum(1).to(scale_M.dtype)
    if ctx.needs_input_grad[1]:
        token_M = _token(slot_M, ctx.top_k)
        dw = _gather_wgrad_op(h_MI, dout_TN, counts_E, None, token_M, scale_M, ctx.trans_w, ctx.backend)
    return dh, dw, None, dscale, None, None, None, None, None


_mm_scatter_op.register_autograd(_scatter_backward, setup_context=_scatter_setup)


def _checked(x: Tensor, w: Tensor, trans_w: bool, backend: str, info: PermuteInfo, rows: str) -> str:
    if not isinstance(info, PermuteInfo):
        raise ValueError(f"info must be the PermuteInfo of moe.kernels.permute, got {type(info).__name__}")
    n = info.num_tokens if rows == "tokens" else info.slot.shape[0]
    if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[0] != n:
        raise ValueError(f"x must have {n} rows (the {rows} of info), got {getattr(x, 'shape', type(x).__name__)}")
    _check(x[:0], w, info.counts, trans_w, backend)
    return resolve_backend(backend, x)


def gather_grouped_mm(
    x_TI: Tensor, w: Tensor, info: PermuteInfo, *, trans_w: bool = False, backend: str = "auto"
) -> Tensor:
    """``grouped_mm(permute(x)[0], w, info.counts)`` without the sorted copy of x: (M, N).

    ``info`` from `moe.kernels.permute` on the same tokens; ``w`` and ``trans_w`` as in
    `grouped_mm`. Differentiable in x and w."""
    backend = _checked(x_TI, w, trans_w, backend, info, "tokens")
    return _gather_mm_op(x_TI.contiguous(), w, info.slot, info.counts, info.top_k, trans_w, backend, x_TI.dtype)


def grouped_mm_scatter(
    h_MI: Tensor, w: Tensor, info: PermuteInfo, weights_TK: Tensor, *, trans_w: bool = False, backend: str = "auto"
) -> Tensor:
    """``unpermute(grouped_mm(h, w, info.counts), info, weights_TK)`` without the sorted copy of
    the product: (T, N), each token's gate-weighted sum over its kept slots, summed in fp32 and
    returned in h's dtype. Differentiable in h, w and the weights."""
    backend = _checked(h_MI, w, trans_w, backend, info, "kept slots")
    if weights_TK.shape != (info.num_tokens, info.top_k):
        raise ValueError(f"weights must be (T, K) = {(info.num_tokens, info.top_k)}, got {tuple(weights_TK.shape)}")
    scale_M = weights_TK.reshape(-1)[info.slot]
    return _mm_scatter_op(
        h_MI.contiguous(), w, info.slot, scale_M, info.counts, info.num_tokens, info.top_k, trans_w, backend
    )
