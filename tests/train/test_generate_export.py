"""`moe generate` (KV cache == no cache) and `moe export --to hf` (transformers loads it, same logits)."""

import pytest
import torch

from moe.models.llama import Llama, LlamaConfig
from moe.train.generate import KVCache, forward_cached, generate, load_run_model

from .run import TINY, corpus, moe


@pytest.mark.parametrize("router", ["topk", "base", "sinkhorn"])
def test_cached_logits_and_greedy_tokens_equal_uncached(router):
    overrides = {"router": router, "top_k": 1, "combine": "sigmoid_residual"} if router == "base" else {}
    cfg = LlamaConfig.from_name("tiny")
    cfg = LlamaConfig.from_name("tiny", moe=type(cfg.moe)(**{**cfg.moe.__dict__, "router": router, **overrides}))
    torch.manual_seed(0)
    model = Llama(cfg).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    full = model(tokens)
    cache = KVCache()
    parts = [forward_cached(model, tokens[:, :5], cache)]  # a prefill, then a chunk, then one by one
    parts.append(forward_cached(model, tokens[:, 5:8], cache))
    parts += [forward_cached(model, tokens[:, i : i + 1], cache) for i in range(8, 12)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)

    prompt = tokens[0, :4].tolist()
    cached = generate(model, prompt, 24, use_cache=True)
    plain = generate(model, prompt, 24, use_cache=False)
    assert cached == plain and len(cached) == 24


@pytest.fixture(scope="module")
def mixtral_run(tmp_path_factory):
    """A tiny run that Mixtral expresses: every layer top-2 softmax, no bias, dropless."""
    tmp = tmp_path_factory.mktemp("mixtral")
    run = tmp / "run"
    moe("train", *TINY, "--data", corpus(tmp), "--steps", 3, "--router", "topk", "--moe-every", 1, "--out", run)
    return run


def _ids(proc) -> list[str]:
    return [line for line in proc.stdout.splitlines() if line.startswith("ids:")]


def test_generate_command_cache_equals_no_cache(mixtral_run):
    args = ["generate", "--run", mixtral_run, "--prompt", "def f(x):", "--max-new-tokens", 12, "--print-ids"]
    greedy = [*args, "--temperature", 0]
    cached, plain = moe(*greedy), moe(*greedy, "--no-cache")
    ids = _ids(cached)
    assert ids and ids == _ids(plain)
    assert len(ids[0].split()) == 13 and "tokens/s" in cached.stderr
    # by default it samples (temperature 0.8, top-p 0.95): the seed decides, and the same seed repeats
    sampled, again, other = moe(*args), moe(*args), moe(*args, "--seed", 1)
    assert _ids(sampled) == _ids(again) and _ids(sampled) != _ids(other) and len(_ids(other)[0].split()) == 13


def test_export_mixtral_loads_in_transformers_with_equal_logits(mixtral_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert "MixtralForCausalLM" in moe("export", "--run", mixtral_run, "--to", "hf", out).stdout
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    ours, _ = load_run_model(mixtral_run)
    tokens = torch.randint(0, ours.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)


def test_export_dense_llama_and_refuse_base(tmp_path):
    transformers = pytest.importorskip("transformers")
    data = corpus(tmp_path)
    dense, base = tmp_path / "dense", tmp_path / "base"
    moe("train", *TINY, "--data", data, "--steps", 2, "--dense", "--out", dense)
    moe("export", "--run", dense, "--to", "hf", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    ours, _ = load_run_model(dense)
    tokens = torch.randint(0, ours.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)

    moe("train", *TINY, "--data", data, "--steps", 2, "--out", base)  # BASE router: no Mixtral counterpart
    refused = moe("export", "--run", base, "--to", "hf", tmp_path / "hf2", check=False)
    assert refused.returncode == 2 and "BASE's balanced assignment" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
