"""Adapters that put `moe.MoE` into other code bases (Hugging Face transformers, ...)."""
