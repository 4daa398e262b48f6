"""`checkpoint_and_compile`'s activation checkpointing, in one process: the ops the backward
runs show what was re-run (full: the matmuls and the rest of the forward; selective: the rest
but not the matmuls, whose outputs it keeps), and the gradients are those without it."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from moe.models.llama import Llama, LlamaConfig
from moe.parallel import checkpoint_and_compile


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops_and_grads(ac):
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_name("tiny"))
    if ac is not None:
        checkpoint_and_compile(model, activation_checkpoint=ac)
    tokens = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    with _Ops() as seen:
        loss.backward()
    return seen.ops, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_full_reruns_the_matmuls_selective_keeps_them_and_gradients_agree():
    (none, g_none), (full, g_full), (sel, g_sel) = (_backward_ops_and_grads(ac) for ac in (None, "full", "selective"))
    assert full["mm"] > none["mm"] and sel["mm"] == none["mm"], (none["mm"], full["mm"], sel["mm"])
    assert sel["silu"] > none["silu"] and full["silu"] > none["silu"]  # the activations are re-run
    for name, g in g_none.items():
        torch.testing.assert_close(g_full[name], g, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(g_sel[name], g, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="activation_checkpoint must be"):
        checkpoint_and_compile(Llama(LlamaConfig.from_name("tiny")), activation_checkpoint="some")
