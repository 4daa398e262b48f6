"""Llama-2 (+ MoE) model: configs and parameter counts, forward behaviour, meta build + init."""

import dataclasses

import pytest
import torch

import moe
from moe import MoE, MoEConfig
from moe.models import FeedForward, Llama, LlamaConfig
from moe.models.llama import PRESETS, llama2_ffn_hidden_dim
from moe.models.llama.model import apply_rope, rope_table


def build_meta(config):
    with torch.device("meta"):
        return Llama(config)


def counted(model):
    """(total, active) counted on the built modules: active drops the (E - K) / E of each MoE
    layer's routed experts that a token does not use."""
    total = sum(p.numel() for p in model.parameters())
    unused = 0
    for m in model.modules():
        if isinstance(m, MoE):
            experts = sum(p.numel() for p in m.experts.parameters())
            unused += experts * (m.config.num_experts - m.config.top_k) // m.config.num_experts
    return total, total - unused


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_formula_counts_equal_the_built_model(name):
    config = LlamaConfig.from_name(name)
    total, active = counted(build_meta(config))
    assert config.num_params() == total
    assert config.num_active_params() == active


def test_formula_counts_with_shared_experts_and_other_activations():
    moe_cfg = MoEConfig(dim=64, hidden_dim=40, num_experts=6, top_k=3, num_shared_experts=2, shared_hidden_dim=24)
    for act in ("swiglu", "gelu"):
        config = LlamaConfig.from_name(
            "tiny", moe=dataclasses.replace(moe_cfg, activation=act), first_dense_layers=1, moe_every=1
        )
        total, active = counted(Llama(config))
        assert (config.num_params(), config.num_active_params()) == (total, active)


def test_published_shapes_and_counts():
    # Llama-2's MLP widths from its rule, and the parameter counts of the released checkpoints
    assert llama2_ffn_hidden_dim(4096) == 11008
    assert llama2_ffn_hidden_dim(5120) == 13824
    assert llama2_ffn_hidden_dim(8192, 4096, 1.3) == 28672
    assert LlamaConfig.from_name("llama2-7b").num_params() == 6_738_415_616
    assert LlamaConfig.from_name("llama2-13b").num_params() == 13_015_864_320
    assert LlamaConfig.from_name("llama2-70b").num_params() == 68_976_648_192
    mixtral = LlamaConfig.from_name("mixtral-8x7b")
    assert mixtral.num_params() == 46_702_792_704  # "46.7B total, 12.9B active"
    assert mixtral.num_active_params() == 12_879_925_248
    big = LlamaConfig.from_name("llama2-moe-1.2t")
    assert big.num_params() >= 1.2e12 and big.moe.hidden_dim == 28672 and big.moe_layers == list(range(80))
    assert LlamaConfig.from_name("tiny").num_params() < 10**6 < LlamaConfig.from_name("small").num_params() < 10**7
    assert LlamaConfig.from_name("small").vocab_size == 260


def test_moe_layer_placement():
    tiny = LlamaConfig.from_name("tiny", n_layers=6)
    assert tiny.moe_layers == [1, 3, 5]  # every second layer, dense first
    assert LlamaConfig.from_name("tiny", n_layers=6, moe_every=1, first_dense_layers=2).moe_layers == [2, 3, 4, 5]
    assert LlamaConfig.from_name("tiny", n_layers=6, moe_every=3, first_dense_layers=1).moe_layers == [3]
    assert LlamaConfig.from_name("tiny", moe=None).moe_layers == []
    model = Llama(tiny)
    kinds = [type(b.feed_forward) for b in model.layers.values()]
    assert kinds == [FeedForward, MoE] * 3


def test_config_rejects_bad_shapes_and_carries_dim_into_the_moe_template():
    with pytest.raises(ValueError, match="n_kv_heads must divide n_heads=4"):
        LlamaConfig.from_name("tiny", n_kv_heads=3)
    with pytest.raises(ValueError, match="dim=64 must be divisible by n_heads=5"):
        LlamaConfig.from_name("tiny", n_heads=5)
    with pytest.raises(ValueError, match="moe.dim must equal dim=64, got 32"):
        LlamaConfig.from_name("tiny", moe=MoEConfig.from_name("tiny"))
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        LlamaConfig.from_name("huge")
    wider = LlamaConfig.from_name("tiny", dim=96)
    assert wider.moe.dim == 96 and PRESETS["tiny"].moe.dim == 64


def test_forward_shapes_causality_and_input_errors():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_name("tiny")).eval()
    tokens = torch.randint(0, 128, (2, 12))
    logits = model(tokens)
    assert logits.shape == (2, 12, 128) and torch.isfinite(logits).all()
    changed = tokens.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 128
    out = model(changed)
    # a token sees only the past (to rounding: the MoE layers' GEMMs see other rows)
    torch.testing.assert_close(out[:, :8], logits[:, :8], rtol=0, atol=1e-6)
    assert (out[:, 8:] - logits[:, 8:]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="exceeds max_seq_len=128"):
        model(torch.zeros(1, 129, dtype=torch.long))
    with pytest.raises(ValueError, match="tokens must be"):
        model(torch.zeros(2, 3, 64))


def test_rope_scores_depend_only_on_the_offset():
    torch.manual_seed(0)
    table = rope_table(16, 64, theta=500.0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(pq, pk):
        return (apply_rope(q, table[pq:]) * apply_rope(k, table[pk:])).sum()

    torch.testing.assert_close(score(3, 10), score(30, 37))
    assert not torch.allclose(score(3, 10), score(3, 11))
    same = rope_table(16, 64, theta=500.0)[0]
    torch.testing.assert_close(same[0], torch.ones(16))  # position 0: no rotation
    assert not torch.allclose(rope_table(16, 64, theta=1e4)[5], table[5])  # theta matters


def test_grouped_query_attention_equals_repeated_kv_heads():
    torch.manual_seed(0)
    gqa = Llama(LlamaConfig.from_name("tiny", moe=None)).eval()
    mha = Llama(LlamaConfig.from_name("tiny", moe=None, n_kv_heads=4)).eval()
    state = gqa.state_dict()
    hd = gqa.config.head_dim
    for key, w in state.items():
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            # kv head j serves query heads 2j and 2j + 1
            state[key] = w.view(2, hd, -1).repeat_interleave(2, dim=0).reshape(4 * hd, -1)
    mha.load_state_dict(state)
    tokens = torch.randint(0, 128, (2, 9))
    torch.testing.assert_close(mha(tokens), gqa(tokens), rtol=1e-5, atol=1e-6)


def test_backward_reaches_every_parameter_and_the_router_losses():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_name("tiny"))
    tokens = torch.randint(0, 128, (3, 10))
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    aux = moe.aux_loss(model)
    assert aux > 0  # tiny's MoE layers carry aux and z losses
    (loss + aux).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing


def test_meta_build_then_init_weights_matches_a_device_build():
    config = LlamaConfig.from_name("tiny")
    on_cpu = Llama(config)
    meta = build_meta(config)
    assert all(p.is_meta for p in meta.parameters()) and meta.rope.is_meta
    meta.to_empty(device="cpu")
    for model in (on_cpu, meta):
        torch.manual_seed(7)
        model.init_weights()
    for (name, a), b in zip(on_cpu.state_dict().items(), meta.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(meta.rope, on_cpu.rope, rtol=0, atol=0)  # not kept by to_empty: recomputed
    tokens = torch.randint(0, 128, (2, 16))
    out = meta(tokens)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, on_cpu(tokens), rtol=0, atol=0)
    norms = [m.weight for m in meta.modules() if type(m).__name__ == "RMSNorm"]
    assert all(bool((w == 1).all()) for w in norms)


def test_init_scales():
    torch.manual_seed(0)
    config = LlamaConfig.from_name("small", moe=None)
    model = Llama(config)
    std = model.layers["0"].attention.wq.weight.std().item()
    out_std = model.layers["0"].feed_forward.w2.weight.std().item()
    assert abs(std - 0.02) < 0.002
    assert abs(out_std - 0.02 / (2 * config.n_layers) ** 0.5) < 0.001


def test_pipeline_stages_compose_to_the_whole_model():
    torch.manual_seed(0)
    whole = Llama(LlamaConfig.from_name("tiny")).eval()
    first, last = Llama(whole.config).eval(), Llama(whole.config).eval()
    first.load_state_dict(whole.state_dict())
    last.load_state_dict(whole.state_dict())
    first.norm = first.output = None
    del first.layers["2"], first.layers["3"]
    last.tok_embeddings = None
    del last.layers["0"], last.layers["1"]
    tokens = torch.randint(0, 128, (2, 11))
    h = first(tokens)
    assert h.shape == (2, 11, 64)
    torch.testing.assert_close(last(h), whole(tokens), rtol=0, atol=0)
    last.init_weights()  # works on a stage too
    with pytest.raises(ValueError, match="takes h: \\(B, S, D\\)"):
        last(tokens)


def test_rope_table_survives_a_dtype_cast_after_reset():
    model = Llama(LlamaConfig.from_name("tiny", moe=None)).to(torch.bfloat16)
    assert model.rope.dtype == torch.bfloat16
    model.reset_rope()
    assert model.rope.dtype == torch.float32
    assert model(torch.randint(0, 128, (1, 8))).dtype == torch.bfloat16


def test_dense_block_compiles_without_graph_breaks():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_name("tiny", moe=None))
    block = model.layers["0"]
    x = torch.randn(2, 8, 64)
    compiled = torch.compile(block, backend="eager", fullgraph=True)  # tracing only: fast on CPU
    torch.testing.assert_close(compiled(x, model.rope), block(x, model.rope), rtol=0, atol=0)


def test_moe_block_compiles_without_graph_breaks():
    from moe import aux_loss

    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_name("tiny"))
    block = next(b for b in model.layers.values() if b.is_moe)
    x = torch.randn(2, 8, 64)
    compiled = torch.compile(block, backend="eager", fullgraph=True)  # tracing only: fast on CPU
    y_c, aux_c = compiled(x, model.rope), aux_loss(block)
    torch.testing.assert_close(y_c, block(x, model.rope), rtol=0, atol=0)
    torch.testing.assert_close(aux_c, aux_loss(block), rtol=0, atol=0)


def test_presets_table_lists_every_preset_with_its_counts():
    from moe.models.llama.__main__ import presets_table

    table = presets_table()
    lines = table.splitlines()
    assert len(lines) == 2 + len(PRESETS)
    assert "| `mixtral-8x7b` | 32 | 4096 | 32 / 8 | 14336 | all | 8 (top-2, 14336, topk) | 46.7B | 12.88B |" in lines
    assert "| `tiny` | 4 | 64 | 4 / 2 | 192 | 2 of 4 |" in table
