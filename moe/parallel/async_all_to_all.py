"""A differentiable all-to-all split in two: `start` issues it and returns at once, `wait`
makes its result usable. Work placed between the two overlaps the exchange, in the forward and,
because the backward runs the pair in reverse, in the backward too.

    link = InFlightPair(output_splits, input_splits, group)
    y_pending = start(x, link)    # issued, not yet written
    ...                           # compute that overlaps the exchange
    y = wait(y_pending, link)     # now y may be read

``link`` (an `InFlightPair`) ties a `start` to its `wait`. In the backward, `wait`'s node runs
first (its output's gradient is ready when its consumers are done): it issues the reverse
all-to-all of the gradient; `start`'s node waits on it and hands the received gradient to
``x``. Between the two, autograd runs whatever was computed between them in the forward (it
runs ready nodes newest first), so the reverse exchange hides behind the same compute.

Only `wait`'s output may be read: `start`'s is written by the collective while it is in flight.

Backends: gloo (CPU) runs an ``async_op=True`` collective on its own worker threads, so the
host goes on computing; ``Work.wait`` blocks until the data is there. On CUDA the collective is
issued on a side stream that first waits for the current stream (the input is written), and
``wait`` makes the current stream wait for the side stream (the output is written). Both
tensors are marked used on the side stream (``record_stream``) and kept referenced until the
wait, so the caching allocator never hands their memory to another tensor while the exchange
reads or writes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["InFlightPair", "start", "wait"]

_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device):
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device=device)
    return _side_streams[device]


class _InFlight:
    """One all-to-all issued with ``async_op=True``: its output buffer, the work to wait on and
    the tensors that must outlive the exchange."""

    def __init__(self, x: Tensor, output_splits: list[int], input_splits: list[int], group) -> None:
        x = x.contiguous()
        self.out = x.new_empty(sum(output_splits), *x.shape[1:])
        self.stream = _side_stream(x.device) if x.is_cuda else None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(x.device))  # x is written before it is sent
            with torch.cuda.stream(self.stream):
                self.work = dist.all_to_all_single(self.out, x, output_splits, input_splits, group, async_op=True)
            x.record_stream(self.stream)
            self.out.record_stream(self.stream)
        else:
            self.work = dist.all_to_all_single(self.out, x, output_splits, input_splits, group, async_op=True)
        self.keep = x  # referenced until the wait, whatever the caller drops

    def wait(self) -> Tensor:
        if self.work is not None:
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    self.work.wait()  # the side stream waits for the collective
                torch.cuda.current_stream(self.out.device).wait_stream(self.stream)
            else:
                self.work.wait()
            self.work = self.keep = None
        return self.out


class InFlightPair:
    """What a `start` and its `wait` share: the splits and group, and the forward's and the
    backward's exchange in flight."""

    def __init__(self, output_splits: Sequence[int], input_splits: Sequence[int], group) -> None:
        self.outs, self.ins, self.group = list(output_splits), list(input_splits), group
        self.forward: _InFlight | None = None
        self.backward: _InFlight | None = None


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, link: InFlightPair) -> Tensor:
        ctx.link = link
        link.forward = _InFlight(x, link.outs, link.ins, link.group)
        return link.forward.out

    @staticmethod
    def backward(ctx, _sent: Tensor):
        # the gradient `_Wait.backward` sent (the reverse exchange may still be in flight)
        link, ctx.link = ctx.link, None
        grad = link.backward.wait()
        link.backward = None
        return grad, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pending: Tensor, link: InFlightPair) -> Tensor:
        ctx.link = link
        link.forward.wait()
        link.forward = None
        return pending

    @staticmethod
    def backward(ctx, grad: Tensor):
        link, ctx.link = ctx.link, None
        link.backward = _InFlight(grad, link.ins, link.outs, link.group)  # the reverse exchange
        # `_Start.backward` takes the received gradient from the link; what autograd hands it
        # must have the shape of `_Start`'s output: the gradient being sent (no copy) has it
        return grad, None


def start(x: Tensor, link: InFlightPair) -> Tensor:
    """Issue the all-to-all of ``x``'s rows with ``link``'s splits and group (as
    `moe.parallel.all_to_all`; the splits are the caller's contract); the result may be read
    only through `wait`. ``link`` is a fresh `InFlightPair`, one per exchange."""
    return _Start.apply(x, link)


def wait(pending: Tensor, link: InFlightPair) -> Tensor:
    """The result of the `start` that returned ``pending``, once received."""
    return _Wait.apply(pending, link)
