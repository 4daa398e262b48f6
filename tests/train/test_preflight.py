"""What `moe train` and `moe generate` refuse before they build a model, or handle instead of
failing deep inside: a tokenizer that is not one, an ``--out`` that is a file, a run that does
not fit in memory, binary files and broken links among the data, a prompt longer than the
model's context, and `moe bench` from the installed ``moe`` script."""

import sys
from pathlib import Path

import pytest

from moe.cli import UsageError, main
from moe.models.llama import LlamaConfig
from moe.train import preflight
from moe.train.config import TrainConfig, model_config

from .run import ROOT, TINY, corpus, moe


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_file_as_out_and_a_broken_tokenizer_exit_2(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert main(["train", *TINY, "--out", str(tmp_path / "afile")]) == 2
    assert "--out " + str(tmp_path / "afile") + " is a file" in _one_line(capsys)
    (tmp_path / "tok.json").write_text('{"model": ')  # cut short
    assert main(["train", *TINY, "--out", str(tmp_path / "r"), "--tokenizer", str(tmp_path / "tok.json")]) == 2
    assert "not a readable tokenizer.json" in _one_line(capsys)
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_a_run_that_does_not_fit_is_refused_before_it_allocates(tmp_path, capsys, monkeypatch):
    cfg = TrainConfig(preset="tiny", batch=4, seq_len=32, dp_shard=1)
    mc = model_config(cfg, 260)
    need, step = preflight.step_bytes(cfg, mc, on_gpu=False)
    assert need >= 4 * mc.num_params() and step > 4 * 4 * mc.num_params()  # params, grads, AdamW at least
    monkeypatch.setattr(preflight, "available_memory", lambda: (need - 1, "available host memory", False))
    assert main(["train", *TINY, "--out", str(tmp_path / "r")]) == 2
    err = _one_line(capsys)
    assert "--preset tiny: needs about" in err and "pass --force" in err
    # two local processes share the host: what one fits in, two may not
    monkeypatch.setattr(preflight, "available_memory", lambda: (need + 1, "available host memory", False))
    preflight.fit_check(cfg, mc, local_procs=1)
    with pytest.raises(ValueError, match="x 2 local processes"):
        preflight.fit_check(cfg, mc, local_procs=2)


def test_a_model_larger_than_the_machine_exits_2_at_once(tmp_path):
    """The issue's case: the whole model cannot even be built here. The address space of the
    command is capped, so that a regression fails with an allocation error instead of taking
    the machine's memory."""
    import resource
    import subprocess

    from .run import env

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    argv = [sys.executable, "-m", "moe", "train", "--preset", "llama2-70b", "--out", str(tmp_path / "r")]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env(), cwd=ROOT, timeout=300, preexec_fn=cap)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert "--preset llama2-70b: needs about" in proc.stderr and "GB" in proc.stderr and "--force" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_binary_files_and_broken_links_in_the_data_are_skipped(tmp_path):
    data = corpus(tmp_path)
    (data / "blob").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" * 50)
    (data / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    run = tmp_path / "run"
    proc = moe("train", *TINY, "--data", data, "--steps", 1, "--eval-batches", 1, "--out", run)
    assert "skipped 1 binary file(s)" in proc.stderr and "blob" in proc.stderr
    assert "skipped 1 missing file(s) or broken link(s)" in proc.stderr and "gone.txt" in proc.stderr
    assert "Traceback" not in proc.stderr and (run / "checkpoints").is_dir()
    alone = moe("train", *TINY, "--data", data / "blob", "--out", tmp_path / "r2", check=False)
    assert alone.returncode == 2 and "a binary file, not text" in alone.stderr
    assert len(alone.stderr.strip().splitlines()) == 1, alone.stderr


def test_a_prompt_longer_than_the_context_keeps_its_end(tmp_path):
    run = tmp_path / "run"
    moe("train", *TINY, "--data", corpus(tmp_path), "--steps", 1, "--eval-batches", 1, "--out", run)
    context = LlamaConfig.from_name("tiny").max_seq_len
    prompt = "x = 1\n" * (context // 2)  # 3 x context bytes
    proc = moe("generate", "--run", run, "--prompt", prompt, "--max-new-tokens", 8, "--print-ids")
    ids = next(line for line in proc.stdout.splitlines() if line.startswith("ids:")).split()[1:]
    assert len(ids) == 8, proc.stderr
    assert f"kept its last {context - 8} tokens" in proc.stderr


def test_bench_from_the_moe_script(monkeypatch, capsys):
    """The installed ``moe`` script's sys.path starts at its own folder, not the current one."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != ROOT])
    for name in [m for m in sys.modules if m == "benchmarks" or m.startswith("benchmarks.")]:
        monkeypatch.delitem(sys.modules, name)
    assert main(["bench", "routing", "--help"]) == 0
    assert "--quick" in capsys.readouterr().out


def _resolved(argv: list[str]) -> dict:
    """The options `moe train ARGV` runs with, after its checks (nothing is launched)."""
    from moe import cli

    parser = cli.build_parser()
    args = parser.parse_args(["train", *argv])
    args._explicit = cli._explicit(parser, ["train", *argv])
    cli._check_train(args, parser)
    return {k: getattr(args, k) for k in ("nproc", "tp", "pp", "ep", "etp", "dp_shard", "dp_replicate",
                                          "pp_schedule", "micro_batches", "grad_accum", "ac", "dispatch")}  # fmt: skip


def test_the_planners_layout_string_runs_as_the_flags(tmp_path, monkeypatch):
    from moe.plan.layout import Layout

    monkeypatch.chdir(tmp_path)
    base = ["--preset", "tiny", "--batch", "8", "--seq-len", "32"]
    cases = [  # a layout as moe plan prints it (Layout.short) -> the same run given by flags
        # without stages the planner's micro_batch (1) is a pass: --grad-accum is the rank's rows / it
        (Layout(tp=2, ep=2, dp_shard=2, etp=True),
         ["--nproc", "4", "--tp", "2", "--ep", "2", "--etp", "--grad-accum", "4"]),
        (Layout(pp=2, dp_shard=2, micro_batch=2), ["--nproc", "4", "--pp", "2", "--micro-batches", "2"]),
        (Layout(pp=2, vpp=2, schedule="interleaved_1f1b", micro_batch=4),
         ["--nproc", "2", "--pp", "2", "--pp-schedule", "interleaved", "--micro-batches", "2"]),
        (Layout(dp_shard=2, dp_replicate=2, micro_batch=2), ["--nproc", "4", "--dp-replicate", "2"]),
        (Layout(tp=2, dp_shard=2, recompute=True), ["--nproc", "4", "--tp", "2", "--ac", "full", "--grad-accum", "4"]),
        (Layout(pp=2, tp=2, etp=True, reshard=False, micro_batch=4),  # the 1.2T pick's kind: etp in stages
         ["--nproc", "4", "--pp", "2", "--tp", "2", "--etp", "--reshard", "0", "--micro-batches", "2"]),
        (Layout(ep=4, dp_shard=4, dispatch="hierarchical"),
         ["--nproc", "4", "--ep", "4", "--dispatch", "hierarchical", "--grad-accum", "2"]),
        (Layout(ep=2, dp_shard=2, chunks=2), ["--nproc", "2", "--ep", "2", "--ep-chunks", "2", "--grad-accum", "4"]),
    ]  # fmt: skip
    for lay, flags in cases:
        text = lay.short()
        assert _resolved([*base, "--layout", text]) == _resolved([*base, *flags]), text
    # dp_shard left out: what --nproc leaves, as the planner derives it from --gpus
    assert _resolved([*base, "--layout", "tp=2", "--nproc", "4"])["dp_shard"] == 2
    bad = [
        ("tp=2,precision=fp8", "precision=fp8 is not run"),
        ("pp=2,micro_batch=3", "micro_batch=3 must divide the 8 sequences"),
        ("dp_shard=2,micro_batch=3", "micro_batch=3 must divide the 4 sequences"),
        ("tp=2,dp_shard=2", "must multiply to the world size 2"),  # with --nproc 2
    ]
    for text, message in bad:
        extra = ["--nproc", "2"] if text == "tp=2,dp_shard=2" else []
        with pytest.raises(UsageError, match=message):
            _resolved([*base, "--layout", text, *extra])
    with pytest.raises(UsageError, match="--layout replaces --tp"):
        _resolved([*base, "--layout", "tp=2", "--tp", "2"])
    with pytest.raises(UsageError, match="--grad-accum 2: --layout 'tp=2' runs micro_batch=1 sequences a pass, 8"):
        _resolved([*base, "--layout", "tp=2", "--grad-accum", "2"])


def test_dry_run_builds_on_meta_and_prints_size_layout_and_memory(tmp_path, capsys):
    """Seconds even for the 1.2T preset: nothing is allocated, nothing written, nothing launched."""
    out = tmp_path / "r"
    assert main(["train", "--preset", "llama2-moe-1.2t", "--router", "topk", "--dry-run", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    mc = model_config(TrainConfig(preset="llama2-moe-1.2t", router="topk"), 260)  # the byte vocabulary
    total, active = mc.num_params() / 1e9, mc.num_active_params() / 1e9
    assert f"llama2-moe-1.2t: {total:.2f}B parameters, {active:.2f}B active per token, 80 layers" in text, text
    assert "does not fit (moe train refuses it without --force)" in text and not out.exists()
    argv = ["train", *TINY, "--dry-run", "--layout", "tp=2,ep=2,dp_shard=2", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "layout: 4 processes: tp=2 pp=1 ep=2 etp=0 dp_shard=2" in text and ": fits" in text and not out.exists()
