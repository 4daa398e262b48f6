"""`moe.parallel.paired` in one process: the two sides of a paired step take turns at every
turn point, and an error on one side reaches the caller after the other side has finished
(the pipeline tests run it under DualPipeV: tests/parallel/test_llama_layouts.py)."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD, OVERLAP_F_B, _Action

from moe.parallel.paired import PairedForwardBackward

PAIR = _Action(-1, OVERLAP_F_B, None, (_Action(0, FORWARD, 0), _Action(1, FULL_BACKWARD, 0)))


def _paired(fail: bool):
    torch.manual_seed(0)
    layers = nn.Sequential(*(nn.Linear(4, 4) for _ in range(3)))
    paired = PairedForwardBackward([], torch.device("cpu"))
    paired.attach(layers, lambda m: isinstance(m, nn.Linear))
    x = torch.randn(2, 4, requires_grad=True)
    earlier = layers(x)  # an earlier micro-batch's forward, unpaired: its backward is paired below
    seen = []

    def forward(schedule, action, ctx):
        h = torch.randn(2, 4)
        for i, layer in enumerate(layers):
            h = layer(h)
            seen.append(f"F{i}")
            if fail and i == 1:
                raise ValueError("bad input on the forward side")

    def backward(schedule, action):
        for i, layer in enumerate(layers):
            layer.weight.register_hook(lambda g, i=i: seen.append(f"B{i}"))
        earlier.sum().backward()

    paired._forward, paired._backward = forward, backward
    return paired, x, seen


def test_the_sides_take_turns_at_every_layer():
    paired, x, seen = _paired(fail=False)
    paired(PAIR, SimpleNamespace(schedule_ref=None))
    # F gives the turn before each of its 3 layers, B at each of its 3 layers' output gradient:
    # 4 turns each, the last B's after F has finished
    assert paired.last_log == "FBFBFBFB", paired.last_log
    assert seen == ["F0", "B2", "F1", "B1", "F2", "B0"], seen  # layer by layer, the backward from the last
    assert x.grad is not None and paired.turns is None and paired.pairs == 1


def test_an_error_on_one_side_reaches_the_caller_after_the_other_finished():
    paired, x, seen = _paired(fail=True)
    with pytest.raises(ValueError, match="bad input on the forward side"):
        paired(PAIR, SimpleNamespace(schedule_ref=None))
    assert x.grad is not None, "the backward side did not finish"
    assert paired.turns is None


def test_a_pair_must_be_a_forward_and_a_full_backward():
    paired = PairedForwardBackward([], torch.device("cpu"))
    swapped = _Action(-1, OVERLAP_F_B, None, PAIR.sub_actions[::-1])
    with pytest.raises(ValueError, match="pairs a FORWARD with a FULL_BACKWARD"):
        paired(swapped, SimpleNamespace(schedule_ref=None))
