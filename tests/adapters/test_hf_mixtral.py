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


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def test_moeify_upcycled_llama_keeps_its_logits_and_generates():
    from moe import aux_loss

    model = tiny_llama()
    ids = torch.randint(0, 64, (2, 11))
    with torch.no_grad():
        before = model(ids).logits
    hf.moeify(model, MoEConfig(dim=32, hidden_dim=48, num_experts=4, top_k=2, aux_loss_coef=0.01))
    assert all(isinstance(layer.mlp, MoE) for layer in model.model.layers)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-5, atol=1e-5)
    out = model.generate(ids[:, :4], max_new_tokens=3, do_sample=False)
    assert out.shape == (2, 7)
    model.train()
    out = model(ids, labels=ids)  # the hook added the MoE losses to out.loss
    assert aux_loss(model).item() == 0.0  # already collected by the hook
    logits_loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))
    assert out.loss.item() > logits_loss.item()  # the aux loss (coef 0.01) is in there
    out.loss.backward()
    assert model.model.layers[0].mlp.router.weight.grad is not None


def test_moeify_checks_shapes_and_layers():
    model = tiny_llama()
    with pytest.raises(ValueError, match="hidden_dim=48"):
        hf.moeify(model, MoEConfig(dim=32, hidden_dim=40, num_experts=4))
    hf.moeify(model, MoEConfig(dim=32, hidden_dim=48, num_experts=4), layers=[1])
    assert not isinstance(model.model.layers[0].mlp, MoE) and isinstance(model.model.layers[1].mlp, MoE)
    with pytest.raises(ValueError, match="model.layers"):
        hf.moeify(torch.nn.Linear(2, 2), MoEConfig(dim=32, hidden_dim=48, num_experts=4))


def test_export_mixtral_has_the_same_logits():
    model = tiny_llama(seed=3)
    hf.moeify(model, MoEConfig(dim=32, hidden_dim=48, num_experts=4, top_k=2), noise=0.05)  # experts differ
    model.eval()
    mixtral = hf.export_mixtral(model)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(mixtral(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_export_mixtral_refuses_what_mixtral_cannot_express():
    model = tiny_llama()
    hf.moeify(model, MoEConfig(dim=32, hidden_dim=48, num_experts=4), layers=[0])
    with pytest.raises(ValueError, match=r"layers \[1\] are dense"):
        hf.export_mixtral(model)
    model = tiny_llama()
    hf.moeify(model, MoEConfig(dim=32, hidden_dim=48, num_experts=4, top_k=1, router="base"))
    with pytest.raises(ValueError, match="router='base'"):
        hf.export_mixtral(model)


def test_save_and_load_pretrained_round_trip(tmp_path):
    model = tiny_llama(seed=4)
    hf.moeify(
        model,
        MoEConfig(dim=32, hidden_dim=48, num_experts=4, top_k=1, router="base", combine="sigmoid_residual"),
        layers=[0],
    )
    model.eval()
    hf.save_pretrained(model, tmp_path / "ckpt")
    back = hf.load_pretrained(tmp_path / "ckpt")
    assert isinstance(back.model.layers[0].mlp, MoE) and not isinstance(back.model.layers[1].mlp, MoE)
    for (na, a), (nb, b) in zip(model.state_dict().items(), back.state_dict().items(), strict=True):
        assert na == nb and torch.equal(a, b)
    ids = torch.randint(0, 64, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits)


def test_save_and_load_pretrained_keeps_bf16(tmp_path):
    model = tiny_llama(seed=5)
    hf.moeify(model, MoEConfig(dim=32, hidden_dim=48, num_experts=4, top_k=2), layers=[1], noise=0.05)
    model = model.to(torch.bfloat16).eval()
    hf.save_pretrained(model, tmp_path / "ckpt")
    assert model.config.dtype is None  # the saved config names the dtype; the model's own is untouched
    back = hf.load_pretrained(tmp_path / "ckpt")
    assert {p.dtype for p in back.parameters()} == {torch.bfloat16}
    for (na, a), (nb, b) in zip(model.state_dict().items(), back.state_dict().items(), strict=True):
        assert na == nb and a.dtype == b.dtype and torch.equal(a, b)
    ids = torch.randint(0, 64, (1, 7))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)


def test_save_pretrained_refuses_what_it_cannot_save(tmp_path):
    with pytest.raises(ValueError, match=r"save a bare MoE with torch.save"):
        hf.save_pretrained(MoE(MoEConfig.from_name("tiny")), tmp_path / "a")
    with pytest.raises(ValueError, match=r"model.layers"):
        hf.save_pretrained(torch.nn.Linear(2, 2), tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # nothing half-written


def test_to_mixtral_refuses_a_non_moe():
    with pytest.raises(ValueError, match=r"layer must be a moe.MoE, got Linear"):
        hf.to_mixtral(torch.nn.Linear(4, 4))


def test_from_mixtral_refuses_router_jitter_noise():
    block = mixtral_block()
    block.jitter_noise = 0.01
    with pytest.raises(ValueError, match=r"router_jitter_noise=0.01 .* no MoE equivalent"):
        hf.from_mixtral(block)
    block.jitter_noise = 0.0  # the documented way to convert without it
    assert isinstance(hf.from_mixtral(block), MoE)


@pytest.mark.parametrize(
    "layers, match",
    [
        ([0, 0], r"layers must be distinct, got \[0\] more than once"),
        ([2], r"layers must be indices in \[0, 2\) \(the model has 2 decoder layers\), got \[2\]"),
        ([-1], r"got \[-1\]"),
        ([True], r"got \[True\]"),
        ([0.0], r"got \[0.0\]"),
        (1, r"layers must be None or a list of decoder layer indices, got int"),
    ],
)
def test_moeify_refuses_bad_layer_indices_and_changes_nothing(layers, match):
    model = tiny_llama()
    with pytest.raises(ValueError, match=match):
        hf.moeify(model, MoEConfig(dim=32, hidden_dim=48, num_experts=4), layers=layers)
    assert not any(isinstance(layer.mlp, MoE) for layer in model.model.layers)


def test_moeify_twice_is_refused_and_a_refused_call_changes_nothing():
    model = tiny_llama()
    cfg = MoEConfig(dim=32, hidden_dim=48, num_experts=4)
    hf.moeify(model, cfg, layers=[1])
    first = model.model.layers[1].mlp
    with pytest.raises(ValueError, match=r"decoder layers \[1\] already hold an MoE"):
        hf.moeify(model, cfg)  # layer 0 is still dense, but the call is refused as a whole
    assert not isinstance(model.model.layers[0].mlp, MoE) and model.model.layers[1].mlp is first
    with pytest.raises(ValueError, match=r"config must be a moe.MoEConfig"):
        hf.moeify(model, cfg.router_config(), layers=[0])
