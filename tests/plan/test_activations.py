"""The activation model against the tensors a real block saves for backward (bf16, CPU, one
process): the planner counts an ideal block, the real one also keeps fp32 copies in RMSNorm
and RoPE, so the measurement must sit above the estimate, by a bounded margin.

``pytest tests/plan/test_activations.py -s`` prints the figures quoted in docs/benchmarks.md."""

from __future__ import annotations

import pytest
import torch

from moe.kernels import workspace
from moe.models.llama import LlamaConfig
from moe.models.llama.model import TransformerBlock, rope_table
from moe.plan.layout import Layout
from moe.plan.memory import layer_activation_elems


def saved_bytes(block: TransformerBlock, x: torch.Tensor, rope: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves in one forward, parameters and the rotary
    table excluded, the block's input included (the previous block's output, kept for backward)."""
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, rope)
    skip = {p.untyped_storage().data_ptr() for p in block.parameters()} | {rope.untyped_storage().data_ptr()}
    skip.add(x.untyped_storage().data_ptr())
    return sum(v for k, v in seen.items() if k not in skip) + x.numel() * x.element_size()


@pytest.mark.parametrize("layer", [0, 1], ids=["dense", "moe"])
def test_activation_estimate_against_saved_tensors(layer):
    torch.manual_seed(0)
    # kept-memory blocks left by earlier tests in this process may be up to twice the size asked
    # for, and a saved tensor counts its whole storage: start from none
    workspace.release()
    cfg = LlamaConfig.from_name("small", max_seq_len=256)
    block = TransformerBlock(layer, cfg)
    block.init_weights(0.02, 0.01)
    block = block.to(torch.bfloat16)
    rope = rope_table(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
    x = torch.randn(2, 256, cfg.dim, dtype=torch.bfloat16, requires_grad=True)
    measured = saved_bytes(block, x, rope)
    estimate = 2 * layer_activation_elems(cfg, Layout(), layer, 2 * 256)
    print(f"\n{'moe' if block.is_moe else 'dense'} block: saved {measured} B, planner {estimate} B, "
          f"ratio {measured / estimate:.3f}")  # fmt: skip
    assert estimate <= measured <= 1.4 * estimate  # a lower bound, within 40%
