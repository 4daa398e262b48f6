"""`moe train --from-hf`: a transformers Llama folder (safetensors, its tokenizer.json) is the
starting point, dense or upcycled into experts, and so is a Mixtral folder (its own experts);
the first loss is transformers' loss on the same batch."""

import json

import pytest
import torch
import torch.nn.functional as F

from moe.train.data import HFTokenizer, load_corpus

from .run import corpus, moe

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer_and_data(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    tmp = tmp_path_factory.mktemp("hf")
    data = corpus(tmp)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"])
    tok.train([str(p) for p in sorted(data.iterdir())], trainer)
    return tok, data, tmp


def _save(model, tok, folder):
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def checkpoint(tokenizer_and_data):
    transformers = pytest.importorskip("transformers")
    tok, data, tmp = tokenizer_and_data
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), **SHAPE)).eval()
    return _save(hf, tok, tmp / "llama"), data, hf


def _first_batch_loss(hf, data, folder, seq_len=32, batch=4, seed=0):
    c = load_corpus(str(data), HFTokenizer(folder / "tokenizer.json"), seq_len=seq_len)
    inputs, targets = c.batch(0, seed, batch, seq_len)
    with torch.no_grad():
        return float(F.cross_entropy(hf(inputs).logits.float().flatten(0, 1), targets.flatten()))


@pytest.mark.parametrize("upcycle", [None, 4])
def test_first_loss_is_transformers_loss(checkpoint, tmp_path, upcycle):
    folder, data, hf = checkpoint
    extra = ["--upcycle", upcycle, "--router", "topk", "--top-k", 2] if upcycle else []
    run = tmp_path / "run"
    moe("train", "--from-hf", folder, "--data", data, "--batch", 4, "--seq-len", 32, "--steps", 2,
        "--eval-batches", 1, "--warmup", 1, *extra, "--out", run)  # fmt: skip
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["tokenizer"] == str(folder / "tokenizer.json") and cfg["model"]["dim"] == 64
    # an upcycled layer with exact copies and top-2 gates summing to one computes the dense MLP
    assert rows[1]["lm_loss"] == pytest.approx(_first_batch_loss(hf, data, folder), rel=1e-5)
    assert (cfg["model"]["moe"] or {}).get("num_experts") == upcycle
    if upcycle:
        assert sorted(rows[1]["moe"]) == ["0", "1"]  # --moe-every 1: every MLP upcycled


def test_from_hf_refuses_what_the_checkpoint_fixes(checkpoint, tmp_path):
    folder, data, _ = checkpoint
    for extra, message in (
        (["--dim", 128], "--from-hf takes the model's shape from the checkpoint: drop --dim"),
        (["--tokenizer", folder / "missing.json"], "no such file"),
    ):
        proc = moe("train", "--from-hf", folder, "--data", data, *extra, "--out", tmp_path / "r", check=False)
        assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = moe("train", "--upcycle", 4, "--out", tmp_path / "r", check=False)
    assert proc.returncode == 2 and "--upcycle turns a checkpoint's MLPs into experts" in proc.stderr


def test_mixtral_first_loss_is_transformers_loss(tokenizer_and_data, tmp_path):
    """A Mixtral folder: every layer an MoE with its router and experts (softmax top-2,
    renormalised); the first step's cross entropy is transformers' on the same batch."""
    transformers = pytest.importorskip("transformers")
    tok, data, _ = tokenizer_and_data
    config = transformers.MixtralConfig(vocab_size=tok.get_vocab_size(), num_local_experts=4, num_experts_per_tok=2,
                                        **SHAPE)  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(config).eval()
    folder = _save(hf, tok, tmp_path / "mixtral")
    run = tmp_path / "run"
    moe("train", "--from-hf", folder, "--data", data, "--batch", 4, "--seq-len", 32, "--steps", 1,
        "--eval-batches", 1, "--warmup", 1, "--out", run)  # fmt: skip
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    model = json.loads((run / "config.json").read_text())["model"]
    assert model["moe"]["num_experts"] == 4 and model["moe"]["top_k"] == 2 and model["moe"]["router"] == "topk"
    assert model["moe"]["aux_loss_coef"] == config.router_aux_loss_coef and sorted(rows[1]["moe"]) == ["0", "1"]
    assert rows[1]["lm_loss"] == pytest.approx(_first_batch_loss(hf, data, folder), rel=1e-5)
    proc = moe("train", "--from-hf", folder, "--data", data, "--upcycle", 8, "--out", tmp_path / "r", check=False)
    assert proc.returncode == 2 and "is a Mixtral" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
