"""Text generation from a run's latest checkpoint, with a key/value cache.

Legend: B batch, S new positions, P cached positions, G key/value heads, Dh head dim, V vocabulary.

`forward_cached` runs a `Llama` block by block through the model's own modules, keeping each
layer's keys and values, so a new token costs one position instead of the whole prefix. The
MoE layers route in eval mode. Routers that decide per token (top-k, BASE's greedy eval
routing, Sinkhorn's eval top-k) give the same outputs with and without the cache; expert
choice picks tokens per expert among those routed together, so its cached decode differs.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models.llama import Llama
from ..models.llama.model import apply_rope
from .checkpoint import load_model_weights, load_newest
from .config import TrainConfig, model_config_from_dict, run_tokenizer
from .data import load_tokenizer
from .manifest import read_run_config

__all__ = ["KVCache", "fit_prompt", "forward_cached", "generate", "generate_from_run", "load_run_model"]


class KVCache:
    """Per layer keys and values of the positions seen so far, (B, G, P, Dh) each."""

    def __init__(self) -> None:
        self.k: dict[str, Tensor] = {}
        self.v: dict[str, Tensor] = {}
        self.length = 0


def _attention(attn, x_BSD: Tensor, rope: Tensor, cache: KVCache, key: str) -> Tensor:
    B, S, _ = x_BSD.shape
    start = cache.length
    rows = rope[start : start + S]
    q = apply_rope(attn.wq(x_BSD).view(B, S, -1, attn.head_dim), rows).transpose(1, 2)
    k = apply_rope(attn.wk(x_BSD).view(B, S, -1, attn.head_dim), rows).transpose(1, 2)
    v = attn.wv(x_BSD).view(B, S, -1, attn.head_dim).transpose(1, 2)
    if key in cache.k:
        k, v = torch.cat([cache.k[key], k], dim=2), torch.cat([cache.v[key], v], dim=2)
    cache.k[key], cache.v[key] = k, v
    gqa = q.shape[1] != k.shape[1]
    if start == 0:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    else:  # new position i sees every cached one and the new ones up to itself
        mask = torch.ones(S, start + S, dtype=torch.bool, device=q.device).tril(start)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return attn.wo(y.transpose(1, 2).reshape(B, S, -1))


@torch.no_grad()
def forward_cached(model: Llama, tokens_BS: Tensor, cache: KVCache) -> Tensor:
    """Logits (B, S, V) of ``tokens`` placed after the ``cache.length`` positions already cached."""
    if cache.length + tokens_BS.shape[1] > model.rope.shape[0]:
        raise ValueError(f"{cache.length + tokens_BS.shape[1]} positions exceed max_seq_len={model.rope.shape[0]}")
    h = model.tok_embeddings(tokens_BS)
    for key, block in model.layers.items():
        h = h + _attention(block.attention, block.attention_norm(h), model.rope, cache, key)
        z = block.ffn_norm(h)
        h = h + (block.feed_forward(z, seq_len=z.shape[1]) if block.is_moe else block.feed_forward(z))
    cache.length += tokens_BS.shape[1]
    return model.output(model.norm(h))


def _sample(logits_V: Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    if temperature == 0:
        return int(logits_V.argmax())
    probs = (logits_V.float() / temperature).softmax(-1)
    if top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < top_p  # the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))


@torch.no_grad()
def generate(
    model: Llama,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    use_cache: bool = True,
) -> list[int]:
    """``max_new_tokens`` ids after ``prompt`` (greedy at temperature 0); stops early at the
    model's context length. Without the cache every token recomputes the whole prefix."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    ids = list(prompt)
    cache = KVCache()
    pending = torch.tensor([ids], device=device)
    out: list[int] = []
    limit = model.rope.shape[0]
    for _ in range(max_new_tokens):
        if len(ids) >= limit:
            break
        if use_cache:
            logits = forward_cached(model, pending, cache)
        else:
            logits = model(torch.tensor([ids], device=device))
        nxt = _sample(logits[0, -1].cpu(), temperature, top_p, gen)
        ids.append(nxt)
        out.append(nxt)
        pending = torch.tensor([[nxt]], device=device)
    return out


def fit_prompt(prompt: list[int], max_new_tokens: int, context: int) -> list[int]:
    """The prompt's last tokens that leave room for ``max_new_tokens`` in the model's
    ``context`` (at least one token of it), with a warning when it had to be cut."""
    keep = max(1, context - max_new_tokens)
    if len(prompt) <= keep:
        return prompt
    room = min(max_new_tokens, context - keep)
    print(
        f"moe generate: warning: the prompt has {len(prompt)} tokens and the model's context is {context}: "
        f"kept its last {keep} tokens, so that {room} new tokens fit",
        file=sys.stderr,
    )
    return prompt[-keep:]


def load_run_model(run_dir) -> tuple[Llama, dict]:
    """The model of a run's newest intact checkpoint in one process (whatever layout wrote it),
    and its config.json. Damaged checkpoints, and one pruned by a run still training while it
    was read, pass to the next newest with a warning; `CheckpointError` when none is left."""
    run_dir = Path(run_dir)
    info = read_run_config(run_dir)
    with torch.device("meta"):
        model = Llama(model_config_from_dict(info["model"]))
    model.to_empty(device="cpu")
    model.init_weights()  # the rotary table; the weights come from the checkpoint
    load_newest(run_dir, lambda path: load_model_weights(path, model))
    return model.eval(), info


def generate_from_run(run_dir, args) -> int:
    model, info = load_run_model(run_dir)
    tokenizer = load_tokenizer(run_tokenizer(TrainConfig.from_dict(info["train"])))
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        bos = getattr(tokenizer, "bos_id", None)
        prompt = [bos if bos is not None else 0]
    prompt = fit_prompt(prompt, args.max_new_tokens, model.rope.shape[0])
    t0 = time.perf_counter()
    ids = generate(
        model,
        prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        use_cache=not args.no_cache,
    )
    dt = time.perf_counter() - t0
    print(args.prompt + tokenizer.decode(ids))
    if args.print_ids:
        print("ids:", " ".join(map(str, ids)))
    print(f"{len(ids)} tokens in {dt:.2f} s: {len(ids) / dt:.1f} tokens/s", file=sys.stderr)
    return 0
