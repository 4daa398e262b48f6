"""Llama-2 and its MoE variants (`LlamaConfig` presets, the `Llama` module, transformers interop)."""

from .config import PRESETS, LlamaConfig, llama2_ffn_hidden_dim
from .model import Attention, FeedForward, Llama, RMSNorm, TransformerBlock, document_ids

__all__ = [
    "PRESETS",
    "Attention",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "TransformerBlock",
    "document_ids",
    "llama2_ffn_hidden_dim",
]
