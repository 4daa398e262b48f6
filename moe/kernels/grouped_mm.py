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
from torch import library as torch_library

from . import workspace
from .dtypes import MATMUL_DTYPES
from .reference import grouped_mm_ref

__all__ = ["BACKENDS", "grouped_mm", "resolve_backend"]

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
    if w_EIN.shape[0] < 1:
        raise ValueError(f"w must hold at least one expert, got shape {tuple(w_EIN.shape)}")
    if counts_E.device != x_MI.device and counts_E.device.type != "cpu":
        raise ValueError(f"counts must be on x's device {x_MI.device} or on the CPU, got {counts_E.device}")
    if counts_E.shape[0] != w_EIN.shape[0]:
        raise ValueError(f"counts must have one entry per expert of w (E={w_EIN.shape[0]}), got {counts_E.shape[0]}")
    inner = w_EIN.shape[2] if trans_w else w_EIN.shape[1]
    if x_MI.shape[1] != inner:
        raise ValueError(f"x has inner dim {x_MI.shape[1]} but w{'.T' if trans_w else ''} expects {inner}")
    if x_MI.device != w_EIN.device:
        raise ValueError(f"x and w must be on one device, got {x_MI.device} and {w_EIN.device}")


def resolve_backend(backend: str, x: Tensor) -> str:
    """ "auto" -> "triton" for fp32/bf16/fp16 on CUDA, else "torch" (triton is only imported
    when it is used); "triton" where it cannot run (no CUDA and no interpreter, or fp64) raises
    ValueError."""
    if backend == "auto":
        return "triton" if x.device.type == "cuda" and x.dtype in MATMUL_DTYPES else "torch"
    if backend == "triton":
        from .triton_grouped_mm import triton_available  # needs triton (Linux)

        if not triton_available(x.device, x.dtype):
            raise ValueError(
                f"backend 'triton' runs {[str(d) for d in MATMUL_DTYPES]} on CUDA, or on CPU with "
                f"TRITON_INTERPRET=1; got {x.dtype} on {x.device}"
            )
    return backend


def _describe(t: object) -> str:
    return f"shape {tuple(t.shape)} dtype {t.dtype}" if isinstance(t, Tensor) else type(t).__name__


def _use_grouped_mm_cpu(x_MI: Tensor, w_EIN: Tensor, out_numel: int) -> bool:
    # on CPU: torch._grouped_mm for results under workspace.MIN_BYTES (one call instead of a
    # Python loop: measured faster there), else the loop writing into kept memory (measured
    # faster in the layer, forward + backward: docs/benchmarks.md). _grouped_mm has no fp64
    # kernel and needs non-empty rows and strides that are multiples of 16 bytes.
    size = x_MI.element_size()
    aligned = all(st == 1 or (st * size) % 16 == 0 for st in w_EIN.stride()[1:])
    return (
        x_MI.device.type == "cpu"
        and hasattr(torch, "_grouped_mm")
        and x_MI.dtype in MATMUL_DTYPES
        and out_numel * size < workspace.MIN_BYTES
        and aligned
        and x_MI.shape[1] > 0
        and w_EIN.shape[2] > 0
        and (x_MI.shape[1] * size) % 16 == 0
        and (w_EIN.shape[2] * size) % 16 == 0
    )


def _check_counts(counts_E: Tensor, num_rows: int) -> list[int]:
    """The counts as host ints, checked (one host read). A data-dependent check: it runs inside
    the op, where torch.compile does not trace."""
    rows = counts_E.tolist()
    if min(rows, default=0) < 0 or sum(rows) != num_rows:
        raise ValueError(f"counts must be >= 0 and sum to the M = {num_rows} rows of x, got {rows}")
    return rows


def _offsets(counts_E: Tensor, device: torch.device) -> Tensor:
    """End row of each group, int32 on ``device`` (from host counts: a copy, not a sync)."""
    return torch.cumsum(counts_E, 0).to(device=device, dtype=torch.int32, non_blocking=True)


def _forward(x_MI: Tensor, w: Tensor, counts_E: Tensor, trans_w: bool, backend: str, out_dtype) -> Tensor:
    """y = x @ w[e] per group (w[e].T with trans_w), stored in out_dtype, without autograd."""
    rows = _check_counts(counts_E, x_MI.shape[0])
    w_EIN = w.transpose(1, 2) if trans_w else w  # a view: no copy
    if backend == "triton":
        from .triton_grouped_mm import triton_forward

        return triton_forward(x_MI, w_EIN, counts_E, out_dtype)
    if backend == "ref":
        return grouped_mm_ref(x_MI, w_EIN, counts_E, out_dtype=out_dtype)
    if out_dtype == x_MI.dtype and _use_grouped_mm_cpu(x_MI, w_EIN, x_MI.shape[0] * w_EIN.shape[2]):
        return torch._grouped_mm(x_MI, w_EIN, offs=_offsets(counts_E, x_MI.device))
    out = workspace.empty((x_MI.shape[0], w_EIN.shape[2]), out_dtype, x_MI.device)
    # torch's matmuls accumulate bf16 and fp16 in fp32 (on CPU too: the same error as fp32 math
    # rounded once, measured); a wider out_dtype multiplies in that dtype
    acc = torch.promote_types(x_MI.dtype, out_dtype)
    if acc == out_dtype == x_MI.dtype == w_EIN.dtype:  # the common case: no casts to dispatch
        for x_e, w_e, y_e in zip(x_MI.split(rows), w_EIN.unbind(0), out.split(rows), strict=True):
            torch.mm(x_e, w_e, out=y_e)
        return out
    for x_e, w_e, y_e in zip(x_MI.split(rows), w_EIN.unbind(0), out.split(rows), strict=True):
        if acc == out_dtype:
            torch.mm(x_e.to(acc), w_e.to(acc), out=y_e)
        else:  # e.g. fp16 rows stored as bf16: multiply in fp32, round once
            y_e.copy_(x_e.to(acc) @ w_e.to(acc))
    return out


def _wgrad(x_MI: Tensor, dy_MN: Tensor, counts_E: Tensor, trans_w: bool, backend: str) -> Tensor:
    """dW[e] = X_e.T @ dY_e, in the weight's layout ((E, N, I) with trans_w), x's dtype."""
    if backend == "triton":
        from .triton_grouped_mm import triton_wgrad

        dw_EIN = triton_wgrad(x_MI, dy_MN, counts_E)
    elif backend == "torch" and _use_grouped_mm_cpu(
        x_MI, dy_MN[None], counts_E.numel() * dy_MN.shape[1] * x_MI.shape[1]
    ):
        dw_EIN = torch._grouped_mm(x_MI.T, dy_MN, offs=_offsets(counts_E, x_MI.device))  # dY as a (1, M, N) "w"
    elif backend == "torch":  # straight into the weight's layout: dW[e].T = dY_e.T @ X_e
        shape = (counts_E.shape[0], *((dy_MN.shape[1], x_MI.shape[1]) if trans_w else (x_MI.shape[1], dy_MN.shape[1])))
        dw = workspace.empty(shape, x_MI.dtype, x_MI.device)
        rows = counts_E.tolist()
        for x_e, dy_e, dw_e in zip(x_MI.split(rows), dy_MN.split(rows), dw.unbind(0), strict=True):
            torch.mm(*((dy_e.T, x_e) if trans_w else (x_e.T, dy_e)), out=dw_e)  # zeros for no rows
        return dw
    else:  # the reference: this loop in fp32
        acc = torch.promote_types(x_MI.dtype, torch.float32)
        pairs = zip(x_MI.split(counts_E.tolist()), dy_MN.split(counts_E.tolist()), strict=True)
        dw_EIN = torch.stack([x_e.to(acc).T @ dy_e.to(acc) for x_e, dy_e in pairs]).to(x_MI.dtype)
    return (dw_EIN.transpose(1, 2) if trans_w else dw_EIN).contiguous()


@torch_library.custom_op("moe::grouped_mm", mutates_args=())
def _grouped_mm_op(
    x_MI: Tensor, w: Tensor, counts_E: Tensor, trans_w: bool, backend: str, out_dtype: torch.dtype
) -> Tensor:
    return _forward(x_MI, w, counts_E, trans_w, backend, out_dtype)


@_grouped_mm_op.register_fake
def _(x_MI, w, counts_E, trans_w, backend, out_dtype):
    return x_MI.new_empty(x_MI.shape[0], w.shape[1] if trans_w else w.shape[2], dtype=out_dtype)


@torch_library.custom_op("moe::grouped_mm_wgrad", mutates_args=())
def _wgrad_op(x_MI: Tensor, dy_MN: Tensor, counts_E: Tensor, trans_w: bool, backend: str) -> Tensor:
    return _wgrad(x_MI, dy_MN, counts_E, trans_w, backend)


@_wgrad_op.register_fake
def _(x_MI, dy_MN, counts_E, trans_w, backend):
    i, n = x_MI.shape[1], dy_MN.shape[1]
    return x_MI.new_empty(counts_E.shape[0], *((n, i) if trans_w else (i, n)))


def _setup(ctx, inputs, output) -> None:
    x_MI, w, counts_E, trans_w, backend, _ = inputs
    ctx.save_for_backward(x_MI, w, counts_E)
    ctx.trans_w, ctx.backend = trans_w, backend


def _backward(ctx, dy_MN, plain: bool = False):
    # plain: the functions behind the ops, without their dispatch (a backward building no graph)
    forward, wgrad = (_forward, _wgrad) if plain else (_grouped_mm_op, _wgrad_op)
    x_MI, w, counts_E = ctx.saved_tensors
    dy_MN = dy_MN.to(x_MI.dtype).contiguous()  # e.g. the stride-0 gradient of y.sum()
    dx = dw = None
    if ctx.needs_input_grad[0]:  # dX = dY @ w[e].T: the forward on the transposed weight
        dx = forward(dy_MN, w, counts_E, not ctx.trans_w, ctx.backend, x_MI.dtype)
    if ctx.needs_input_grad[1]:
        dw = wgrad(x_MI, dy_MN, counts_E, ctx.trans_w, ctx.backend)
    return dx, dw, None, None, None, None


_grouped_mm_op.register_autograd(_backward, setup_context=_setup)


class _EagerGroupedMM(torch.autograd.Function):
    """The op's forward and backward without the custom op's dispatch, for eager CPU calls
    (`workspace.usable`, no Python dispatch mode): the dispatch and its autograd wrapper cost
    about 60 us a call, more than a small expert's GEMM. A backward that builds a graph
    (``create_graph``) goes through the differentiable op, so higher derivatives flow as before."""

    @staticmethod
    def forward(ctx, *inputs):
        _setup(ctx, inputs, None)
        return _forward(*inputs)

    @staticmethod
    def backward(ctx, dy_MN):
        return _backward(ctx, dy_MN, plain=not torch.is_grad_enabled())  # grad enabled: create_graph


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
        counts_E: (E,) rows per expert, summing to M; experts may have none. On x's device, or
            on the CPU when x is on an accelerator: host counts spare the op its host syncs.
        out_dtype: result dtype (default x's). fp32, bf16 and fp16 accumulate in fp32.
        backend: "triton" (the kernels of `triton_grouped_mm`: CUDA, or CPU under
            ``TRITON_INTERPRET=1``), "torch" (on CPU, one matmul per expert over contiguous
            slices into memory kept between calls by `workspace`; ``torch._grouped_mm`` for
            results under 1 MiB when the rows are aligned to 16 bytes), "ref"
            (`grouped_mm_ref`), or "auto" (triton on CUDA, torch elsewhere). A backend that
            cannot run here raises ValueError; nothing falls back silently.

    The op is registered as ``torch.ops.moe.grouped_mm`` with a fake implementation and its
    backward (``moe::grouped_mm_wgrad`` for dW), so it compiles under ``torch.compile`` without a
    graph break; eager CPU calls run the same functions without the op's dispatch. Host syncs:
    a few inside the op to check the counts (and to split by them for the loop, or to build the
    Triton tile schedule); none when the counts are on the host.
    """
    _check(x_MI, w_EIN, counts_E, trans_w, backend)
    if out_dtype is not None and not out_dtype.is_floating_point:
        raise ValueError(f"out_dtype must be a floating dtype, got {out_dtype}")
    backend = resolve_backend(backend, x_MI)
    args = (x_MI.contiguous(), w_EIN, counts_E.to(torch.int64), trans_w, backend, out_dtype or x_MI.dtype)
    if backend == "torch" and workspace.eager(x_MI, w_EIN):
        return workspace.apply_named("moe::grouped_mm", _EagerGroupedMM, *args)
    # under a dispatch mode (and on other backends) the op stays one opaque call
    return _grouped_mm_op(*args)
