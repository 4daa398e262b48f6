"""Hugging Face transformers: convert between `moe.MoE` and Mixtral's sparse MoE block.

Needs the ``hf`` extra: ``pip install 'moe[hf]'``.

Weight layouts (E experts, D model dim, F expert hidden dim):

    Mixtral gate.weight          (E, D)       <-> MoE router.weight (E, D)
    Mixtral experts.gate_up_proj (E, 2F, D)   <-> MoE experts.w1 (E, D, F) (first F rows, transposed)
                                                  and experts.w3 (E, D, F) (last F rows, transposed)
    Mixtral experts.down_proj    (E, D, F)    <-> MoE experts.w2 (E, F, D) (transposed)

Mixtral routes by softmax, top-k, renormalised weights, SwiGLU experts and no shared experts;
only an `MoE` with that routing converts to it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

import torch
from torch import nn

from ..config import MoEConfig
from ..layer import MoE, aux_loss

__all__ = [
    "export_mixtral",
    "from_mixtral",
    "load_pretrained",
    "mixtral_inexpressible",
    "moeify",
    "save_pretrained",
    "to_mixtral",
]

_MOE_FILE = "moe_layers.json"  # {decoder layer index: MoEConfig fields}


def _transformers():
    try:
        import transformers  # noqa: F401
        from transformers.models.mixtral import modeling_mixtral
    except ImportError as err:  # optional dependency: say how to get it
        raise ImportError("moe.adapters.hf needs transformers: pip install 'moe[hf]'") from err
    return modeling_mixtral


def from_mixtral(block: nn.Module) -> MoE:
    """An `MoE` computing the same function as transformers' ``MixtralSparseMoeBlock``."""
    mm = _transformers()
    if not isinstance(block, mm.MixtralSparseMoeBlock):
        raise ValueError(f"block must be a transformers MixtralSparseMoeBlock, got {type(block).__name__}")
    jitter = getattr(block, "jitter_noise", 0.0)
    if jitter:  # an MoE has no input noise: converting would silently train another model
        raise ValueError(
            f"router_jitter_noise={jitter} (Mixtral scales its input by uniform noise in training) has no "
            "MoE equivalent; set block.jitter_noise = 0 first to convert without it"
        )
    experts = block.experts
    if type(experts.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
        raise ValueError(f"only SiLU (SwiGLU) Mixtral experts convert, got {type(experts.act_fn).__name__}")
    num_experts, two_f, dim = experts.gate_up_proj.shape
    f = two_f // 2
    config = MoEConfig(
        dim=dim,
        hidden_dim=f,
        num_experts=num_experts,
        top_k=block.top_k,
        router="topk",
        router_options={"score_func": "softmax", "renormalize": True},
    )
    gate_up = experts.gate_up_proj.detach()
    with torch.device("meta"):
        layer = MoE(config)
    layer.to_empty(device=gate_up.device)
    layer.reset_parameters()
    layer.to(gate_up.dtype)
    with torch.no_grad():
        layer.router.weight.copy_(block.gate.weight)
        layer.experts.w1.copy_(gate_up[:, :f].transpose(1, 2))
        layer.experts.w3.copy_(gate_up[:, f:].transpose(1, 2))
        layer.experts.w2.copy_(experts.down_proj.detach().transpose(1, 2))
    return layer


def mixtral_inexpressible(layer: MoE) -> list[str]:
    """What of ``layer`` transformers' Mixtral block cannot express, in words (empty: nothing)."""
    cfg, rc = layer.config, layer.config.router_config()
    problems = []
    if cfg.router != "topk":
        what = {
            "base": "BASE's balanced assignment",
            "sinkhorn": "Sinkhorn's balanced training routing",
            "expert_choice": "expert choice (experts pick tokens)",
        }[cfg.router]
        problems.append(f"router={cfg.router!r}: {what} has no Mixtral counterpart (Mixtral routes by softmax top-k)")
    if rc.score_func != "softmax":
        problems.append(f"score_func={rc.score_func!r} (Mixtral uses softmax scores)")
    if not rc.renormalize:
        problems.append("renormalize=False (Mixtral renormalises the top-k weights)")
    if rc.n_groups > 1 and rc.topk_groups < rc.n_groups:
        problems.append("group-limited routing")
    if rc.bias_update_rate > 0 or bool(getattr(layer.router, "bias", torch.zeros(1)).ne(0).any()):
        problems.append("a selection bias (aux-loss-free balancing)")
    if cfg.capacity_factor is not None:
        problems.append(f"capacity_factor={cfg.capacity_factor} (Mixtral is dropless)")
    if cfg.num_shared_experts:
        problems.append(f"num_shared_experts={cfg.num_shared_experts}")
    if cfg.activation != "swiglu":
        problems.append(f"activation={cfg.activation!r} (Mixtral experts are SwiGLU)")
    if cfg.combine != "weighted":
        problems.append(f"combine={cfg.combine!r} (Mixtral sums weighted expert outputs)")
    return problems


def to_mixtral(layer: MoE) -> nn.Module:
    """transformers' ``MixtralSparseMoeBlock`` computing the same function as ``layer``.

    Raises ValueError listing what Mixtral cannot express (e.g. BASE or sigmoid routing).
    """
    mm = _transformers()
    if not isinstance(layer, MoE):
        raise ValueError(f"layer must be a moe.MoE, got {type(layer).__name__}")
    problems = mixtral_inexpressible(layer)
    if problems:
        raise ValueError("this MoE cannot be expressed as a Mixtral block: " + "; ".join(problems))
    cfg = layer.config
    hf_config = mm.MixtralConfig(
        hidden_size=cfg.dim,
        intermediate_size=cfg.hidden_dim,
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        hidden_act="silu",
        router_jitter_noise=0.0,
    )
    w1 = layer.experts.w1.detach()
    block = mm.MixtralSparseMoeBlock(hf_config).to(device=w1.device, dtype=w1.dtype)
    with torch.no_grad():
        block.gate.weight.copy_(layer.router.weight)
        block.experts.gate_up_proj.copy_(torch.cat([w1, layer.experts.w3.detach()], dim=2).transpose(1, 2))
        block.experts.down_proj.copy_(layer.experts.w2.detach().transpose(1, 2))
    return block


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not all(hasattr(layer, "mlp") for layer in layers):
        raise ValueError(
            "model must be a transformers decoder with .model.layers[i].mlp (Llama, Mistral), "
            f"got {type(model).__name__}"
        )
    return layers


def _chosen_layers(decoder: nn.ModuleList, layers) -> list[int]:
    """The decoder layer indices `moeify` converts, checked: distinct, in range, still dense."""
    n = len(decoder)
    if layers is not None and not isinstance(layers, (list, tuple, range)):
        raise ValueError(f"layers must be None or a list of decoder layer indices, got {type(layers).__name__}")
    chosen = list(range(n)) if layers is None else list(layers)
    bad = [i for i in chosen if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n]
    if bad:
        raise ValueError(f"layers must be indices in [0, {n}) (the model has {n} decoder layers), got {bad}")
    repeated = sorted({i for i in chosen if chosen.count(i) > 1})
    if repeated:
        raise ValueError(f"layers must be distinct, got {repeated} more than once")
    done = [i for i in chosen if isinstance(decoder[i].mlp, MoE)]
    if done:
        raise ValueError(f"decoder layers {done} already hold an MoE (moeify ran on them before)")
    missing = [i for i in chosen if not hasattr(decoder[i].mlp, "gate_proj")]
    if missing:
        raise ValueError(f"decoder layers {missing} have no dense gate/up/down MLP to replace")
    return chosen


def _add_aux_loss(module: nn.Module, args, output):
    """Forward hook: a model output that carries a training loss gets the MoE losses added."""
    if getattr(output, "loss", None) is not None:
        output["loss"] = output.loss + aux_loss(module)
    return output


def moeify(
    model: nn.Module,
    config: MoEConfig,
    *,
    upcycle: bool = True,
    layers: list[int] | None = None,
    noise: float = 0.0,
    aux_loss_in_loss: bool = True,
) -> nn.Module:
    """Replace the MLPs of a transformers Llama / Mistral model by `MoE` layers, in place.

    Args:
        model: e.g. ``LlamaForCausalLM``; its decoder layers' ``.mlp`` are replaced.
        config: the MoE layer; with ``upcycle`` its ``dim`` and ``hidden_dim`` must match the
            model's hidden and intermediate sizes.
        upcycle: every expert starts as a copy of the dense MLP it replaces (plus Gaussian
            ``noise`` of that std). With a router whose gates sum to one (top-k with
            renormalisation, Sinkhorn's softmax for k > 1) the model's logits are unchanged at
            step 0. Without it the experts are freshly initialised.
        layers: indices of the decoder layers to convert (default: all).
        aux_loss_in_loss: register a forward hook on ``model`` that adds `moe.aux_loss` to the
            ``loss`` of its output whenever labels were given (once per model). Otherwise add
            ``moe.aux_loss(model)`` to the training loss yourself.

    Returns the model.
    """
    decoder = _decoder_layers(model)
    if not isinstance(config, MoEConfig):
        raise ValueError(f"config must be a moe.MoEConfig, got {type(config).__name__}")
    if not (isinstance(noise, (int, float)) and math.isfinite(noise) and noise >= 0):
        raise ValueError(f"noise must be a finite number >= 0, got {noise!r}")
    chosen = _chosen_layers(decoder, layers)
    for i in chosen:  # every check before the first change: a refused call leaves the model as it was
        dense = decoder[i].mlp
        ref = dense.gate_proj.weight
        if upcycle:
            if type(dense.act_fn).__name__ not in ("SiLU", "SiLUActivation") or config.activation != "swiglu":
                raise ValueError("upcycle needs SiLU-gated (SwiGLU) MLPs and activation='swiglu'")
            if (config.hidden_dim, config.dim) != tuple(ref.shape) or dense.gate_proj.bias is not None:
                raise ValueError(
                    f"upcycle needs config dim={ref.shape[1]} and hidden_dim={ref.shape[0]} without MLP biases, "
                    f"got dim={config.dim}, hidden_dim={config.hidden_dim}"
                )
    for i in chosen:
        dense = decoder[i].mlp
        ref = dense.gate_proj.weight
        with torch.device("meta"):
            layer = MoE(config)
        layer.to_empty(device=ref.device)
        layer.reset_parameters()
        layer.to(ref.dtype)
        if upcycle:
            with torch.no_grad():
                for w, lin in (
                    (layer.experts.w1, dense.gate_proj),
                    (layer.experts.w3, dense.up_proj),
                    (layer.experts.w2, dense.down_proj),
                ):
                    w.copy_(lin.weight.detach().T.expand_as(w))
                    if noise > 0:
                        w.add_(torch.randn_like(w) * noise)
        decoder[i].mlp = layer
    if aux_loss_in_loss and not getattr(model, "_moe_aux_loss_hook", None):
        model._moe_aux_loss_hook = model.register_forward_hook(_add_aux_loss)
    return model


def export_mixtral(model: nn.Module) -> nn.Module:
    """A transformers ``MixtralForCausalLM`` with the same eval-mode logits as ``model``, a
    Llama / Mistral model whose every MLP is an `MoE` Mixtral can express (see `to_mixtral`).

    Raises ValueError naming what stands in the way (a dense layer left, BASE or sigmoid
    routing, shared experts, attention biases, ...).
    """
    mm = _transformers()
    decoder = _decoder_layers(model)
    dense = [i for i, layer in enumerate(decoder) if not isinstance(layer.mlp, MoE)]
    if dense:
        raise ValueError(f"every decoder layer must hold an MoE for Mixtral; layers {dense} are dense")
    if any(layer.mlp.config != decoder[0].mlp.config for layer in decoder):
        raise ValueError("every MoE layer must share one configuration for Mixtral")
    src = model.config
    if getattr(src, "attention_bias", False) or getattr(src, "mlp_bias", False):
        raise ValueError("Mixtral has no attention or MLP biases; this model uses them")
    moe_cfg = decoder[0].mlp.config
    problems = mixtral_inexpressible(decoder[0].mlp)
    if problems:
        raise ValueError("this model's MoE layers cannot be expressed in Mixtral: " + "; ".join(problems))
    hf_config = mm.MixtralConfig(
        vocab_size=src.vocab_size,
        hidden_size=src.hidden_size,
        intermediate_size=moe_cfg.hidden_dim,
        num_hidden_layers=src.num_hidden_layers,
        num_attention_heads=src.num_attention_heads,
        num_key_value_heads=src.num_key_value_heads,
        head_dim=getattr(src, "head_dim", None),
        max_position_embeddings=src.max_position_embeddings,
        rms_norm_eps=src.rms_norm_eps,
        rope_parameters=getattr(src, "rope_parameters", None),
        tie_word_embeddings=src.tie_word_embeddings,
        sliding_window=getattr(src, "sliding_window", None),
        num_local_experts=moe_cfg.num_experts,
        num_experts_per_tok=moe_cfg.top_k,
        hidden_act="silu",
        router_jitter_noise=0.0,
    )
    ref = model.get_input_embeddings().weight
    out = mm.MixtralForCausalLM(hf_config).to(device=ref.device, dtype=ref.dtype)
    state = {k: v for k, v in model.state_dict().items() if ".mlp." not in k}
    for i, layer in enumerate(decoder):
        block = to_mixtral(layer.mlp)
        state.update({f"model.layers.{i}.mlp.{k}": v for k, v in block.state_dict().items()})
    out.load_state_dict(state, strict=True)
    return out.eval()


def save_pretrained(model: nn.Module, path: str | Path) -> None:
    """Save a MoE-ified transformers model: its config (``config.json``), which layers are MoE
    and how (``moe_layers.json``), and every weight (``model.safetensors``)."""
    from safetensors.torch import save_model

    if isinstance(model, MoE):
        raise ValueError(
            "save_pretrained saves a transformers model with MoE layers (see moeify); save a bare MoE "
            "with torch.save(layer.state_dict()) and rebuild it from its MoEConfig"
        )
    decoder = _decoder_layers(model)
    if not hasattr(getattr(model, "config", None), "save_pretrained"):
        raise ValueError(f"model must carry a transformers config (model.config), got {type(model).__name__}")
    layers = {i: dataclasses.asdict(layer.mlp.config) for i, layer in enumerate(decoder) if isinstance(layer.mlp, MoE)}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # the dtype to rebuild the model in, as transformers' own save records it: the config
    # still names the dtype the model was built in (None by default), not one it was cast to
    config = copy.deepcopy(model.config)
    config.dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), config.dtype)
    config.save_pretrained(path)
    (path / _MOE_FILE).write_text(json.dumps(layers, indent=1))
    save_model(model, str(path / "model.safetensors"))


def load_pretrained(path: str | Path) -> nn.Module:
    """The model `save_pretrained` wrote, rebuilt from its config (in the dtype it was saved in)
    and loaded strictly."""
    _transformers()
    from safetensors.torch import load_model
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    for i, fields_ in json.loads((path / _MOE_FILE).read_text()).items():
        moeify(model, MoEConfig(**fields_), upcycle=False, layers=[int(i)])
    load_model(model, str(path / "model.safetensors"), strict=True)
    return model.eval()
