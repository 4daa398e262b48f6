"""The Llama-2 decoder with optional MoE MLPs. No process group inside: tensor, sequence,
pipeline and data parallelism are applied from outside (`moe.parallel`), so the module names
below are the ones their plans refer to.

Legend: B batch, S sequence, D model dim, H query heads, G key/value heads, Dh head dim,
F dense MLP width, V vocabulary.

    Llama
      tok_embeddings  nn.Embedding(V, D)         None in a pipeline stage that does not embed
      layers          nn.ModuleDict {"0": TransformerBlock, ...}   a stage keeps some of them
      norm            RMSNorm(D)                 None in a stage that does not end the model
      output          nn.Linear(D, V)            None likewise; never tied to the embedding
      rope            buffer (max_seq_len, 2, Dh): cos and sin, not saved, recomputed by init_weights

Rotary embeddings rotate the two halves of each head (``x1, x2 -> x1 cos - x2 sin, x2 cos +
x1 sin``), the layout of transformers' Llama checkpoints, so their q/k weights load as they are.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...layer import MoE
from .config import LlamaConfig

__all__ = ["Attention", "FeedForward", "Llama", "RMSNorm", "TransformerBlock", "document_ids", "rope_table"]


def rope_table(head_dim: int, max_seq_len: int, theta: float, device=None) -> Tensor:
    """cos and sin of position p times frequency theta^(-2j/Dh), (max_seq_len, 2, Dh), fp32;
    each frequency appears twice (once per half of the head) as the rotation pairs j with j + Dh/2."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # (S, Dh)
    return torch.stack([angles.cos(), angles.sin()], dim=1)


def apply_rope(x_BSHD: Tensor, rope_S2D: Tensor) -> Tensor:
    """Rotate ``x: (B, S, heads, Dh)`` by the first S rows of the table, in fp32."""
    seq = x_BSHD.shape[1]
    cos, sin = rope_S2D[:seq, 0, None, :].float(), rope_S2D[:seq, 1, None, :].float()  # (S, 1, Dh)
    x = x_BSHD.float()
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x_BSHD.dtype)


def document_ids(tokens_BS: Tensor, eos_id: int) -> Tensor:
    """Which document of its row each token is in, (B, S) int64: documents packed with
    ``eos_id`` after each, the end-of-text token counted in the document it ends."""
    ends = tokens_BS == eos_id
    return torch.cumsum(ends, dim=1) - ends.long()


def document_mask(documents_BS: Tensor) -> Tensor:
    """The attention mask of `Llama.forward`'s ``documents``: (B, 1, S, S) bool, True where query
    i may see key j (j <= i and both in the same document)."""
    seq = documents_BS.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents_BS.device).tril()
    return (documents_BS[:, None, :, None] == documents_BS[:, None, None, :]) & causal


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, the statistics in fp32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class Attention(nn.Module):
    """Causal grouped-query attention with RoPE: G key/value heads shared by H/G query heads each.

    Head counts are read from the projections' outputs (``view(B, S, -1, Dh)``), so a
    tensor-parallel shard holding some of the heads (wq/wk/wv colwise, wo rowwise) runs as is.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        q_out, kv_out = config.n_heads * self.head_dim, config.n_kv_heads * self.head_dim
        self.wq = nn.Linear(config.dim, q_out, bias=False)
        self.wk = nn.Linear(config.dim, kv_out, bias=False)
        self.wv = nn.Linear(config.dim, kv_out, bias=False)
        self.wo = nn.Linear(q_out, config.dim, bias=False)

    def init_weights(self, std: float, out_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            nn.init.normal_(lin.weight, std=std)
        nn.init.normal_(self.wo.weight, std=out_std)

    def forward(self, x_BSD: Tensor, rope: Tensor, *, mask: Tensor | None = None) -> Tensor:
        """``mask``: None for causal attention over the whole row, or a (B, 1, S, S) bool mask
        (`document_mask`)."""
        B, S, _ = x_BSD.shape
        q = apply_rope(self.wq(x_BSD).view(B, S, -1, self.head_dim), rope)
        k = apply_rope(self.wk(x_BSD).view(B, S, -1, self.head_dim), rope)
        v = self.wv(x_BSD).view(B, S, -1, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, S, Dh)
        gqa = q.shape[1] != k.shape[1]
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.wo(y.transpose(1, 2).reshape(B, S, -1))


class FeedForward(nn.Module):
    """The dense SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``; w1 the gate, w3 the up, w2 the down projection."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.w1.weight, std=std)
        nn.init.normal_(self.w3.weight, std=std)
        nn.init.normal_(self.w2.weight, std=out_std)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(attention_norm(x)); out = h + feed_forward(ffn_norm(h))``.

    ``feed_forward`` is a `FeedForward`, or an `moe.MoE` where ``config.is_moe_layer(layer_id)``;
    it gets (B, S, D) and, for MoE, ``seq_len=S`` (for the sequence-wise aux loss).
    """

    def __init__(self, layer_id: int, config: LlamaConfig) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.is_moe = config.is_moe_layer(layer_id)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        if self.is_moe:
            self.feed_forward = MoE(config.moe)
        else:
            self.feed_forward = FeedForward(config.dim, config.ffn_hidden_dim)

    def init_weights(self, std: float, out_std: float) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(std, out_std)
        if self.is_moe:
            self.feed_forward.reset_parameters()  # the layer's own initialisers
        else:
            self.feed_forward.init_weights(std, out_std)

    def forward(self, x_BSD: Tensor, rope: Tensor, *, mask: Tensor | None = None) -> Tensor:
        h = x_BSD + self.attention(self.attention_norm(x_BSD), rope, mask=mask)
        z = self.ffn_norm(h)
        return h + (self.feed_forward(z, seq_len=z.shape[1]) if self.is_moe else self.feed_forward(z))


class Llama(nn.Module):
    """Llama-2 decoder, ``forward(tokens: (B, S) int) -> logits: (B, S, V)``.

    A pipeline stage may set ``tok_embeddings`` to None (it then takes ``h: (B, S, D)``) and
    ``norm``/``output`` to None (it then returns ``h``), and delete entries of ``layers``.
    Build on the meta device, shard, ``to_empty(device=...)``, then `init_weights`.
    The MoE layers' router losses wait on them until ``moe.aux_loss(model)`` collects them.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, config) for i in range(config.n_layers)})
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.register_buffer("rope", self._rope_table(), persistent=False)
        if self.rope.device.type != "meta":
            self.init_weights()

    def _rope_table(self, device=None) -> Tensor:
        cfg = self.config
        return rope_table(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=device)

    def reset_rope(self) -> None:
        """Recompute the rotary table in fp32 on the buffer's device (after ``to_empty``, or
        after ``model.to(dtype)`` rounded it)."""
        self.rope = self._rope_table(device=self.rope.device)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter and buffer in place (plain tensors or DTensor shards):
        N(0, init_std) for embeddings and projections, the residual-branch outputs (wo, dense
        w2) scaled by 1/sqrt(2 L) as in GPT-2 so the residual stream does not grow with depth,
        norms to one, MoE layers by their own ``reset_parameters``, the rotary table recomputed.
        The same seed gives the same weights whether the model was built on meta or on a device."""
        cfg = self.config
        self.reset_rope()
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, std=cfg.init_std)
        for layer in self.layers.values():
            layer.init_weights(cfg.init_std, out_std)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            nn.init.normal_(self.output.weight, std=cfg.init_std)

    def forward(self, tokens: Tensor, *, documents: Tensor | None = None) -> Tensor:
        """``tokens: (B, S)`` integer ids (or ``h: (B, S, D)`` without ``tok_embeddings``) ->
        logits (B, S, V) (or ``h`` without ``output``).

        ``documents``: optional (B, S) integer ids of the document each position belongs to
        (`document_ids`); a token then attends only to earlier tokens of its own document
        (document-level masking; the rotary positions stay those of the row, and attention
        scores depend only on the offset between two positions, so a document sees what it
        would alone at the start of a row). None (the default): causal over the whole row."""
        if self.tok_embeddings is not None:
            if tokens.dim() != 2 or tokens.dtype.is_floating_point:
                raise ValueError(f"tokens must be (B, S) integer ids, got {tuple(tokens.shape)} {tokens.dtype}")
            h = self.tok_embeddings(tokens)
        else:
            if tokens.dim() != 3:
                raise ValueError(f"a stage without tok_embeddings takes h: (B, S, D), got {tuple(tokens.shape)}")
            h = tokens
        if h.shape[1] > self.rope.shape[0]:
            raise ValueError(f"sequence length {h.shape[1]} exceeds max_seq_len={self.rope.shape[0]}")
        mask = None
        if documents is not None:  # (B, S) whole rows, also where h holds a sequence-parallel shard
            want = tuple(tokens.shape) if self.tok_embeddings is not None else (h.shape[0], documents.shape[-1])
            if tuple(documents.shape) != want or documents.dtype.is_floating_point:
                raise ValueError(f"documents must be (B, S) = {want} integer ids, got {tuple(documents.shape)} "
                                 f"{documents.dtype}")  # fmt: skip
            mask = document_mask(documents.to(h.device))
        for layer in self.layers.values():
            h = layer(h, self.rope, mask=mask)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    @classmethod
    def from_hf(cls, model_or_path, **options) -> Llama:
        """From a transformers ``LlamaForCausalLM`` or a local directory of one (config.json and
        safetensors), optionally upcycled into MoE layers: see `moe.models.llama.hf.from_hf`."""
        from .hf import from_hf  # transformers/safetensors only when asked for

        return from_hf(model_or_path, model_cls=cls, **options)

    def to_hf(self, **options):
        """A transformers ``LlamaForCausalLM`` with these weights: see `moe.models.llama.hf.to_hf`."""
        from .hf import to_hf

        return to_hf(self, **options)
