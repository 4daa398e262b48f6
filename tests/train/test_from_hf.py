"""`moe train --from-hf`: a transformers Llama folder (safetensors, its tokenizer.json) is the
starting point, dense or upcycled into experts; the first loss is transformers' loss on the
same batch."""

import json

import pytest
import torch
import torch.nn.functional as F

from moe.train.data import HFTokenizer, load_corpus

from .run import corpus, moe


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    tmp = tmp_path_factory.mktemp("hf")
    data = corpus(tmp)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"])
    tok.train([str(p) for p in sorted(data.iterdir())], trainer)
    folder = tmp / "llama"
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    return folder, data, hf


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
