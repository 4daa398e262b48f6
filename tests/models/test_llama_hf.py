"""Llama <-> transformers' LlamaForCausalLM: equal logits both ways, from memory and from a
local safetensors directory; upcycling into MoE layers keeps the dense function."""

import pytest
import torch

from moe.models import Llama

transformers = pytest.importorskip("transformers", reason="needs the hf extra")
hf_mod = pytest.importorskip("moe.models.llama.hf")

VOCAB = 61


def hf_llama(seed=0, **overrides):
    """A random tiny LlamaForCausalLM: GQA (6 heads, 2 kv heads), odd sizes, non-default RoPE
    theta and eps, norms away from one, weights large enough for logits of order one."""
    torch.manual_seed(seed)
    kw = dict(
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        rope_theta=5e5,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        initializer_range=0.1,
    )
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**kw, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def hf():
    return hf_llama()


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(1))


def logits_of(model, tokens):
    with torch.no_grad():
        out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


def test_dense_logits_equal_transformers(hf, tokens):
    model = Llama.from_hf(hf)
    ref = logits_of(hf, tokens)
    assert ref.abs().max() > 1  # a comparison of near-zero logits would prove little
    torch.testing.assert_close(logits_of(model, tokens), ref, rtol=1e-5, atol=1e-5)
    assert model.config.rope_theta == 5e5 and model.config.n_kv_heads == 2 and model.config.norm_eps == 1e-5


def test_round_trips_through_transformers(hf, tokens, tmp_path):
    model = Llama.from_hf(hf)
    ref = logits_of(hf, tokens)
    back = model.to_hf()
    assert isinstance(back, transformers.LlamaForCausalLM)
    for (k, a), b in zip(hf.state_dict().items(), back.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)
    hf_mod.save_hf(model, tmp_path / "saved")
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "saved")).eval()
    torch.testing.assert_close(logits_of(loaded, tokens), ref, rtol=1e-5, atol=1e-5)


def test_loads_a_local_safetensors_directory(hf, tokens, tmp_path):
    hf.save_pretrained(str(tmp_path / "ckpt"))
    assert list((tmp_path / "ckpt").glob("*.safetensors"))
    model = Llama.from_hf(tmp_path / "ckpt")
    torch.testing.assert_close(logits_of(model, tokens), logits_of(hf, tokens), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="has no config.json"):
        Llama.from_hf(tmp_path)
    with pytest.raises(ValueError, match="a local directory"):
        Llama.from_hf(tmp_path / "missing")


@pytest.mark.parametrize("top_k", [1, 2])
def test_upcycled_experts_give_the_dense_output(hf, tokens, top_k):
    # every expert a copy of the MLP and gates summing to one: sum_k g_k mlp(x) = mlp(x)
    model = Llama.from_hf(hf, moe=dict(num_experts=4, top_k=top_k), moe_every=2)
    assert model.config.moe_layers == [1]
    layer = model.layers["1"].feed_forward
    torch.testing.assert_close(layer.experts.w1[3], hf.model.layers[1].mlp.gate_proj.weight.t(), rtol=0, atol=0)
    torch.testing.assert_close(logits_of(model, tokens), logits_of(hf, tokens), rtol=1e-5, atol=1e-5)
    assert layer.last_routing.counts.sum() == tokens.numel() * top_k


def test_upcycling_noise_is_seeded_and_changes_the_experts(hf, tokens):
    kw = dict(moe=dict(num_experts=4, top_k=2), moe_every=1)
    a = Llama.from_hf(hf, noise=0.1, seed=3, **kw)
    b = Llama.from_hf(hf, noise=0.1, seed=3, **kw)
    c = Llama.from_hf(hf, noise=0.1, seed=4, **kw)
    wa, wb, wc = (m.layers["0"].feed_forward.experts.w1 for m in (a, b, c))
    torch.testing.assert_close(wa, wb, rtol=0, atol=0)
    assert not torch.equal(wa, wc) and not torch.equal(wa[0], wa[1])
    rel = (wa[0] - hf.model.layers[0].mlp.gate_proj.weight.t()).std() / wa[0].std()
    assert 0.05 < rel < 0.2
    torch.testing.assert_close(a.layers["0"].feed_forward.router.weight, b.layers["0"].feed_forward.router.weight)
    assert (logits_of(a, tokens) - logits_of(hf, tokens)).abs().max() > 1e-4


def test_writing_moe_layers_back_needs_a_merge(hf):
    model = Llama.from_hf(hf, moe=dict(num_experts=3, top_k=1), moe_every=2)
    with pytest.raises(ValueError, match=r"layers \['1'\] are MoE .* merge_experts='mean'"):
        hf_mod.to_hf_state_dict(model)
    merged = hf_mod.to_hf_state_dict(model, merge_experts="mean")  # undoes noise-free upcycling
    for key, w in hf.state_dict().items():
        torch.testing.assert_close(merged[key], w, rtol=1e-6, atol=1e-7, msg=key)


def test_keeps_the_checkpoint_dtype_and_unties_tied_embeddings(tokens):
    tied = hf_llama(tie_word_embeddings=True).to(torch.bfloat16)
    model = Llama.from_hf(tied)
    assert model.output.weight.dtype == torch.bfloat16 and model.rope.dtype == torch.float32
    assert model.output.weight.data_ptr() != model.tok_embeddings.weight.data_ptr()
    torch.testing.assert_close(model.output.weight, tied.lm_head.weight, rtol=0, atol=0)
    ref = logits_of(tied, tokens).float()
    assert (logits_of(model, tokens).float() - ref).abs().max() < 0.1 * ref.abs().max()


def test_rejects_what_does_not_load(hf):
    with pytest.raises(ValueError, match="biases do not load"):
        Llama.from_hf(hf_llama(attention_bias=True))
    with pytest.raises(ValueError, match="only unscaled RoPE loads"):
        Llama.from_hf(hf_llama(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}))
    with pytest.raises(ValueError, match=r"the checkpoint fixes \['dim'\]"):
        Llama.from_hf(hf, dim=64)
    with pytest.raises(ValueError, match="moe needs hidden_dim=80"):
        Llama.from_hf(hf, moe=dict(num_experts=2, hidden_dim=40))
    with pytest.raises(ValueError, match="num_shared_experts=0"):
        Llama.from_hf(hf, moe=dict(num_experts=2, num_shared_experts=1))
    with pytest.raises(ValueError, match="must be a transformers LlamaForCausalLM"):
        Llama.from_hf(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="noise must be >= 0"):
        Llama.from_hf(hf, noise=-1.0)
