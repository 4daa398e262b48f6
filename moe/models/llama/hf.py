"""transformers interop for `Llama`: load a ``LlamaForCausalLM`` (in memory, or a local
directory with config.json and safetensors), upcycle its MLPs into MoE layers, write the model
back. Needs the ``hf`` extra (transformers, which brings safetensors): ``pip install 'moe[hf]'``.
Nothing is downloaded: a path must be a local directory.

Weight names (i a layer; D model dim, F MLP width, E experts):

    model.embed_tokens.weight                    tok_embeddings.weight
    model.layers.i.self_attn.{q,k,v,o}_proj      layers.i.attention.w{q,k,v,o}
    model.layers.i.mlp.gate_proj / up_proj       layers.i.feed_forward.w1 / w3          (F, D)
        (an MoE layer: every expert gets a copy)  layers.i.feed_forward.experts.w1 / w3 (E, D, F), transposed
    model.layers.i.mlp.down_proj                 layers.i.feed_forward.w2 (D, F), experts.w2 (E, F, D)
    model.layers.i.input_layernorm               layers.i.attention_norm
    model.layers.i.post_attention_layernorm      layers.i.ffn_norm
    model.norm.weight, lm_head.weight            norm.weight, output.weight

Both rotate query/key halves (transformers' layout), so q/k weights copy unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

from ...config import MoEConfig
from ...layer import MoE
from .config import LlamaConfig

__all__ = ["config_from_hf", "from_hf", "hf_config", "save_hf", "to_hf", "to_hf_state_dict"]

_HINT = "pip install 'moe[hf]'"
_SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim")
_LAYER_KEYS = {  # ours -> transformers', under layers.i / model.layers.i
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_MLP_KEYS = {"w1": "mlp.gate_proj.weight", "w3": "mlp.up_proj.weight", "w2": "mlp.down_proj.weight"}


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def config_from_hf(hf: dict | object, **overrides) -> LlamaConfig:
    """A `LlamaConfig` of the same shape as a transformers Llama config (object or dict)."""
    d = hf if isinstance(hf, dict) else hf.to_dict()
    kind = d.get("model_type", "llama")
    _need(kind in ("llama", "mixtral"), f"only Llama and Mixtral checkpoints load, got model_type={kind!r}")
    _need(
        d.get("hidden_act", "silu") == "silu", f"only SiLU (SwiGLU) MLPs load, got hidden_act={d.get('hidden_act')!r}"
    )
    bias = [k for k in ("attention_bias", "mlp_bias") if d.get(k)]
    _need(not bias, f"projections with biases do not load (Llama-2 has none), got {bias} true")
    heads = d["num_attention_heads"]
    head_dim = d["hidden_size"] // heads
    _need(
        d.get("head_dim") in (None, head_dim),
        f"head_dim must be hidden_size / num_attention_heads = {head_dim}, got {d.get('head_dim')}",
    )
    rope = d.get("rope_parameters") or {"rope_theta": d.get("rope_theta", 10000.0), **(d.get("rope_scaling") or {})}
    rope_kind = rope.get("rope_type", rope.get("type", "default"))
    _need(rope_kind == "default", f"only unscaled RoPE loads (Llama-2), got rope_type={rope_kind!r}")
    cfg = dict(
        dim=d["hidden_size"],
        n_layers=d["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=d.get("num_key_value_heads") or heads,
        vocab_size=d["vocab_size"],
        ffn_hidden_dim=d["intermediate_size"],
        norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", 10000.0),
        max_seq_len=d.get("max_position_embeddings", 4096),
    )
    if kind == "mixtral":
        cfg.update(moe=_mixtral_moe(d), moe_every=1)
    return LlamaConfig(**{**cfg, **overrides})


def _mixtral_moe(d: dict) -> MoEConfig:
    """A Mixtral config's sparse MoE block as an `MoEConfig` (as `moe.adapters.hf.from_mixtral`):
    softmax top-k with renormalised weights over SwiGLU experts, its aux loss coefficient."""
    _need(not d.get("router_jitter_noise"), f"router_jitter_noise={d.get('router_jitter_noise')} has no MoE "
          "equivalent (Mixtral scales its input by uniform noise in training); set it to 0 to load")  # fmt: skip
    window = d.get("sliding_window")
    _need(window is None, f"sliding_window={window}: only full causal attention loads (Mixtral's default)")
    return MoEConfig(
        dim=d["hidden_size"], hidden_dim=d["intermediate_size"], num_experts=d["num_local_experts"],
        top_k=d["num_experts_per_tok"], router="topk", router_options={"score_func": "softmax", "renormalize": True},
        aux_loss_coef=float(d.get("router_aux_loss_coef", 0.0)),
    )  # fmt: skip


def _read(model_or_path) -> tuple[dict, dict[str, Tensor]]:
    """(config dict, state dict) of an in-memory model or a local checkpoint directory."""
    if isinstance(model_or_path, nn.Module):
        cfg = getattr(model_or_path, "config", None)
        _need(cfg is not None, f"model must be a transformers LlamaForCausalLM, got {type(model_or_path).__name__}")
        return cfg.to_dict(), {k: v.detach() for k, v in model_or_path.state_dict().items()}
    path = Path(model_or_path)
    _need(path.is_dir(), f"model_or_path must be a LlamaForCausalLM or a local directory, got {str(path)!r}")
    _need((path / "config.json").is_file(), f"{str(path)!r} has no config.json")
    files = sorted(path.glob("*.safetensors"))
    _need(bool(files), f"{str(path)!r} has no *.safetensors weights (convert .bin checkpoints with transformers)")
    try:
        from safetensors.torch import load_file
    except ImportError as err:
        raise ImportError(f"loading safetensors checkpoints needs safetensors: {_HINT}") from err
    state: dict[str, Tensor] = {}
    for f in files:  # one file, or the shards of an index: their keys are disjoint
        state.update(load_file(str(f)))
    return json.loads((path / "config.json").read_text()), state


def _moe_template(moe, dim: int, hidden: int) -> MoEConfig | None:
    if moe is None or isinstance(moe, MoEConfig):
        return moe
    _need(isinstance(moe, dict), f"moe must be an MoEConfig, a dict of its fields or None, got {type(moe).__name__}")
    return MoEConfig(**{"dim": dim, "hidden_dim": hidden, **moe})


def from_hf(model_or_path, *, model_cls, moe=None, noise: float = 0.0, seed: int = 0, dtype=None, **overrides):
    """A ``model_cls`` (`Llama`) with the weights of a transformers ``LlamaForCausalLM``, or of a
    ``MixtralForCausalLM`` (every layer an MoE with the checkpoint's router and experts; ``moe``
    may then change only what is not loaded, such as the loss coefficients).

    - ``moe``: an `MoEConfig` or a dict of its fields (``dim``, ``hidden_dim`` default to the
      checkpoint's); with ``moe_every`` / ``first_dense_layers`` in ``overrides`` it picks the
      layers to upcycle. Each MoE layer's experts are copies of that layer's dense MLP, each
      plus ``noise * std(w)`` Gaussian noise per weight matrix (0: exact copies); the router is new.
    - ``seed`` seeds the new parameters and the noise (the global RNG is left as it was).
    - ``overrides``: other `LlamaConfig` fields (e.g. ``max_seq_len``); not the shape fields.
    - A checkpoint with tied embeddings gets an untied copy as ``output``.
    - ``dtype``: of the result's parameters (default: the checkpoint's).

    Function kept: with no MoE layer the logits equal transformers' (fp32: to rounding). An
    upcycled layer with no noise, SwiGLU experts, the "weighted" combine and gates summing to
    one (top-k with ``renormalize``, the default) gives the dense MLP's output: each token's
    output is ``sum_k g_k * mlp(x) = mlp(x)`` (exactly for top-1, where the gate is s/s = 1).
    """
    _need(noise >= 0, f"noise must be >= 0, got {noise}")
    shaped = sorted(set(overrides) & set(_SHAPE_FIELDS))
    _need(not shaped, f"the checkpoint fixes {shaped}; they cannot be overridden")
    hf_cfg, state = _read(model_or_path)
    base = config_from_hf(hf_cfg)
    template = _moe_template(moe, base.dim, base.ffn_hidden_dim)
    if base.moe is not None:  # a Mixtral: its experts are loaded, and only their loss options may change
        template = template or base.moe
        _need(
            template.num_experts == base.moe.num_experts and template.hidden_dim == base.moe.hidden_dim,
            f"the checkpoint has {base.moe.num_experts} experts of width {base.moe.hidden_dim}; moe asks for "
            f"{template.num_experts} of {template.hidden_dim}",
        )
    config = config_from_hf(hf_cfg, moe=template, **overrides)
    if template is not None and base.moe is None:
        _need(
            template.hidden_dim == base.ffn_hidden_dim and template.activation == "swiglu",
            f"upcycling copies the dense SwiGLU MLP: moe needs hidden_dim={base.ffn_hidden_dim} and "
            f"activation='swiglu', got {template.hidden_dim}, {template.activation!r}",
        )
        _need(
            template.num_shared_experts == 0,
            "upcycling has no source for shared experts: moe needs num_shared_experts=0, "
            f"got {template.num_shared_experts}",
        )
    if "lm_head.weight" not in state and hf_cfg.get("tie_word_embeddings", False):
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}  # recomputed, not weights

    device = state["model.embed_tokens.weight"].device
    dtype = dtype or state["model.embed_tokens.weight"].dtype
    with torch.device("meta"):
        model = model_cls(config)
    model.to_empty(device=device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        model.init_weights()  # the routers: everything else is overwritten below
        gen = torch.Generator(device=device).manual_seed(seed)
        _load(model, config, state, noise, gen)
    model.to(dtype)
    model.reset_rope()  # the cast above rounded the fp32 table
    return model


@torch.no_grad()
def _load(model: nn.Module, config: LlamaConfig, state: dict[str, Tensor], noise: float, gen) -> None:
    used: set[str] = set()

    def take(key: str) -> Tensor:
        _need(key in state, f"the checkpoint has no {key!r}")
        used.add(key)
        return state[key]

    take.state = state

    model.tok_embeddings.weight.copy_(take("model.embed_tokens.weight"))
    model.norm.weight.copy_(take("model.norm.weight"))
    model.output.weight.copy_(take("lm_head.weight"))
    for i, block in model.layers.items():
        for ours, theirs in _LAYER_KEYS.items():
            block.get_parameter(ours).copy_(take(f"model.layers.{i}.{theirs}"))
        ff = block.feed_forward
        if any(f"model.layers.{i}.{k}.gate.weight" in state for k in ("block_sparse_moe", "mlp")):  # Mixtral
            _need(block.is_moe, f"layer {i} of the checkpoint is MoE, of the model dense")
            _load_mixtral_layer(ff, i, take)
            continue
        mlp = {name: take(f"model.layers.{i}.{key}") for name, key in _MLP_KEYS.items()}
        if not block.is_moe:
            for name, w in mlp.items():
                getattr(ff, name).weight.copy_(w)
            continue
        for name, w in mlp.items():  # nn.Linear (out, in) -> expert (in, out), one copy per expert
            target = getattr(ff.experts, name)
            target.copy_(w.t().unsqueeze(0).expand_as(target))
            if noise > 0:
                scale = noise * w.float().std()
                target.add_((torch.randn(target.shape, generator=gen, device=target.device) * scale).to(target.dtype))
    unused = sorted(set(state) - used)
    _need(not unused, f"the checkpoint has weights this Llama has no place for: {unused[:8]}")


def _load_mixtral_layer(ff: MoE, i: int, take) -> None:
    """A Mixtral layer's router and experts (nn.Linear layout, one set per expert, as
    transformers saves them) into ``ff``: w1 / w3 (F, D) -> (E, D, F), w2 (D, F) -> (E, F, D)."""
    if f"model.layers.{i}.mlp.gate.weight" in take.state:  # transformers' in-memory layout: fused, (E, 2F, D)
        ff.router.weight.copy_(take(f"model.layers.{i}.mlp.gate.weight"))
        gate_up, f = take(f"model.layers.{i}.mlp.experts.gate_up_proj"), ff.experts.w1.shape[-1]
        ff.experts.w1.copy_(gate_up[:, :f].transpose(1, 2))
        ff.experts.w3.copy_(gate_up[:, f:].transpose(1, 2))
        ff.experts.w2.copy_(take(f"model.layers.{i}.mlp.experts.down_proj").transpose(1, 2))
        return
    prefix = f"model.layers.{i}.block_sparse_moe"
    ff.router.weight.copy_(take(f"{prefix}.gate.weight"))
    for name in ("w1", "w2", "w3"):
        target = getattr(ff.experts, name)
        for e in range(target.shape[0]):
            target[e].copy_(take(f"{prefix}.experts.{e}.{name}.weight").t())


def _full(t: Tensor) -> Tensor:
    """The whole tensor of a DTensor shard (a collective: every rank must call), else itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


@torch.no_grad()
def to_hf_state_dict(model: nn.Module, *, merge_experts: str | None = None) -> dict[str, Tensor]:
    """A transformers ``LlamaForCausalLM`` state dict of a whole `Llama` (sharded parameters
    are gathered: every rank must call). MoE layers have no dense MLP: ``merge_experts=None``
    rejects them, ``"mean"`` writes the mean of each layer's experts (which undoes noise-free
    upcycling exactly and is an approximation otherwise)."""
    _need(merge_experts in (None, "mean"), f"merge_experts must be None or 'mean', got {merge_experts!r}")
    config: LlamaConfig = model.config
    missing = [n for n in ("tok_embeddings", "norm", "output") if getattr(model, n) is None]
    missing += [f"layers.{i}" for i in range(config.n_layers) if str(i) not in model.layers]
    _need(not missing, f"to_hf needs the whole model, a pipeline stage lacks {missing[:8]}")
    moe_layers = [i for i, b in model.layers.items() if b.is_moe]
    _need(
        not moe_layers or merge_experts == "mean",
        f"layers {moe_layers} are MoE and a Llama checkpoint has one MLP per layer: pass merge_experts='mean'",
    )
    out = {
        "model.embed_tokens.weight": _full(model.tok_embeddings.weight),
        "model.norm.weight": _full(model.norm.weight),
        "lm_head.weight": _full(model.output.weight),
    }
    for i, block in model.layers.items():
        for ours, theirs in _LAYER_KEYS.items():
            out[f"model.layers.{i}.{theirs}"] = _full(block.get_parameter(ours))
        ff = block.feed_forward
        for name, key in _MLP_KEYS.items():
            if block.is_moe:
                _need(
                    isinstance(ff, MoE) and ff.shared is None and ff.experts.w3 is not None,
                    f"layer {i}: only MoE layers of SwiGLU experts without shared experts merge into an MLP",
                )
                w = _full(getattr(ff.experts, name)).mean(0).t()
            else:
                w = _full(getattr(ff, name).weight)
            out[f"model.layers.{i}.{key}"] = w
    return {k: v.detach().contiguous() for k, v in out.items()}


def hf_config(config: LlamaConfig):
    """The transformers ``LlamaConfig`` of the same shape (the MoE fields have no counterpart)."""
    try:
        from transformers import LlamaConfig as HFLlamaConfig
    except ImportError as err:
        raise ImportError(f"moe.models.llama.hf needs transformers: {_HINT}") from err
    return HFLlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.dim,
        intermediate_size=config.ffn_hidden_dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_theta,
        hidden_act="silu",
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )


def to_hf(model: nn.Module, *, merge_experts: str | None = None):
    """A transformers ``LlamaForCausalLM`` holding `to_hf_state_dict` (in the model's dtype)."""
    from transformers import LlamaForCausalLM

    state = to_hf_state_dict(model, merge_experts=merge_experts)
    hf = LlamaForCausalLM(hf_config(model.config))
    hf.to(state["model.embed_tokens.weight"].dtype)
    hf.load_state_dict(state, strict=True)
    return hf.eval()


def save_hf(model: nn.Module, path, *, merge_experts: str | None = None) -> None:
    """Write config.json and model.safetensors, a directory transformers' ``from_pretrained``
    and `from_hf` both read, without building a transformers model."""
    try:
        from safetensors.torch import save_file
    except ImportError as err:
        raise ImportError(f"saving safetensors checkpoints needs safetensors: {_HINT}") from err
    state = to_hf_state_dict(model, merge_experts=merge_experts)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf = hf_config(model.config)
    hf.dtype = state["model.embed_tokens.weight"].dtype
    hf.save_pretrained(str(path))
    save_file({k: v.cpu() for k, v in state.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
