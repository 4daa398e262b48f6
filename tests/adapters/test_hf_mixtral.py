"""Mixtral's sparse MoE block <-> moe.MoE: same weights, same outputs and gradients, both ways."""

import pytest
import torch

from moe import MoE, MoEConfig

mm = pytest.importorskip("transformers.models.mixtral.modeling_mixtral", reason="needs the hf extra")
hf = pytest.importorskip("moe.adapters.hf")


def mixtral_block(seed=0, d=24, f=40, e=5, k=2):
    torch.manual_seed(seed)
    cfg = mm.MixtralConfig(hidden_size=d, intermediate_size=f, num_local_experts=e, num_experts_per_tok=k)
    block = mm.MixtralSparseMoeBlock(cfg)
    for p in block.parameters():  # a standalone block leaves its weights uninitialised
        torch.nn.init.normal_(p, std=0.2)
    return block


def outputs_and_grads(module, x):
    x = x.clone().requires_grad_()
    y = module(x)
    (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    return y.detach(), x.grad


def test_from_mixtral_same_outputs_and_gradients():
    block = mixtral_block()
    layer = hf.from_mixtral(block)
    x = torch.randn(3, 7, 24)
    y_ref, gx_ref = outputs_and_grads(block, x)
    y, gx = outputs_and_grads(layer, x)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-6)
    f = 40
    torch.testing.assert_close(layer.router.weight.grad, block.gate.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.experts.w1.grad, block.experts.gate_up_proj.grad[:, :f].transpose(1, 2))
    torch.testing.assert_close(layer.experts.w3.grad, block.experts.gate_up_proj.grad[:, f:].transpose(1, 2))
    torch.testing.assert_close(layer.experts.w2.grad, block.experts.down_proj.grad.transpose(1, 2))


def test_to_mixtral_round_trip():
    torch.manual_seed(1)
    layer = MoE(MoEConfig(dim=24, hidden_dim=40, num_experts=5, top_k=2))
    block = hf.to_mixtral(layer)
    x = torch.randn(2, 9, 24)
    torch.testing.assert_close(block(x), layer(x), rtol=1e-5, atol=1e-6)
    back = hf.from_mixtral(block)
    for a, b in zip(back.parameters(), layer.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "name, overrides, match",
    [
        ("tiny-base", {}, "router='base'"),
        ("tiny", {"router_options": {"score_func": "sigmoid"}}, "sigmoid"),
        ("tiny", {"num_shared_experts": 1}, "num_shared_experts"),
        ("tiny", {"capacity_factor": 1.0}, "capacity_factor"),
    ],
)
def test_to_mixtral_refuses_what_mixtral_cannot_express(name, overrides, match):
    with pytest.raises(ValueError, match=match):
        hf.to_mixtral(MoE(MoEConfig.from_name(name, **overrides)))


def test_from_mixtral_rejects_other_modules():
    with pytest.raises(ValueError, match="MixtralSparseMoeBlock"):
        hf.from_mixtral(torch.nn.Linear(4, 4))
