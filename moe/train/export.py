"""``moe export --run DIR --to hf OUT``: a transformers model directory (config.json + safetensors).

A dense model becomes a ``LlamaForCausalLM`` (`moe.models.llama.hf.save_hf`). An MoE model
becomes a ``MixtralForCausalLM`` when Mixtral's routing expresses it: every layer MoE, a softmax
top-k router whose gates are renormalised over the chosen experts, no selection bias, no
capacity drops, SwiGLU experts, no shared experts. Anything else fails with the reason.

Weight names of an MoE layer i (E experts, D model dim, F expert width; ours -> Mixtral's)::

    layers.i.feed_forward.router.weight (E, D)         model.layers.i.mlp.gate.weight (E, D)
    experts.w1, w3 (E, D, F)                           mlp.experts.gate_up_proj (E, 2F, D): [w1^T; w3^T]
    experts.w2 (E, F, D)                               mlp.experts.down_proj (E, D, F): w2^T
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..layer import MoE
from ..models.llama import Llama
from ..models.llama.hf import save_hf
from .generate import load_run_model

__all__ = ["export_hf", "mixtral_blockers", "to_mixtral"]

_HINT = "pip install 'moe[hf]'"


def mixtral_blockers(model: Llama) -> list[str]:
    """What in this model Mixtral's routing cannot express (empty: it can): dense layers, and
    for each MoE layer what `moe.adapters.hf.to_mixtral` would refuse (a learned selection bias
    included)."""
    from ..adapters.hf import mixtral_inexpressible

    cfg = model.config
    out = []
    dense = [i for i in range(cfg.n_layers) if not cfg.is_moe_layer(i)]
    if dense:
        out.append(f"layers {dense} are dense and Mixtral has an MoE in every layer")
    layers_of: dict[str, list[int]] = {}  # each problem once, with the MoE layers it is found in
    for block in model.layers.values():
        if block.is_moe:
            for problem in mixtral_inexpressible(block.feed_forward):
                layers_of.setdefault(problem, []).append(block.layer_id)
    return out + [f"{problem} in MoE layers {ids}" for problem, ids in layers_of.items()]


def _mixtral_config(model: Llama):
    try:
        from transformers import MixtralConfig
    except ImportError as err:
        raise ImportError(f"export to transformers needs transformers: {_HINT}") from err
    cfg = model.config
    return MixtralConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.moe.hidden_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        num_local_experts=cfg.moe.num_experts,
        num_experts_per_tok=cfg.moe.top_k,
        router_jitter_noise=0.0,
        sliding_window=None,
        tie_word_embeddings=False,
        hidden_act="silu",
        architectures=["MixtralForCausalLM"],
    )


@torch.no_grad()
def to_mixtral(model: Llama):
    """A transformers ``MixtralForCausalLM`` with this model's weights (raises with the reasons
    when `mixtral_blockers` finds any)."""
    blockers = mixtral_blockers(model)
    if blockers:
        raise ValueError("this model cannot be written as Mixtral: " + "; ".join(blockers))
    from transformers import MixtralForCausalLM

    hf = MixtralForCausalLM(_mixtral_config(model)).eval()
    state = {
        "model.embed_tokens.weight": model.tok_embeddings.weight,
        "model.norm.weight": model.norm.weight,
        "lm_head.weight": model.output.weight,
    }
    for i, block in model.layers.items():
        ff: MoE = block.feed_forward
        p = f"model.layers.{i}."
        state[p + "self_attn.q_proj.weight"] = block.attention.wq.weight
        state[p + "self_attn.k_proj.weight"] = block.attention.wk.weight
        state[p + "self_attn.v_proj.weight"] = block.attention.wv.weight
        state[p + "self_attn.o_proj.weight"] = block.attention.wo.weight
        state[p + "input_layernorm.weight"] = block.attention_norm.weight
        state[p + "post_attention_layernorm.weight"] = block.ffn_norm.weight
        state[p + "mlp.gate.weight"] = ff.router.weight
        w1, w3, w2 = ff.experts.w1, ff.experts.w3, ff.experts.w2  # (E, D, F), (E, D, F), (E, F, D)
        state[p + "mlp.experts.gate_up_proj"] = torch.cat([w1.transpose(1, 2), w3.transpose(1, 2)], dim=1)
        state[p + "mlp.experts.down_proj"] = w2.transpose(1, 2)
    state = {k: v.detach().float().contiguous() for k, v in state.items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if "rotary" not in k]
    if missing or unexpected:
        raise RuntimeError(f"Mixtral weight names changed: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return hf


def export_hf(run_dir, dest) -> str:
    """Write the run's latest checkpoint to ``dest`` as a transformers model; returns its class name."""
    model, _ = load_run_model(run_dir)
    dest = Path(dest)
    if not model.config.moe_layers:
        save_hf(model, dest)
        return "LlamaForCausalLM"
    to_mixtral(model).save_pretrained(str(dest))
    return "MixtralForCausalLM"
