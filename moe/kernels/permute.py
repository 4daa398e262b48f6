"""Sorting token slots by expert and combining expert outputs back per token.

Legend: T tokens, D model dim, K slots per token, E experts, M kept (non -1) slots.

permute is a gather (its backward a scatter-add over tokens); unpermute is a weighted
scatter-add (its backward a gather, and the row-wise dot product for the weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch import library as torch_library

from . import workspace
from .grouped_mm import resolve_backend

__all__ = ["BACKENDS", "PermuteInfo", "permute", "permute_rows", "sort_slots", "unpermute"]


@dataclass(frozen=True)
class PermuteInfo:
    """How the M kept slots were sorted by expert (stable: token order within an expert)."""

    slot: Tensor  # (M,) int64 flat slot index t*K + j of each sorted row
    token: Tensor  # (M,) int64 token of each sorted row
    counts: Tensor  # (E,) int64 rows per expert
    offsets: Tensor  # (E + 1,) int64 first row of each expert, then M
    row_of_slot: Tensor  # (T*K,) int64 sorted row of each slot, -1 where dropped
    num_tokens: int  # T
    top_k: int  # K


BACKENDS = ("auto", "triton", "torch")


def _resolve(backend: str, x: Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return resolve_backend(backend, x)


# The Triton path as custom ops (fake implementations, registered backward), so a compiled
# model does not break its graph on them. The plain gather and combine serve the backwards.
@torch_library.custom_op("moe::triton_gather", mutates_args=())
def _gather_op(src: Tensor, index: Tensor, scale: Tensor | None) -> Tensor:
    from .triton_permute import triton_gather

    return triton_gather(src, index, scale)


@_gather_op.register_fake
def _(src, index, scale):
    return src.new_empty(index.shape[0], src.shape[1])


@torch_library.custom_op("moe::triton_combine", mutates_args=())
def _combine_op(y: Tensor, row_of_slot: Tensor, weights: Tensor) -> Tensor:
    from .triton_permute import triton_combine

    return triton_combine(y, row_of_slot, weights)


@_combine_op.register_fake
def _(y, row_of_slot, weights):
    return y.new_empty(weights.shape[0], y.shape[1])


@torch_library.custom_op("moe::triton_permute", mutates_args=())
def _permute_op(x_TD: Tensor, token: Tensor, row_of_slot: Tensor, top_k: int) -> Tensor:
    return _gather_op(x_TD, token, None)


@_permute_op.register_fake
def _(x_TD, token, row_of_slot, top_k):
    return x_TD.new_empty(token.shape[0], x_TD.shape[1])


def _permute_setup(ctx, inputs, output) -> None:
    x_TD, token, row_of_slot, top_k = inputs
    ctx.save_for_backward(row_of_slot)
    ctx.shape = (x_TD.shape[0], top_k)


def _permute_backward(ctx, dxs_MD):
    (row_of_slot,) = ctx.saved_tensors
    ones = dxs_MD.new_ones(ctx.shape)
    return _combine_op(dxs_MD.contiguous(), row_of_slot, ones), None, None, None


_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)


@torch_library.custom_op("moe::triton_unpermute", mutates_args=())
def _unpermute_op(y_MD: Tensor, weights_TK: Tensor, row_of_slot: Tensor, slot: Tensor, token: Tensor) -> Tensor:
    return _combine_op(y_MD, row_of_slot, weights_TK)


@_unpermute_op.register_fake
def _(y_MD, weights_TK, row_of_slot, slot, token):
    return y_MD.new_empty(weights_TK.shape[0], y_MD.shape[1])


def _unpermute_setup(ctx, inputs, output) -> None:
    y_MD, weights_TK, row_of_slot, slot, token = inputs
    ctx.save_for_backward(y_MD, weights_TK, slot, token)


def _unpermute_backward(ctx, dout_TD):
    y_MD, weights_TK, slot, token = ctx.saved_tensors
    dout_TD = dout_TD.contiguous()
    dy = dw = None
    if ctx.needs_input_grad[0]:
        dy = _gather_op(dout_TD, token, weights_TK.reshape(-1)[slot])
    if ctx.needs_input_grad[1]:  # <dout[t], y[row]> per kept slot, zero where dropped
        dots = (dout_TD.float().index_select(0, token) * y_MD.float()).sum(dim=1)
        dw = weights_TK.new_zeros(weights_TK.numel()).index_copy(0, slot, dots.to(weights_TK.dtype))
        dw = dw.view_as(weights_TK)
    return dy, dw, None, None, None


_unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


# The torch path: a gather and a weighted combine with hand-written backwards, every large
# result in `workspace` memory (kept between steps on CPU, where fresh memory page-faults).
# When every slot is kept (M = T K, known from the shapes) each token's K rows are gathered in
# slot order and summed by one batched matmul, (T, 1, K) @ (T, K, D), instead of a scatter-add
# over tokens, which on CPU sorts the indices and, on two threads, stalls when a core is busy
# (docs/benchmarks.md, "The layer against its peers over a grid of shapes"). A matmul
# accumulates bf16 and fp16 in fp32 and rounds once, so with weights of the rows' dtype the
# sum runs in that dtype: the fp32 result rounded once, without casting the rows to fp32.
def _sum_slots(rows_MD: Tensor, row_of_slot: Tensor, weights_TK: Tensor, acc: torch.dtype) -> Tensor:
    """sum_k weights[t, k] * rows[row_of_slot[t K + k]] for every token t, when M = T K; in
    ``acc``, or in the rows' dtype when the weights have it."""
    num_tokens, k = weights_TK.shape
    if weights_TK.dtype == rows_MD.dtype:
        acc = rows_MD.dtype
    gathered = torch.index_select(rows_MD, 0, row_of_slot, out=_empty(row_of_slot.shape[0], rows_MD))
    out = _empty(num_tokens, rows_MD, acc)
    torch.bmm(
        weights_TK.to(acc).view(num_tokens, 1, k),
        gathered.to(acc).view(num_tokens, k, -1),
        out=out.view(num_tokens, 1, -1),
    )
    return out


class _TorchPermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD: Tensor, token: Tensor, row_of_slot: Tensor, top_k: int) -> Tensor:
        ctx.save_for_backward(token, row_of_slot)
        ctx.num_tokens, ctx.top_k = x_TD.shape[0], top_k
        return torch.index_select(x_TD, 0, token, out=_empty(token.shape[0], x_TD))  # 3x faster than x[idx]

    @staticmethod
    def backward(ctx, dxs_MD: Tensor) -> tuple[Tensor, None, None, None]:
        token, row_of_slot = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: index_add, the backward of the plain gather
            return dxs_MD.new_zeros(ctx.num_tokens, dxs_MD.shape[1]).index_add(0, token, dxs_MD), None, None, None
        if dxs_MD.shape[0] == ctx.num_tokens * ctx.top_k > 0 and dxs_MD.dtype == torch.promote_types(
            dxs_MD.dtype, torch.float32
        ):  # every slot kept: gather and sum each token's K rows
            ones = dxs_MD.new_ones(ctx.num_tokens, ctx.top_k)
            return _sum_slots(dxs_MD, row_of_slot, ones, dxs_MD.dtype), None, None, None
        return _empty(ctx.num_tokens, dxs_MD).zero_().index_add_(0, token, dxs_MD), None, None, None


class _TorchUnpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_MD: Tensor, weights_TK: Tensor, slot: Tensor, token: Tensor, row_of_slot: Tensor) -> Tensor:
        acc = torch.promote_types(y_MD.dtype, torch.float32)
        ctx.save_for_backward(y_MD, weights_TK, slot, token, row_of_slot)
        if y_MD.shape[0] == weights_TK.numel() > 0:  # every slot kept
            return _sum_slots(y_MD, row_of_slot, weights_TK, acc).to(y_MD.dtype)
        w_M = weights_TK.reshape(-1)[slot].to(acc)
        scaled = torch.mul(y_MD, w_M[:, None], out=_empty(y_MD.shape[0], y_MD, acc))
        out = _empty(weights_TK.shape[0], y_MD, acc).zero_().index_add_(0, token, scaled)
        return out.to(y_MD.dtype)

    @staticmethod
    def backward(ctx, dout_TD: Tensor):
        y_MD, weights_TK, slot, token, row_of_slot = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph
            inputs = (y_MD, weights_TK, slot, token)
            return (*workspace.tracked_grads(_unpermute_plain, inputs, ctx.needs_input_grad[:4], dout_TD), None)
        acc = torch.promote_types(y_MD.dtype, torch.float32)
        if y_MD.shape[0] == weights_TK.numel() > 0 and weights_TK.dtype == y_MD.dtype != acc:  # bf16, fp16
            dy, dw = _every_slot_grads(
                ctx.needs_input_grad, dout_TD.to(y_MD.dtype), y_MD, weights_TK, slot, row_of_slot
            )
            return dy, dw, None, None, None
        d_rows = torch.index_select(dout_TD.to(acc), 0, token, out=_empty(token.shape[0], y_MD, acc))
        dw = None
        if ctx.needs_input_grad[1]:  # <dout[t], y[row]> per kept slot, zero where dropped
            dots = torch.mul(d_rows, y_MD, out=_empty(token.shape[0], y_MD, acc)).sum(dim=1)
            dw = weights_TK.new_zeros(weights_TK.numel()).index_copy_(0, slot, dots.to(weights_TK.dtype))
            dw = dw.view_as(weights_TK)
        dy = None
        if ctx.needs_input_grad[0]:  # to() returns d_rows itself when the dtype is already y's
            dy = d_rows.mul_(weights_TK.reshape(-1)[slot].to(acc)[:, None]).to(y_MD.dtype)
        return dy, dw, None, None, None


def _every_slot_grads(needs, dout_TD: Tensor, y_MD: Tensor, weights_TK: Tensor, slot: Tensor, row_of_slot: Tensor):
    """unpermute's (dy, dweights) when every slot is kept and y and the weights are both bf16
    (or fp16), by batched matmuls in that dtype, which accumulate in fp32 and round once, with
    no fp32 copies of the rows: dweights[t, k] = <dout[t], y[row]> over each token's rows
    gathered in slot order, and dy[row] = weights[t, k] dout[t], made in slot order and
    gathered back into row order (row r holds slot ``slot[r]``). In fp32 the elementwise
    product and row sums measured faster, so fp32 keeps them."""
    num_tokens, k = weights_TK.shape
    dout = dout_TD.contiguous().view(num_tokens, -1, 1)
    dy = dw = None
    if needs[1]:
        rows = torch.index_select(y_MD, 0, row_of_slot, out=_empty(row_of_slot.shape[0], y_MD))
        dw = torch.bmm(rows.view(num_tokens, k, -1), dout).view(num_tokens, k)
    if needs[0]:
        per_slot = _empty(slot.shape[0], y_MD)
        torch.bmm(weights_TK.view(num_tokens, k, 1), dout.view(num_tokens, 1, -1), out=per_slot.view(num_tokens, k, -1))
        dy = torch.index_select(per_slot, 0, slot, out=_empty(slot.shape[0], y_MD))
    return dy, dw


def _unpermute_plain(y_MD: Tensor, weights_TK: Tensor, slot: Tensor, token: Tensor) -> Tensor:
    acc = torch.promote_types(y_MD.dtype, torch.float32)
    w_M = weights_TK.reshape(-1)[slot].to(acc)
    out = y_MD.new_zeros(weights_TK.shape[0], y_MD.shape[1], dtype=acc)
    return out.index_add(0, token, y_MD.to(acc) * w_M[:, None]).to(y_MD.dtype)


def _empty(rows: int, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    return workspace.empty((rows, like.shape[1]), dtype or like.dtype, like.device)


def sort_slots(expert_idx_TK: Tensor, *, num_experts: int, num_rows: int | None = None) -> PermuteInfo:
    """The `PermuteInfo` of sorting the kept slots by expert (stable), without moving any rows:
    what the fused ops of `moe.kernels.fused` take. ``expert_idx``: (T, K) int64 in [-1, E),
    -1 for a dropped slot. One host sync (the range check), one more for M; none when the
    caller knows M (``num_rows``, e.g. T*K when nothing can be dropped): both checks then run
    on the device (``torch._assert_async``)."""
    idx = expert_idx_TK
    if not isinstance(idx, Tensor) or idx.dim() != 2 or idx.dtype != torch.int64:
        raise ValueError(
            f"expert_idx must be a (T, K) int64 tensor, got {getattr(idx, 'shape', None)} "
            f"{getattr(idx, 'dtype', type(idx).__name__)}"
        )
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    num_tokens, k = expert_idx_TK.shape
    device = expert_idx_TK.device
    if num_rows is not None and (not isinstance(num_rows, int) or not 0 <= num_rows <= num_tokens * k):
        raise ValueError(f"num_rows must be None or an int in [0, T*K = {num_tokens * k}], got {num_rows!r}")
    if num_rows is not None:
        torch._assert_async(((idx >= -1) & (idx < num_experts)).all(), f"expert_idx must lie in [-1, {num_experts})")
    elif idx.numel():
        lo, hi = (int(v) for v in torch.aminmax(idx))
        if lo < -1 or hi >= num_experts:
            raise ValueError(f"expert_idx must lie in [-1, {num_experts}), got [{lo}, {hi}]")
    key = torch.where(expert_idx_TK < 0, num_experts, expert_idx_TK).reshape(-1)  # dropped slots sort last
    key, order = torch.sort(key, stable=True)
    offsets = torch.searchsorted(key, torch.arange(num_experts + 1, device=device))  # first row of each expert, then M
    counts = offsets.diff()
    if num_rows is None:
        num_rows = int(offsets[-1])
    else:
        torch._assert_async(offsets[-1] == num_rows, f"expert_idx must keep num_rows = {num_rows} slots")
    slot = order[:num_rows]
    row_of_slot = torch.full((num_tokens * k,), -1, dtype=torch.int64, device=device)
    row_of_slot[slot] = torch.arange(slot.numel(), device=device)
    token = slot // k
    return PermuteInfo(slot, token, counts, offsets, row_of_slot, num_tokens=num_tokens, top_k=k)


def permute(
    x_TD: Tensor, expert_idx_TK: Tensor, *, num_experts: int, backend: str = "auto", num_rows: int | None = None
) -> tuple[Tensor, PermuteInfo]:
    """Rows of x repeated per kept slot and sorted by expert: (M, D) and the `PermuteInfo`.

    Slots with expert -1 (dropped) are skipped. ``backend``: "triton" (`triton_permute`),
    "torch" (indexing and autograd), or "auto" (triton on CUDA). Two host syncs (the range of
    expert_idx, and M), none when M is given as ``num_rows`` (see `sort_slots`).
    """
    if not isinstance(x_TD, Tensor) or x_TD.dim() != 2:
        raise ValueError(f"x must be a (T, D) tensor, got {getattr(x_TD, 'shape', type(x_TD).__name__)}")
    idx = expert_idx_TK
    if not isinstance(idx, Tensor) or idx.dim() != 2 or idx.dtype != torch.int64 or idx.shape[0] != x_TD.shape[0]:
        raise ValueError(
            f"expert_idx must be a (T={x_TD.shape[0]}, K) int64 tensor, got {getattr(idx, 'shape', None)} "
            f"{getattr(idx, 'dtype', type(idx).__name__)}"
        )
    if idx.device != x_TD.device:
        raise ValueError(f"x and expert_idx must be on one device, got {x_TD.device} and {idx.device}")
    backend = _resolve(backend, x_TD)
    info = sort_slots(idx, num_experts=num_experts, num_rows=num_rows)
    return permute_rows(x_TD, info, backend=backend), info


def permute_rows(x_TD: Tensor, info: PermuteInfo, *, backend: str = "auto") -> Tensor:
    """The rows of a `permute` whose `PermuteInfo` is known: (M, D). No host sync, so it
    compiles without a graph break (the triton path is the custom op ``moe::triton_permute``)."""
    if not isinstance(x_TD, Tensor) or x_TD.dim() != 2 or x_TD.shape[0] != info.num_tokens:
        raise ValueError(f"x must be a (T={info.num_tokens}, D) tensor, got {getattr(x_TD, 'shape', None)}")
    if _resolve(backend, x_TD) == "triton":
        return _permute_op(x_TD.contiguous(), info.token, info.row_of_slot, info.top_k)
    if workspace.usable(x_TD):
        return _TorchPermute.apply(x_TD, info.token, info.row_of_slot, info.top_k)
    return x_TD.index_select(0, info.token)  # index_select: about 3x faster than x[idx] on CPU


def unpermute(y_MD: Tensor, info: PermuteInfo, weights_TK: Tensor, *, backend: str = "auto") -> Tensor:
    """(M, D) expert outputs -> (T, D): each token's weighted sum over its kept slots.

    Computed in fp32 (or wider), returned in y's dtype; a token with no kept slot gets zeros.
    ``backend`` as for `permute`; the triton combine sums each token's slots in a fixed order.
    """
    if not isinstance(y_MD, Tensor) or y_MD.dim() != 2 or y_MD.shape[0] != info.slot.shape[0]:
        raise ValueError(f"y must be (M={info.slot.shape[0]}, D), got {getattr(y_MD, 'shape', type(y_MD).__name__)}")
    if weights_TK.shape != (info.num_tokens, info.top_k):
        raise ValueError(f"weights must be (T, K) = {(info.num_tokens, info.top_k)}, got {tuple(weights_TK.shape)}")
    if _resolve(backend, y_MD) == "triton":
        return _unpermute_op(y_MD.contiguous(), weights_TK, info.row_of_slot, info.slot, info.token)
    if workspace.usable(y_MD, weights_TK):
        return _TorchUnpermute.apply(y_MD, weights_TK, info.slot, info.token, info.row_of_slot)
    return _unpermute_plain(y_MD, weights_TK, info.slot, info.token)
