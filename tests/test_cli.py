"""The `moe` command: help, one-line usage errors (exit 2, no traceback), bench forwarding."""

import argparse

import pytest

from moe.cli import build_parser, main

from .train.run import moe


def _subparser(name):
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command", ["train", "generate", "export"])
def test_help_lists_every_option_with_its_default(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for action in _subparser(command)._actions:
        if action.option_strings and action.dest != "help":
            assert action.option_strings[-1] in text, action.dest
            assert action.help and "%(default)" not in action.help
    assert text.count("(default:") >= len([a for a in _subparser(command)._actions if a.option_strings]) - 1


def test_train_help_from_the_real_command():
    out = moe("train", "--help").stdout
    for flag in ("--preset", "--router", "--experts", "--nproc", "--ep", "--resume", "--stop-at", "--keep"):
        assert flag in out
    assert "(default: base)" in out  # BASE is the default router


BAD = [
    (["train", "--preset", "nope"], "--preset: unknown preset 'nope'"),
    (["train", "--data", "/no/such/path"], "--data /no/such/path: no such file"),
    (["train", "--router", "magic"], "invalid choice: 'magic'"),
    (["train", "--steps", "0"], "--steps must be >= 1, got 0"),
    (["train", "--steps", "4", "--stop-at", "9"], "--stop-at 9 must be <= --steps 4"),
    (["train", "--nproc", "2", "--tp", "3"], "must multiply to the world size 2"),
    (["train", "--experts", "3", "--ep", "2", "--nproc", "2"], "--experts 3 must be divisible by --ep 2"),
    (["train", "--nproc", "4", "--tp", "2", "--ep", "4"], "--ep 4 must divide --dp-shard 2"),
    (["train", "--nproc", "2", "--pp", "2", "--micro-batches", "3"], "--micro-batches 3 must divide the 8 sequences"),
    (
        ["train", "--nproc", "4", "--pp", "4", "--preset", "tiny", "--pp-schedule", "interleaved"],
        "--pp 4 x 2 stages per rank (interleaved) needs at least 8 layers, the model has 4",
    ),
    (
        ["train", "--nproc", "2", "--pp", "2", "--pp-schedule", "interleaved", "--micro-batches", "1"],
        "--pp-schedule interleaved needs --micro-batches (1) divisible by --pp 2",
    ),
    (
        ["train", "--nproc", "4", "--pp", "4", "--preset", "tiny", "--pp-schedule", "interleaved_1f1b"],
        "needs at least 8 layers, the model has 4",
    ),
    (
        ["train", "--nproc", "2", "--pp", "2", "--pp-schedule", "dualpipev", "--micro-batches", "2"],
        "--pp-schedule dualpipev needs --micro-batches (2) >= 2 x --pp = 4",
    ),
    (
        ["train", "--nproc", "4", "--pp", "4", "--preset", "tiny", "--pp-schedule", "dualpipev"],
        "--pp 4 x 2 stages per rank (dualpipev) needs at least 8 layers, the model has 4",
    ),
    (["train", "--pp-schedule", "zigzag"], "invalid choice: 'zigzag'"),
    (["train", "--micro-batches", "2"], "--micro-batches 2 splits pipeline steps: it needs --pp > 1"),
    (["train", "--nproc", "2", "--ep", "2", "--ranks-per-node", "3"], "--ranks-per-node 3 must divide --ep 2"),
    (["train", "--ep-chunks", "2"], "--ep-chunks 2 chunks the expert-parallel exchange: it needs --ep > 1"),
    (["train", "--ep-chunks", "0"], "--ep-chunks"),
    (["train", "--router", "base", "--router-groups", "2"], "they need --router topk, not base"),
    (["train", "--router", "topk", "--router-groups", "3"], "--router-groups: n_groups must divide num_experts=4"),
    (["train", "--grad-accum", "3"], "--grad-accum 3 must divide the 8 sequences of each data-parallel rank"),
    (["train", "--nproc", "2", "--pp", "2", "--grad-accum", "2"], "pipeline stages split a step with --micro-batches"),
    (["train", "--nproc", "4", "--pp", "2", "--dp-replicate", "2"], "not with --dp-replicate 2"),
    (["train", "--etp"], "--etp shards the experts over the tp ranks: it needs --tp > 1"),
    (["train", "--nproc", "2", "--batch", "3"], "--batch 3 must be divisible by the data-parallel size 2"),
    (["train", "--resume"], "--resume needs --out DIR"),
    (["train", "--tokenizer", "/no/tok.json"], "--tokenizer /no/tok.json: no such file"),
    (["generate", "--run", "/no/run"], "--run /no/run: not a run folder"),
    (["export", "--run", "/no/run", "--to", "onnx", "x"], "invalid choice: 'onnx'"),
    (["bench", "nope"], "invalid choice: 'nope'"),
    # values that pass the parser and would raise deep inside the model, the optimiser or a layout
    (["train", "--top-k", "9"], "--top-k: top_k must be an int in [1, 4], got 9"),
    (["train", "--dim", "66"], "--dim: dim=66 must be divisible by n_heads=8"),
    (["train", "--capacity-factor", "0"], "--capacity-factor must be a finite number > 0"),
    (["train", "--capacity-factor", "-1"], "--capacity-factor must be a finite number > 0"),
    (["train", "--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["train", "--aux-loss-coef", "nan"], "--aux-loss-coef must be a finite number >= 0, got nan"),
    (["train", "--router", "base", "--base-round-bytes", "-1"], "--base-round-bytes must be a finite number >= 0"),
    (["train", "--router", "topk", "--base-round-bytes", "1e6"], "it needs --router base, not topk"),
    (["train", "--weight-decay", "-0.1"], "--weight-decay must be a finite number >= 0, got -0.1"),
    (["train", "--grad-clip", "inf"], "--grad-clip must be a finite number > 0, got inf"),
    (["train", "--nproc", "3", "--tp", "3"], "--tp 3 must divide the attention heads (n_heads=8, n_kv_heads=4"),
    (["train", "--nproc", "2", "--tp", "2", "--seq-len", "33"], "--seq-len 33 must be divisible by --tp 2"),
    (["generate", "--run", "/no/run", "--temperature", "nan"], "need a finite --temperature >= 0"),
    (["generate", "--run", "/no/run", "--prompt", "ab\udcff"], "--prompt is not valid UTF-8 (byte 2 of"),
    ([], "required: command"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a) or "empty" for a, _ in BAD])
def test_bad_arguments_exit_2_with_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a default run folder would be created here, never in the repository
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_existing_run_folder_needs_resume_in_a_subprocess(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("{}")
    proc = moe("train", "--out", tmp_path / "run", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    folder = tmp_path / "run"
    hint = "pass --resume to continue it, or choose another folder"
    assert proc.stderr.strip() == f"moe train: error: --out {folder} exists: {hint}"


def test_bench_forwards_to_the_benchmark():
    proc = moe("bench", "routing", "--help")
    assert "--quick" in proc.stdout  # the routing benchmark's own option


def test_plan_forwards_to_the_planner(capsys):
    assert main(["plan", "--help"]) == 0
    assert "--global-batch-tokens" in capsys.readouterr().out
    layout = ["--gpu", "h200", "--gpus", "8", "--seq-len", "4096", "--global-batch-tokens", "1048576"]
    assert main(["plan", "--model", "llama2-7b", *layout, "--layout", "tp=2,dp_shard=4"]) == 0
    assert "tp=2,pp=1,ep=1,dp_shard=4: fits" in capsys.readouterr().out
    assert main(["plan", "--model", "nope", *layout, "--search"]) == 2
    assert "is neither a preset" in capsys.readouterr().err


def test_log_without_its_package_exits_2_before_anything_runs(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert main(["train", "--log", "wandb", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "moe train: error: --log wandb: the wandb package is not installed (pip install 'moe[log]')"
    assert not (tmp_path / "run").exists()
