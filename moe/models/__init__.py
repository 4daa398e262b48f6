"""Model families built from the MoE layer. No process groups here: `moe.parallel` lays them out."""

from .llama import Attention, FeedForward, Llama, LlamaConfig, RMSNorm, TransformerBlock

__all__ = ["Attention", "FeedForward", "Llama", "LlamaConfig", "RMSNorm", "TransformerBlock"]
