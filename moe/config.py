"""MoE layer configuration: data only (no device, no process group), with named presets."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Literal

from .routing import ROUTER_KINDS, RouterConfig
from .routing.config import check_bool, check_choice, check_float, check_int

__all__ = ["MoEConfig"]

ACTIVATIONS = ("swiglu", "gelu", "relu")
COMBINES = ("weighted", "sigmoid_residual")
# the layer's kernels: grouped_mm's "ref" is its pure-torch spec, which permute and unpermute
# do not have, so a layer cannot run on it
LAYER_BACKENDS = ("auto", "triton", "torch")
_SHARED_FIELDS = ("capacity_factor", "aux_loss_coef", "z_loss_coef")  # same name here and in RouterConfig


@dataclass(kw_only=True)
class MoEConfig:
    """One MoE layer. Router options are the fields of `RouterConfig` (see there)."""

    dim: int  # D, model width
    hidden_dim: int  # F, each expert's FFN width
    num_experts: int  # E
    top_k: int = 2  # K
    router: Literal["base", "topk", "sinkhorn", "expert_choice"] = "topk"
    router_options: dict = field(default_factory=dict)  # extra RouterConfig fields, e.g. score_func
    capacity_factor: float | None = None  # None = dropless
    num_shared_experts: int = 0  # dense experts every token goes through (DeepSeek)
    shared_hidden_dim: int | None = None  # width of each shared expert (default hidden_dim)
    activation: Literal["swiglu", "gelu", "relu"] = "swiglu"
    combine: Literal["weighted", "sigmoid_residual"] = "weighted"  # sigmoid_residual: BASE's mix
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    backend: Literal["auto", "triton", "torch"] = "auto"  # kernels backend, see moe.kernels.grouped_mm
    fused: bool = False  # permutation fused into the expert GEMMs (moe.kernels.fused), single device

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        check_int("dim", self.dim, 1)
        check_int("hidden_dim", self.hidden_dim, 1)
        check_int("num_experts", self.num_experts, 1)
        check_int("top_k", self.top_k, 1, self.num_experts)
        check_choice("router", self.router, ROUTER_KINDS)
        need(
            isinstance(self.router_options, dict),
            f"router_options must be a dict of RouterConfig fields, got {type(self.router_options).__name__}",
        )
        check_float("capacity_factor", self.capacity_factor, 0, strict=True, none_ok=True)
        check_int("num_shared_experts", self.num_shared_experts, 0)
        check_int("shared_hidden_dim", self.shared_hidden_dim, 1, none_ok=True)
        check_choice("activation", self.activation, ACTIVATIONS)
        check_choice("combine", self.combine, COMBINES)
        need(
            self.combine != "sigmoid_residual" or self.top_k == 1,
            f"combine='sigmoid_residual' (alpha * expert(x) + (1 - alpha) * x) needs top_k=1, got {self.top_k}",
        )
        check_float("aux_loss_coef", self.aux_loss_coef, 0)
        check_float("z_loss_coef", self.z_loss_coef, 0)
        check_choice("backend", self.backend, LAYER_BACKENDS)
        check_bool("fused", self.fused)
        known = {f.name for f in fields(RouterConfig)}
        unknown = set(self.router_options) - known
        need(not unknown, f"router_options has unknown fields {sorted(unknown)}; RouterConfig has {sorted(known)}")
        own = sorted(set(self.router_options) & {"dim", "num_experts", "top_k", "kind", *_SHARED_FIELDS})
        need(not own, f"router_options must not set {own}: they are fields of MoEConfig itself")
        self.router_config()  # validates the router options too

    def router_config(self) -> RouterConfig:
        """The `RouterConfig` of this layer's router."""
        return RouterConfig(
            dim=self.dim,
            num_experts=self.num_experts,
            top_k=self.top_k,
            kind=self.router,
            capacity_factor=self.capacity_factor,
            aux_loss_coef=self.aux_loss_coef,
            z_loss_coef=self.z_loss_coef,
            **self.router_options,
        )

    @classmethod
    def from_name(cls, name: str, **overrides) -> MoEConfig:
        """A named preset, with any field overridden: ``MoEConfig.from_name("tiny", top_k=1)``."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
        preset = PRESETS[name]
        overrides.setdefault("router_options", dict(preset.router_options))  # never share the dict
        return replace(preset, **overrides)


PRESETS = {
    # Mixtral 8x7B: softmax top-2 with renormalisation, SwiGLU experts
    "mixtral-8x7b": MoEConfig(dim=4096, hidden_dim=14336, num_experts=8, top_k=2, router="topk"),
    # DeepSeek-V3: 256 routed experts, sigmoid scores, 8 groups / 4 kept, aux-loss-free bias, 1 shared
    "deepseek-v3": MoEConfig(
        dim=7168,
        hidden_dim=2048,
        num_experts=256,
        top_k=8,
        router="topk",
        router_options=dict(score_func="sigmoid", n_groups=8, topk_groups=4, bias_update_rate=0.001),
        num_shared_experts=1,
    ),
    # BASE layers on a Llama-2-7B width: balanced top-1 with the sigmoid residual mix
    "llama2-7b-base": MoEConfig(
        dim=4096, hidden_dim=11008, num_experts=8, top_k=1, router="base", combine="sigmoid_residual"
    ),
    "tiny": MoEConfig(dim=32, hidden_dim=48, num_experts=4, top_k=2),
    "tiny-base": MoEConfig(dim=32, hidden_dim=48, num_experts=4, top_k=1, router="base", combine="sigmoid_residual"),
}
