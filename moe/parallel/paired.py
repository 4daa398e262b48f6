"""One micro-batch's forward paired with another's backward, layer by layer, for PyTorch's
`ScheduleDualPipeV` (``pipeline_llama(..., schedule="dualpipev")``).

DualPipeV's steady state is a run of ``OVERLAP_F_B`` actions: a forward of one of the rank's
two stages and a full backward of the other, each on its own micro-batch. PyTorch runs the two
one after the other. `PairedForwardBackward` runs them as two threads that take turns: the
forward runs to the start of its next decoder layer or MoE layer, hands the turn to the
backward, which runs to the start of the backward of its next layer or MoE layer, and so on,
until one is done and the other finishes alone. On a GPU, each side's work is queued on the
device in its turn, so one side's expert-parallel all-to-all (issued on its own stream by the
NCCL collectives, or by ``chunks``) is in flight while the other side's layer computes: the
idea behind DeepSeek's DualPipe and Megatron-core's combined 1F1B.

The turns are strict, at the same points on every rank (the same layers in the same order),
so every rank of an expert-parallel group issues its collectives in the same order and the
pairing cannot deadlock. The arithmetic of each side is that of the unpaired action, so losses
and gradients are those of any other schedule to rounding (gradients of one parameter from
several micro-batches may be summed in another order).

The sides' work is what PyTorch's runtime does for a ``FORWARD`` and a ``FULL_BACKWARD``
action (wait for the stage's input, run it, compute the loss on the last stage, hand the
output to the rank's other stage where the V puts them together); it uses the runtime's
private members for this, as its own custom-function hook expects.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.distributed.pipelining import ScheduleDualPipeV
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
    RECV_F,
    RESHARD,
    SEND_F,
    UNSHARD,
    _Action,
    _wait_batch_p2p,
)

__all__ = ["DualPipeVFullBackward", "PairedForwardBackward"]


class DualPipeVFullBackward(ScheduleDualPipeV):
    """`ScheduleDualPipeV` with every backward whole: its zero-bubble steps, which split a
    backward into the inputs' gradient (``BACKWARD_INPUT``) and later the weights'
    (``BACKWARD_WEIGHT``), run a ``FULL_BACKWARD`` at the first and nothing at the second.
    With FSDP2 the split gave the last stage wrong gradients (off by up to 6x on small entries
    of a norm's weight gradient, at pp=2 x dp_shard=2); whole backwards give the one-process
    ones. The order of forwards and of the paired steps is DualPipeV's.

    `eval` runs the same order without its backward actions (PyTorch's runtime would run them
    in an evaluation too, and fail on the first)."""

    def _calculate_single_rank_operations(self, rank) -> list[_Action | None]:
        out: list[_Action | None] = []
        for a in super()._calculate_single_rank_operations(rank):
            if a is not None and a.computation_type == BACKWARD_WEIGHT:
                continue
            if a is not None and a.computation_type == BACKWARD_INPUT:
                a = _Action(a.stage_index, FULL_BACKWARD, a.microbatch_index)
            out.append(a)
        return out

    def eval(self, *args, **kwargs):
        full = self.pipeline_order_with_comms
        self.pipeline_order_with_comms = {rank: _forward_only(actions) for rank, actions in full.items()}
        try:
            return super().eval(*args, **kwargs)
        finally:
            self.pipeline_order_with_comms = full


_FORWARD_KINDS = (FORWARD, SEND_F, RECV_F, UNSHARD, RESHARD)


def _forward_only(actions: list[_Action]) -> list[_Action]:
    """A rank's actions with its backward ones left out and each paired step cut to its
    forward: every rank keeps its forwards in their order, so the sends and receives still match."""
    out = []
    for a in actions:
        if a.computation_type == OVERLAP_F_B:
            out.extend(sub for sub in a.sub_actions if sub.computation_type == FORWARD)
        elif a.computation_type in _FORWARD_KINDS:
            out.append(a)
    return out


class _Turns:
    """Two sides, "F" and "B", of which only the one holding the turn runs. `wait_turn`
    hands the turn to the other side (if it is still running) and waits until it comes back."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.holder = "F"
        self.running = {"F", "B"}
        self.log: list[str] = []  # which side ran each turn

    def start(self, side: str) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.holder == side)
            self.log.append(side)

    def wait_turn(self, side: str) -> None:
        other = "B" if side == "F" else "F"
        with self.cond:
            if self.holder != side:
                raise RuntimeError(f"the {side} side ran without the turn")
            if other not in self.running:
                return
            self.holder = other
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.holder == side)
            self.log.append(side)

    def done(self, side: str) -> None:
        with self.cond:
            self.running.discard(side)
            self.holder = "B" if side == "F" else "F"
            self.cond.notify_all()


class PairedForwardBackward:
    """The ``OVERLAP_F_B`` function of a `ScheduleDualPipeV` over ``stages``: register it with
    ``schedule.register_custom_function(OVERLAP_F_B, paired)`` after `attach`ing it to every
    stage module. ``last_log`` is the order in which the sides held the turn in the last pair
    (e.g. "FBFB..."), so a test can see that they took turns."""

    def __init__(self, stages: list, device: torch.device) -> None:
        self.stages = {s.stage_index: s for s in stages}
        self.device = device
        self.turns: _Turns | None = None
        self.forward_thread: int | None = None
        self.last_log = ""
        self.pairs = 0

    def attach(self, module: nn.Module, points: Callable[[nn.Module], bool]) -> None:
        """Turn points at the start of every submodule of ``module`` for which ``points`` is true:
        a forward hook before its forward, and a hook on its output's gradient before its
        backward."""
        for sub in module.modules():
            if points(sub):
                sub.register_forward_pre_hook(self._before_forward)
                sub.register_forward_hook(self._after_forward)

    def _before_forward(self, module, args) -> None:
        turns = self.turns
        if turns is not None and threading.get_ident() == self.forward_thread:
            turns.wait_turn("F")

    def _after_forward(self, module, args, out) -> None:
        if isinstance(out, Tensor) and out.requires_grad:
            out.register_hook(self._before_backward)

    def _before_backward(self, grad: Tensor) -> None:
        turns = self.turns
        # the backward runs on the thread that called it (CPU) or on autograd's device thread
        # (CUDA); either way not the forward's, which also tells a recomputed forward apart
        if turns is not None and threading.get_ident() != self.forward_thread:
            turns.wait_turn("B")

    def __call__(self, action, ctx) -> None:
        forward, backward = action.sub_actions
        if forward.computation_type != FORWARD or backward.computation_type != FULL_BACKWARD:
            raise ValueError(f"an OVERLAP_F_B action pairs a FORWARD with a FULL_BACKWARD, got {action.sub_actions}")
        schedule = ctx.schedule_ref
        turns = _Turns()
        errors: dict[str, BaseException] = {}
        state = _thread_state(self.device)

        def side(name: str, run) -> None:
            if name == "F":  # before its first turn point, which tells the sides apart by thread
                self.forward_thread = threading.get_ident()
            try:
                with state():
                    turns.start(name)
                    run()
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                errors[name] = e
            finally:
                turns.done(name)

        f = threading.Thread(target=side, args=("F", lambda: self._forward(schedule, forward, ctx)), daemon=True)
        b = threading.Thread(target=side, args=("B", lambda: self._backward(schedule, backward)), daemon=True)
        self.turns = turns
        f.start()
        b.start()
        f.join()
        b.join()
        self.turns, self.forward_thread = None, None
        self.last_log = "".join(turns.log)
        self.pairs += 1
        for name in ("F", "B"):
            if name in errors:
                raise errors[name]

    def _forward(self, schedule, action, ctx) -> None:
        index, mb = action.stage_index, action.microbatch_index
        stage = self.stages[index]
        if not stage.is_first and index - 1 not in self.stages:
            _wait_batch_p2p(schedule.fwd_recv_ops.pop((index, mb)))
        out = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb])
        schedule._maybe_compute_loss(stage, out, ctx.target_mbs, mb)
        if index + 1 in self.stages:  # the V's two stages on this rank pass it directly
            self.stages[index + 1].set_local_fwd_input(out, mb)

    def _backward(self, schedule, action) -> None:
        index, mb = action.stage_index, action.microbatch_index
        stage = self.stages[index]
        if not stage.is_last and index + 1 not in self.stages:
            _wait_batch_p2p(schedule.bwd_recv_ops.pop((index, mb)))
        loss = schedule._maybe_get_loss(stage, mb)
        schedule.backward_counter[index] += 1
        last = schedule.backward_counter[index] == schedule._n_microbatches
        stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last)
        if index - 1 in self.stages:
            self.stages[index - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)


def _thread_state(device: torch.device):
    """The calling thread's grad mode, autocast and CUDA device, to enter on another thread
    (each is per thread in PyTorch)."""
    grad = torch.is_grad_enabled()
    casts = [
        (kind, torch.get_autocast_dtype(kind))
        for kind in ("cpu", "cuda")
        if torch.is_autocast_enabled(kind)
    ]  # fmt: skip
    cuda = torch.cuda.current_device() if device.type == "cuda" else None

    @contextlib.contextmanager
    def enter():
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(grad))
            for kind, dtype in casts:
                stack.enter_context(torch.autocast(kind, dtype=dtype))
            if cuda is not None:
                stack.enter_context(torch.cuda.device(cuda))
            yield

    return enter
