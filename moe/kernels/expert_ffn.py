"""The SwiGLU expert FFN one expert at a time, on CPU: each expert's hidden activations stay in
cache between its three GEMMs.

Legend: M rows sorted by expert, D model dim, F hidden dim, E experts.

    y_e = (silu(x_e @ w1[e]) * (x_e @ w3[e])) @ w2[e]      for the rows x_e of each expert e

`grouped_mm` per projection runs each GEMM over all M rows before the next, so the (M, F)
gate, up and product stream through memory between them; at M = 65,536 rows and F = 2,816
(fp32) each is 738 MB. Here expert e's product is made in a buffer of its rows only, reused by
every expert, and fed to its down projection while still in cache; backward recomputes it
from the saved gate and up the same way. Every GEMM is the same ``mm`` on the same slices as
`grouped_mm`'s loop and every elementwise op the same as `swiglu`'s, so the results and the
gradients are bit for bit those of ``grouped_mm(swiglu(grouped_mm(x, w1), grouped_mm(x, w3)),
w2)``. Autograd keeps two (M, F) tensors (gate and up) instead of that form's four.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import workspace
from .activation import swiglu
from .grouped_mm import _check, _check_counts, _describe, grouped_mm

__all__ = ["swiglu_ffn", "use_swiglu_ffn"]

# where a layer's experts take it (docs/benchmarks.md, "One expert at a time"): fp32, where it
# measured 0.90-1.02x the whole-row form's time at 128 rows an expert or more on average (at 64,
# 1.09x and 1.19x, with wide spreads); not bf16, where it was slower or even at 10 of 13 points
DTYPES = (torch.float32,)
MIN_ROWS_PER_EXPERT = 128


def use_swiglu_ffn(x_MD: Tensor, w1: Tensor, backend: str) -> bool:
    """Whether a layer's experts take `swiglu_ffn`: the "torch" backend on eager CPU tensors of
    `DTYPES`, with at least `MIN_ROWS_PER_EXPERT` rows an expert on average."""
    return (
        backend == "torch"
        and x_MD.dtype in DTYPES
        and x_MD.shape[0] >= MIN_ROWS_PER_EXPERT * w1.shape[0]
        and workspace.eager(x_MD, w1)
    )


def _whole(x_MD: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, counts_E: Tensor) -> Tensor:
    """The same FFN as three `grouped_mm` over all rows: the formula autograd differentiates for a
    backward that builds a graph."""
    h, up = grouped_mm(x_MD, w1, counts_E), grouped_mm(x_MD, w3, counts_E)
    return grouped_mm(swiglu(h, up), w2, counts_E)


def _spans(rows: list[int]) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of each expert with rows."""
    spans, start = [], 0
    for e, n in enumerate(rows):
        if n:
            spans.append((e, start, start + n))
        start += n
    return spans


class _SwiGLUFFN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MD: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, counts_E: Tensor, saved: bool) -> Tensor:
        # saved: whether a backward may follow (grad mode is off in here, so the caller says);
        # else, as in inference, gate and up are one expert's rows too
        rows = _check_counts(counts_E, x_MD.shape[0])
        (m, d), f, n_max = x_MD.shape, w1.shape[2], max(rows, default=0)
        gate, up = (workspace.empty((m if saved else n_max, f), x_MD.dtype, x_MD.device) for _ in range(2))
        out = workspace.empty((m, d), x_MD.dtype, x_MD.device)
        prod = workspace.empty((n_max, f), x_MD.dtype, x_MD.device)  # one expert's
        for e, i, j in _spans(rows):
            g_e, u_e = (gate[i:j], up[i:j]) if saved else (gate[: j - i], up[: j - i])
            x_e, a_e = x_MD[i:j], prod[: j - i]
            torch.mm(x_e, w1[e], out=g_e)
            torch.mm(x_e, w3[e], out=u_e)
            torch.ops.aten.silu.out(g_e, out=a_e)
            a_e.mul_(u_e)
            torch.mm(a_e, w2[e], out=out[i:j])
        if saved:
            ctx.rows = rows
            ctx.save_for_backward(x_MD, w1, w3, w2, counts_E, gate, up)
        return out

    @staticmethod
    def backward(ctx, dy_MD: Tensor):
        x_MD, w1, w3, w2, counts_E, gate, up = ctx.saved_tensors
        needs = ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph: autograd's own ops, so higher derivatives flow
            plain = lambda *ts: _whole(*ts, counts_E)  # noqa: E731
            return (*workspace.tracked_grads(plain, (x_MD, w1, w3, w2), needs[:4], dy_MD), None, None)
        dy_MD = dy_MD.to(x_MD.dtype).contiguous()  # e.g. the stride-0 gradient of y.sum()
        rows, (m, d), f = ctx.rows, x_MD.shape, w1.shape[2]

        def new(shape):
            return workspace.empty(shape, x_MD.dtype, x_MD.device)

        dx = new((m, d)) if needs[0] else None
        dw1, dw3, dw2 = (new(tuple(w.shape)) if n else None for w, n in zip((w1, w3, w2), needs[1:4], strict=True))
        for dw in (dw for dw in (dw1, dw3, dw2) if dw is not None):
            for e in (e for e, n in enumerate(rows) if n == 0):
                dw[e].zero_()  # an expert without rows
        n_max = max(rows, default=0)
        silu, prod, d_prod, d_gate, d_up = (new((n_max, f)) for _ in range(5))
        part = new((n_max, d)) if needs[0] else None
        for e, i, j in _spans(rows):
            n = j - i
            x_e, g_e, u_e, dy_e = x_MD[i:j], gate[i:j], up[i:j], dy_MD[i:j]
            s_e = torch.ops.aten.silu.out(g_e, out=silu[:n])
            if dw2 is not None:
                torch.mm(torch.mul(s_e, u_e, out=prod[:n]).T, dy_e, out=dw2[e])
            if dx is None and dw1 is None and dw3 is None:
                continue
            da = torch.mm(dy_e, w2[e].T, out=d_prod[:n])
            du = torch.mul(da, s_e, out=d_up[:n])
            dg = torch.mul(da, u_e, out=d_gate[:n])
            torch.ops.aten.silu_backward.grad_input(dg, g_e, grad_input=dg)
            if dw1 is not None:
                torch.mm(x_e.T, dg, out=dw1[e])
            if dw3 is not None:
                torch.mm(x_e.T, du, out=dw3[e])
            if dx is not None:  # the two projections' parts summed as autograd sums them
                torch.mm(dg, w1[e].T, out=dx[i:j])
                dx[i:j].add_(torch.mm(du, w3[e].T, out=part[:n]))
        return dx, dw1, dw3, dw2, None, None


def swiglu_ffn(x_MD: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, counts_E: Tensor) -> Tensor:
    """``grouped_mm(swiglu(grouped_mm(x, w1), grouped_mm(x, w3)), w2)`` one expert at a time:
    (M, D) rows sorted by expert, w1 and w3 (E, D, F), w2 (E, F, D), counts (E,) -> (M, D),
    differentiable in x and the weights, with the same results bit for bit. On eager CPU
    tensors; elsewhere (GPUs, ``torch.func``, tracing, dispatch modes) it is that composition.
    x, counts and w1 are checked as `grouped_mm`'s x, counts and w. Under the profiler the call
    is named ``moe::swiglu_ffn``."""
    _check(x_MD, w1, counts_E, False, "torch")
    e, d, f = w1.shape
    for name, w, shape in (("w3", w3, (e, d, f)), ("w2", w2, (e, f, d))):
        if not isinstance(w, Tensor) or tuple(w.shape) != shape or w.dtype != w1.dtype or w.device != w1.device:
            raise ValueError(
                f"{name} must be an {shape} tensor of w1's dtype {w1.dtype} on {w1.device}, got {_describe(w)}"
                + (f" on {w.device}" if isinstance(w, Tensor) else "")
            )
    if not workspace.eager(x_MD, w1):
        return _whole(x_MD, w1, w3, w2, counts_E)
    saved = torch.is_grad_enabled() and any(t.requires_grad for t in (x_MD, w1, w3, w2))
    args = (x_MD.contiguous(), w1, w3, w2, counts_E.to(torch.int64), saved)
    return workspace.apply_named("moe::swiglu_ffn", _SwiGLUFFN, *args)
