"""Grouped matrix multiply: rows sorted by expert times that expert's weight.

Legend: M rows, I inner (contraction) dim, N output dim, E experts.

    y[offs[e]:offs[e+1]] = x[offs[e]:offs[e+1]] @ w[e]        (w: (E, I, N))
    y[offs[e]:offs[e+1]] = x[offs[e]:offs[e+1]] @ w[e].T      (trans_w, w: (E, N, I))

with offs = [0, cumsum(counts)]. Backward: dX = dY @ w[e].T per group, dW[e] = X_e.T @ dY_e
(zero for an expert with no rows).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .reference import grouped_mm_ref

__all__ = ["BACKENDS", "grouped_mm"]

BACKENDS = ("auto", "triton", "torch", "ref")


def _check(x_MI: Tensor, w_EIN: Tensor, counts_E: Tensor, trans_w: bool, backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(x_MI, Tensor) or x_MI.dim() != 2 or not x_MI.is_floating_point():
        raise ValueError(f"x must be a floating (M, I) tensor, got {_describe(x_MI)}")
    if not isinstance(w_EIN, Tensor) or w_EIN.dim() != 3 or w_EIN.dtype != x_MI.dtype:
        raise ValueError(f"w must be an (E, I, N) tensor of x's dtype {x_MI.dtype}, got {_describe(w_EIN)}")
    if not isinstance(counts_E, Tensor) or counts_E.dim() != 1 or counts_E.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"counts must be an (E,) integer tensor, got {_describe(counts_E)}")
    if counts_E.shape[0] != w_EIN.shape[0]:
        raise ValueError(f"counts must have one entry per expert of w (E={w_EIN.shape[0]}), got {counts_E.shape[0]}")
    inner = w_EIN.shape[2] if trans_w else w_EIN.shape[1]
    if x_MI.shape[1] != inner:
        raise ValueError(f"x has inner dim {x_MI.shape[1]} but w{'.T' if trans_w else ''} expects {inner}")
    if x_MI.device != w_EIN.device:
        raise ValueError(f"x and w must be on one device, got {x_MI.device} and {w_EIN.device}")
    if counts_E.numel() and (bool((counts_E < 0).any()) or int(counts_E.sum()) != x_MI.shape[0]):
        raise ValueError(f"counts must be >= 0 and sum to the M = {x_MI.shape[0]} rows of x, got {counts_E.tolist()}")


def _describe(t: object) -> str:
    return f"shape {tuple(t.shape)} dtype {t.dtype}" if isinstance(t, Tensor) else type(t).__name__


class _GroupedMMCPU(torch.autograd.Function):
    """``torch._grouped_mm`` with its backward written out: the built-in CPU backward rejects a
    non-contiguous output gradient (e.g. from ``y.sum()``), so the gradient is made contiguous
    here. dX = dY @ w[e].T and dW[e] = X_e.T @ dY_e are grouped matmuls too."""

    @staticmethod
    def forward(ctx, x_MI, w, counts_E, trans_w):
        offs = torch.cumsum(counts_E, 0).to(torch.int32)
        ctx.save_for_backward(x_MI, w, offs)
        ctx.trans_w = trans_w
        return torch._grouped_mm(x_MI, w.transpose(1, 2) if trans_w else w, offs=offs)

    @staticmethod
    def backward(ctx, dy_MN):
        x_MI, w, offs = ctx.saved_tensors
        w_EIN = w.transpose(1, 2) if ctx.trans_w else w
        dy_MN = dy_MN.to(x_MI.dtype).contiguous()
        dx = torch._grouped_mm(dy_MN, w_EIN.transpose(1, 2), offs=offs) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw_EIN = torch._grouped_mm(x_MI.T, dy_MN, offs=offs)
            dw = (dw_EIN.transpose(1, 2) if ctx.trans_w else dw_EIN).contiguous()
        return dx, dw, None, None


def _use_grouped_mm_cpu(x_MI: Tensor, n_out: int) -> bool:
    # measured faster than the per-expert loop on CPU (docs/benchmarks.md); it has no fp64
    # kernel and needs rows whose byte strides are multiples of 16
    size = x_MI.element_size()
    return (
        x_MI.device.type == "cpu"
        and hasattr(torch, "_grouped_mm")
        and x_MI.dtype in _GROUPED_MM_DTYPES
        and (x_MI.shape[1] * size) % 16 == 0
        and (n_out * size) % 16 == 0
    )


_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm(
    x_MI: Tensor,
    w_EIN: Tensor,
    counts_E: Tensor,
    *,
    trans_w: bool = False,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> Tensor:
    """(M, I) rows sorted by expert -> (M, N); differentiable in x and w.

    Args:
        x_MI: rows grouped by expert, expert e's ``counts[e]`` rows after those of e - 1.
        w_EIN: (E, I, N) weights, or (E, N, I) with ``trans_w`` (used transposed, no copy).
        counts_E: (E,) rows per expert, summing to M; experts may have none.
        out_dtype: result dtype (default x's). fp32, bf16 and fp16 accumulate in fp32.
        backend: "triton" (the kernels of `triton_grouped_mm`: CUDA, or CPU under
            ``TRITON_INTERPRET=1``), "torch" (``torch._grouped_mm`` on CPU for fp32/bf16/fp16,
            else one matmul per expert over contiguous slices), "ref"
            (`grouped_mm_ref`), or "auto" (triton on CUDA, torch elsewhere). A backend that
            cannot run here raises ValueError; nothing falls back silently.

    One host sync to check the counts (and, for torch, to split by them).
    """
    _check(x_MI, w_EIN, counts_E, trans_w, backend)
    out_dtype = out_dtype or x_MI.dtype
    if backend == "auto":
        backend = "triton" if x_MI.device.type == "cuda" else "torch"
    if backend == "triton":
        from .triton_grouped_mm import triton_available, triton_grouped_mm  # needs triton (Linux)

        if not triton_available(x_MI.device):
            raise ValueError(f"backend 'triton' needs a CUDA device or TRITON_INTERPRET=1 on CPU, got {x_MI.device}")
        return triton_grouped_mm(x_MI, w_EIN, counts_E, trans_w, out_dtype)
    if backend == "ref":
        return grouped_mm_ref(x_MI, w_EIN, counts_E, trans_w=trans_w).to(out_dtype)
    if _use_grouped_mm_cpu(x_MI, w_EIN.shape[1] if trans_w else w_EIN.shape[2]):
        return _GroupedMMCPU.apply(x_MI.contiguous(), w_EIN, counts_E, trans_w).to(out_dtype)
    # torch's matmuls accumulate bf16 and fp16 in fp32 (on CPU too: same error as fp32 math
    # rounded once, measured), so no upcast is needed
    ys = [x_e @ (w_EIN[e].T if trans_w else w_EIN[e]) for e, x_e in enumerate(x_MI.split(counts_E.tolist()))]
    n_out = w_EIN.shape[1] if trans_w else w_EIN.shape[2]
    y = torch.cat(ys) if ys else x_MI.new_zeros(0, n_out)
    return y.to(out_dtype)
