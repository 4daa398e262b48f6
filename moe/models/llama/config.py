"""Llama-2 (and its MoE variants) configuration: data only, with named presets.

Legend: D model dim, L layers, H query heads, G key/value heads, Dh head dim (D / H),
F dense MLP width, V vocabulary, E experts, K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...config import MoEConfig

__all__ = ["LlamaConfig", "llama2_ffn_hidden_dim", "PRESETS"]


def llama2_ffn_hidden_dim(dim: int, multiple_of: int = 256, ffn_dim_multiplier: float | None = None) -> int:
    """Llama-2's MLP width rule: 2/3 of 4D (SwiGLU has three matrices instead of two, so this
    keeps the parameter count of a 4D two-matrix MLP), times the optional multiplier, rounded
    up to a multiple of ``multiple_of``. 4096 -> 11008, 5120 -> 13824, (8192, 4096, 1.3) -> 28672."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass(kw_only=True)
class LlamaConfig:
    """A Llama-2 decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLPs, untied output.

    MoE variants: with ``moe`` set, layer ``i`` uses an `moe.MoE` built from that template
    instead of the dense MLP when `is_moe_layer` says so: the first ``first_dense_layers`` stay
    dense, then the last layer of every group of ``moe_every`` is MoE (``moe_every=2``: layers
    1, 3, 5, ... as in GShard and Switch; ``moe_every=1``: every layer after the dense ones).
    """

    dim: int  # D
    n_layers: int  # L
    n_heads: int  # H
    n_kv_heads: int | None = None  # G, None: H (no grouping)
    vocab_size: int  # V
    ffn_hidden_dim: int  # F, width of the dense SwiGLU MLPs
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 4096  # positions the rotary table covers
    moe: MoEConfig | None = None  # template of every MoE layer (its dim must be D)
    moe_every: int = 1
    first_dense_layers: int = 0
    init_std: float = 0.02  # N(0, init_std) for embeddings and projections

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim", "max_seq_len"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        need(self.dim % self.n_heads == 0, f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        need(
            (self.dim // self.n_heads) % 2 == 0, f"head dim dim/n_heads={self.dim // self.n_heads} must be even (RoPE)"
        )
        need(
            self.n_kv_heads <= self.n_heads and self.n_heads % self.n_kv_heads == 0,
            f"n_kv_heads must divide n_heads={self.n_heads}, got {self.n_kv_heads}",
        )
        need(
            self.norm_eps > 0 and self.rope_theta > 0,
            f"norm_eps and rope_theta must be > 0, got {self.norm_eps}, {self.rope_theta}",
        )
        need(self.moe_every >= 1, f"moe_every must be >= 1, got {self.moe_every}")
        need(self.first_dense_layers >= 0, f"first_dense_layers must be >= 0, got {self.first_dense_layers}")
        need(
            self.moe is None or isinstance(self.moe, MoEConfig),
            f"moe must be an MoEConfig or None, got {type(self.moe).__name__}",
        )
        need(
            self.moe is None or self.moe.dim == self.dim,
            f"moe.dim must equal dim={self.dim}, got {getattr(self.moe, 'dim', None)}",
        )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` (0-based) has an MoE instead of the dense MLP."""
        if self.moe is None or i < self.first_dense_layers:
            return False
        return (i - self.first_dense_layers + 1) % self.moe_every == 0

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]

    # parameter counts by formula (tests compare them to built models)

    def _attention_params(self) -> int:
        q_out, kv_out = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return self.dim * q_out * 2 + self.dim * kv_out * 2  # wq, wo; wk, wv

    def _moe_params(self) -> tuple[int, int, int]:
        """(router + shared experts, one routed expert, routed experts per token) of one MoE layer."""
        m = self.moe
        mats = 3 if m.activation == "swiglu" else 2
        shared = m.num_shared_experts * mats * self.dim * (m.shared_hidden_dim or m.hidden_dim)
        return m.num_experts * self.dim + shared, mats * self.dim * m.hidden_dim, m.top_k

    def num_params(self) -> int:
        """Every parameter of the built model (embeddings and output counted once each)."""
        return self._count(active=False)

    def num_active_params(self) -> int:
        """Parameters one token goes through: all dense parts (embedding and output matrices
        counted whole, as Mixtral's "12.9B active" does), the routers, shared experts and the
        top-k of each MoE layer's experts (an upper bound under capacity drops; for expert
        choice, K is the average number of experts per token)."""
        return self._count(active=True)

    def _count(self, active: bool) -> int:
        total = 2 * self.vocab_size * self.dim + self.dim  # tok_embeddings, output, final norm
        dense_mlp = 3 * self.dim * self.ffn_hidden_dim
        for i in range(self.n_layers):
            total += self._attention_params() + 2 * self.dim  # + two norms
            if self.is_moe_layer(i):
                fixed, expert, k = self._moe_params()
                total += fixed + expert * (k if active else self.moe.num_experts)
            else:
                total += dense_mlp
        return total

    @classmethod
    def from_name(cls, name: str, **overrides) -> LlamaConfig:
        """A named preset with any field overridden: ``LlamaConfig.from_name("tiny", n_layers=2)``.
        Overriding ``dim`` alone carries the new width into the preset's MoE template."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
        preset = PRESETS[name]
        if "dim" in overrides and "moe" not in overrides and preset.moe is not None:
            overrides["moe"] = replace(preset.moe, dim=overrides["dim"], router_options=dict(preset.moe.router_options))
        elif "moe" not in overrides and preset.moe is not None:  # never share the template's dict
            overrides["moe"] = replace(preset.moe, router_options=dict(preset.moe.router_options))
        return replace(preset, **overrides)


_LLAMA2 = dict(vocab_size=32000, max_seq_len=4096, norm_eps=1e-5, rope_theta=10000.0)
_70B = dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden_dim=llama2_ffn_hidden_dim(8192, 4096, 1.3))

PRESETS: dict[str, LlamaConfig] = {
    # tests: 4 layers, MoE in layers 1 and 3 (top-2 of 4 with aux and z losses); ~0.29M params
    "tiny": LlamaConfig(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=128,
        ffn_hidden_dim=llama2_ffn_hidden_dim(64, 32),  # 192
        max_seq_len=128,
        moe=MoEConfig(dim=64, hidden_dim=96, num_experts=4, top_k=2, aux_loss_coef=0.01, z_loss_coef=0.001),
        moe_every=2,
    ),
    # CPU demo: byte-level vocabulary (256 bytes + 4 specials), MoE every other layer with
    # experts as wide as the dense MLP (so a dense `small` upcycles into it); ~6.3M params
    "small": LlamaConfig(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=260,
        ffn_hidden_dim=llama2_ffn_hidden_dim(256, 64),  # 704
        max_seq_len=512,
        moe=MoEConfig(dim=256, hidden_dim=704, num_experts=4, top_k=2, aux_loss_coef=0.01, z_loss_coef=0.001),
        moe_every=2,
    ),
    # Llama-2's published shapes
    "llama2-7b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, ffn_hidden_dim=llama2_ffn_hidden_dim(4096), **_LLAMA2),
    "llama2-13b": LlamaConfig(dim=5120, n_layers=40, n_heads=40, ffn_hidden_dim=llama2_ffn_hidden_dim(5120), **_LLAMA2),
    "llama2-70b": LlamaConfig(**_70B, **_LLAMA2),
    # Llama-2-7B with BASE layers (8 experts of the dense width, balanced top-1) every other layer
    "llama2-7b-base-moe": LlamaConfig(
        dim=4096,
        n_layers=32,
        n_heads=32,
        ffn_hidden_dim=llama2_ffn_hidden_dim(4096),
        moe=MoEConfig.from_name("llama2-7b-base"),
        moe_every=2,
        **_LLAMA2,
    ),
    # Mixtral 8x7B: every layer top-2 of 8 SwiGLU experts of width 14336; 46.7B total, 12.9B active
    "mixtral-8x7b": LlamaConfig(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=32000,
        ffn_hidden_dim=14336,
        norm_eps=1e-5,
        rope_theta=1e6,
        max_seq_len=32768,
        moe=MoEConfig.from_name("mixtral-8x7b"),
    ),
    # Llama-2-70B upcycled: every layer an MoE of 24 experts as wide as 70B's MLP (28672), top-2.
    # 24 experts (divisible by 2, 3, 4, 6, 8, 12, 24 expert-parallel ranks) is the smallest
    # multiple of 8 giving >= 1.2e12 parameters: 1.366e12 total, 1.25e11 active per token.
    "llama2-moe-1.2t": LlamaConfig(
        **_70B,
        moe=MoEConfig(dim=8192, hidden_dim=_70B["ffn_hidden_dim"], num_experts=24, top_k=2, aux_loss_coef=0.01),
        **_LLAMA2,
    ),
    # DeepSeek-V3's MoE shape on Llama attention (full multi-head attention instead of MLA):
    # 61 layers, the first 3 dense (width 18432), then 256 routed experts of width 2048, top-8,
    # 1 shared expert; about 672B parameters (DeepSeek-V3 has 671B with MLA)
    "deepseek-v3-like": LlamaConfig(
        dim=7168,
        n_layers=61,
        n_heads=128,
        vocab_size=129280,
        ffn_hidden_dim=18432,
        norm_eps=1e-6,
        max_seq_len=4096,
        moe=MoEConfig.from_name("deepseek-v3"),
        first_dense_layers=3,
    ),
}
