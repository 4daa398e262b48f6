"""`moe train` end to end (subprocesses): the run folder, exact resume, --stop-at, SIGTERM
(a cluster's stop; Ctrl-C under --nproc is in test_layouts.py)."""

import json
import signal
import time

import pytest

from .run import TINY, moe, popen


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_run_folder_and_exact_resume(tmp_path, data):
    common = [*TINY, "--data", data, "--steps", 6, "--eval-every", 3, "--checkpoint-every", 2, "--keep", 2]
    whole, split = tmp_path / "whole", tmp_path / "split"
    log = moe("train", *common, "--out", whole, "--log-every", 4).stderr  # a pipe, as a log file is
    assert "\r" not in log and "train:" not in log  # no redrawn bar, one plain line every 4 steps and at the end
    steps = [line.split(" loss ")[0] for line in log.splitlines() if line.startswith("step ")]
    assert steps == ["step 4/6", "step 6/6"]
    first = moe("train", *common, "--out", split, "--stop-at", 3)
    assert "resume with: moe train --out" in first.stdout
    assert sorted(p.name for p in (split / "checkpoints").iterdir()) == ["latest", "step_000002", "step_000003"]
    again = moe("train", "--out", split, "--resume")  # the run's own config: no flag repeated
    assert "resumed from" in again.stdout + again.stderr and "at step 3" in again.stdout + again.stderr

    # the run folder
    cfg = json.loads((whole / "config.json").read_text())
    assert cfg["train"]["steps"] == 6 and cfg["model"]["vocab_size"] == 260 and cfg["train"]["router"] == "base"
    assert (whole / "loss.png").stat().st_size > 0 and (whole / "expert_load.png").stat().st_size > 0
    assert sorted(p.name for p in (whole / "checkpoints").iterdir()) == ["latest", "step_000004", "step_000006"]
    assert (whole / "checkpoints" / "latest").read_text().strip() == "step_000006"
    rows = _metrics(whole)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]
    assert set(rows[0]) == {"step", "val_loss"}  # before training
    for r in rows[1:]:
        assert {"loss", "lm_loss", "aux_loss", "tokens_per_s", "lr", "grad_norm", "moe"} <= set(r)
        assert sorted(r["moe"]) == ["1", "3"]  # tiny: MoE in layers 1 and 3
        assert {"max_load", "cv", "dropped", "load"} <= set(r["moe"]["1"])
        assert r["loss"] == pytest.approx(r["lm_loss"] + r["aux_loss"], rel=1e-6)
    assert [r["step"] for r in rows if "val_loss" in r] == [0, 3, 6]

    # interrupted + resumed == uninterrupted, bit for bit in fp32 on CPU
    resumed = _metrics(split)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4, 5, 6]
    for a, b in zip(rows, resumed, strict=True):
        a.pop("tokens_per_s", None), b.pop("tokens_per_s", None)  # all but the timing
        assert a == b, a["step"]


def test_sigterm_checkpoints_and_resumes(tmp_path, data):
    common = [*TINY, "--data", data, "--steps", 1000, "--eval-every", 1000, "--checkpoint-every", 1000]
    run, ref = tmp_path / "run", tmp_path / "ref"
    proc = popen("train", *common, "--out", run)
    metrics = run / "metrics.jsonl"
    for _ in range(600):  # until a step has finished (no time is asserted)
        if metrics.exists() and metrics.read_text().count("\n") >= 3:
            break
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)  # what a scheduler sends at its time limit
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM: stopped after step" in out and "resume with: moe train --out" in out, out + err
    steps = [r["step"] for r in _metrics(run)]
    k = steps[-1]
    assert steps == list(range(k + 1)) and 1 <= k < 1000
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{k:06d}"  # nothing lost

    moe("train", "--out", run, "--resume", "--stop-at", k + 2)
    moe("train", *common, "--out", ref, "--stop-at", k + 2)
    assert [r.get("loss") for r in _metrics(run)] == [r.get("loss") for r in _metrics(ref)]


def test_resume_rules(tmp_path, data):
    run = tmp_path / "run"
    moe("train", *TINY, "--data", data, "--steps", 4, "--stop-at", 2, "--out", run)
    changed = moe("train", "--out", run, "--resume", "--lr", "0.5", check=False)
    assert changed.returncode == 2 and "--lr 0.5 differs from the run's" in changed.stderr
    again = moe("train", *TINY, "--data", data, "--out", run, check=False)
    assert again.returncode == 2 and "pass --resume" in again.stderr
    assert len(changed.stderr.strip().splitlines()) == 1 and "Traceback" not in again.stderr


def test_tokenizer_json(tmp_path, data):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"])
    tok.train([str(p) for p in sorted(data.iterdir())], trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    run = tmp_path / "run"
    moe("train", *TINY, "--data", data, "--tokenizer", tmp_path / "tokenizer.json", "--steps", 2, "--out", run)
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["model"]["vocab_size"] == tok.get_vocab_size() and cfg["tokenizer"].endswith("tokenizer.json")
    assert len(_metrics(run)) == 3
    text = moe("generate", "--run", run, "--prompt", "import", "--max-new-tokens", 4).stdout
    assert text.startswith("import")
    # the tokenizer file changed under the run: its vocabulary no longer matches the model's
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=280, special_tokens=["<unk>", "<|endoftext|>"])
    tok.train([str(p) for p in sorted(data.iterdir())], trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    again = moe("train", "--out", run, "--resume", check=False)
    assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1, again.stderr
    built = cfg["model"]["vocab_size"]
    assert f"has {tok.get_vocab_size()} tokens, the run's model was built for {built}" in again.stderr
