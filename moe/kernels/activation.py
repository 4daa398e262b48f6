"""The SwiGLU gate, ``silu(gate) * up``, with a hand-written backward.

    a = s * up,  s = silu(gate)
    d_up = da * s,  d_gate = silu'(gate) * (da * up)

Two elementwise passes forward (silu, mul) and three backward (two muls, silu's backward), as
autograd on ``F.silu(gate) * up`` runs, with the same results; but every (M, F) result (s and
a forward, d_up and d_gate backward) in memory of `workspace`, kept between steps on CPU, where
autograd's land in fresh memory each step: a page fault per 4 KiB of each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import workspace

__all__ = ["swiglu"]


def _plain(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def _like(t: Tensor) -> Tensor:
    return workspace.empty(tuple(t.shape), t.dtype, t.device)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        s = torch.ops.aten.silu.out(gate, out=_like(gate))
        a = torch.mul(s, up, out=_like(up))
        ctx.save_for_backward(gate, up, s)
        return a

    @staticmethod
    def backward(ctx, da: Tensor) -> tuple[Tensor | None, Tensor | None]:
        gate, up, s = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph
            return workspace.tracked_grads(_plain, (gate, up), ctx.needs_input_grad, da)
        d_up = torch.mul(da, s, out=_like(s)) if ctx.needs_input_grad[1] else None
        d_gate = None
        if ctx.needs_input_grad[0]:
            d_gate = torch.mul(da, up, out=_like(up))
            torch.ops.aten.silu_backward.grad_input(d_gate, gate, grad_input=d_gate)
        return d_gate, d_up


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``F.silu(gate) * up`` for two tensors of one shape, dtype and device, with the results of
    autograd's ops, bit for bit. On CPU its results live in `workspace` memory; a backward with
    ``create_graph=True`` then runs the tracked ops autograd runs, so higher derivatives are
    right too. On other devices, under ``torch.func`` transforms and in forward-mode AD it is
    ``F.silu(gate) * up`` itself."""
    if not isinstance(gate, Tensor) or not isinstance(up, Tensor):
        raise ValueError(f"gate and up must be tensors, got {type(gate).__name__} and {type(up).__name__}")
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(
            f"gate and up must match in shape, dtype and device, got {tuple(gate.shape)} {gate.dtype} "
            f"{gate.device} and {tuple(up.shape)} {up.dtype} {up.device}"
        )
    if not gate.is_floating_point():
        raise ValueError(f"gate and up must be floating tensors, got {gate.dtype}")
    if not workspace.usable(gate, up):  # GPUs, torch.func, forward-mode AD: autograd's ops
        return _plain(gate, up)
    if not (gate.requires_grad or up.requires_grad) or not torch.is_grad_enabled():
        s = torch.ops.aten.silu.out(gate, out=_like(gate))
        return s.mul_(up)
    return _SwiGLU.apply(gate.contiguous(), up.contiguous())
