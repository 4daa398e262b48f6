"""A described attention shape for the time model (docs/scale.md, "Time"), for a published
model whose attention is not the Llama attention of `moe.models.llama` (grouped-query, head
dim D / H). Only its FLOPs and parameters are counted; the trainable model is unchanged, and
None (the default everywhere) means the Llama attention of the `LlamaConfig`.

Legend: D model dim, H heads, Dqk query / key head dim (``nope + rope``), Dv value head dim,
Rq query LoRA rank, Rkv key / value LoRA rank, Dr rope dim.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEEPSEEK_V3_MLA", "AttentionShape"]


@dataclass(frozen=True, kw_only=True)
class AttentionShape:
    """Multi-head latent attention (MLA, DeepSeek-V2 / V3), per layer: queries through a
    down projection D -> Rq and an up projection Rq -> H Dqk (``q_lora_rank=None``: one
    projection D -> H Dqk); keys and values from one down projection D -> Rkv + Dr (the latent
    and a rope key shared by every head), then an up projection Rkv -> H (Dqk - Dr + Dv) (each
    head's non-rope key and its value); the output projection H Dv -> D. Scores are taken over
    Dqk, values over Dv."""

    n_heads: int  # H
    qk_head_dim: int  # Dqk, nope + rope
    v_head_dim: int  # Dv
    q_lora_rank: int | None  # Rq, None: no query LoRA
    kv_lora_rank: int  # Rkv
    rope_dim: int  # Dr

    def __post_init__(self) -> None:
        for name in ("n_heads", "qk_head_dim", "v_head_dim", "kv_lora_rank", "rope_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank must be >= 1 or None, got {self.q_lora_rank}")
        if self.rope_dim >= self.qk_head_dim:
            raise ValueError(f"rope_dim={self.rope_dim} must be below qk_head_dim={self.qk_head_dim}")

    def projection_params(self, dim: int) -> int:
        """Weights of one layer's projections (each token's GEMM FLOPs are twice this, forward)."""
        H, qk, v, rq, rkv, rope = (self.n_heads, self.qk_head_dim, self.v_head_dim, self.q_lora_rank,
                                   self.kv_lora_rank, self.rope_dim)  # fmt: skip
        q = dim * H * qk if rq is None else dim * rq + rq * H * qk
        kv = dim * (rkv + rope) + rkv * H * (qk - rope + v)
        return q + kv + H * v * dim

    def params(self, dim: int) -> int:
        """One layer's attention parameters: the projections and the RMSNorms of the two latents."""
        return self.projection_params(dim) + (self.q_lora_rank or 0) + self.kv_lora_rank

    @property
    def score_value_width(self) -> int:
        """H (Dqk + Dv): QK^T and AV of one query against one key cost 2 H (Dqk + Dv) FLOPs, forward."""
        return self.n_heads * (self.qk_head_dim + self.v_head_dim)


# DeepSeek-V3 (its report, and config.json of deepseek-ai/DeepSeek-V3): hidden 7168, 128 heads,
# q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128.
# The `deepseek-v3-like` preset has the same D, heads, layers, MLPs, experts and vocabulary, its
# attention the Llama one (head dim 56): both DeepSeek-V3 rows of `moe.plan.runs` pass this shape
DEEPSEEK_V3_MLA = AttentionShape(
    n_heads=128, qk_head_dim=128 + 64, v_head_dim=128, q_lora_rank=1536, kv_lora_rank=512, rope_dim=64
)
