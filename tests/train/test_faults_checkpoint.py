"""`moe train | generate | export` never lose a run through its checkpoints: divergence is
stopped without writing NaN weights, damaged checkpoints are detected by their manifest and
passed over, a no-op resume keeps its checkpoint, a full disk or a read-only folder end with one
line. One short run is trained once and copied for each kind of damage."""

import errno
import json
import shutil
import subprocess

import pytest
import torch
import torch.distributed.checkpoint as dcp

from moe import cli
from moe.train import checkpoint as ckpt
from moe.train import generate as gen
from moe.train.manifest import MANIFEST, verify

from .run import TINY, moe


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _last_line(stderr: str) -> str:
    """The command's own last line (the progress bar writes to stderr with carriage returns)."""
    return stderr.strip().splitlines()[-1].split("\r")[-1]


def _weights_finite(folder) -> bool:
    meta = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items() if k.startswith("model.")}
    dcp.load(state, checkpoint_id=str(folder))
    return bool(state) and all(bool(t.isfinite().all()) for t in state.values())


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data):
    """A run stopped at step 4 of 6 with checkpoints at steps 2 and 4."""
    run = tmp_path_factory.mktemp("trained") / "run"
    moe("train", *TINY, "--data", data, "--steps", 6, "--stop-at", 4, "--checkpoint-every", 2, "--keep", 3,
        "--eval-every", 2, "--out", run)  # fmt: skip
    return run


def _copy(trained, tmp_path):
    return shutil.copytree(trained, tmp_path / "run")


def _flip(path, n=256):
    """Invert ``n`` bytes in the middle of ``path`` (inside a tensor's data: the file is mostly that)."""
    raw = bytearray(path.read_bytes())
    mid = len(raw) // 2
    raw[mid : mid + n] = bytes(b ^ 0xFF for b in raw[mid : mid + n])
    path.write_bytes(bytes(raw))


# -- 1. divergence -------------------------------------------------------------------------------


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "moe"])
def test_divergence_skips_steps_then_stops_and_no_checkpoint_holds_nan(tmp_path, data, dense):
    run = tmp_path / "run"
    args = [*TINY, "--data", data, "--warmup", 1, "--steps", 12, "--checkpoint-every", 2, "--lr", 100, "--out", run]
    proc = moe("train", *args, *(["--dense"] if dense else []), check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = _last_line(proc.stderr)
    assert last.startswith("moe train: ") and " is nan at step " in last and "--max-bad-steps" in last, last
    assert "Traceback" not in proc.stderr and "done" not in proc.stdout
    rows = [r for r in _metrics(run) if "loss" in r]
    skipped = [r["step"] for r in rows if r.get("skipped")]
    assert len(skipped) == 3 and skipped == list(range(skipped[0], skipped[0] + 3)) and rows[-1]["step"] == skipped[-1]
    assert [r["skipped_steps"] for r in rows] == [sum(s <= r["step"] for s in skipped) for r in rows]
    folders = sorted((run / "checkpoints").glob("step_*"))
    assert folders and all(_weights_finite(f) and verify(f) is None for f in folders)
    assert (run / "checkpoints" / "latest").read_text().strip() == folders[-1].name
    assert str(folders[-1]) in last


def test_an_update_that_overflows_the_weights_stops_the_run_before_any_checkpoint_of_them(
    tmp_path, data, monkeypatch, capsys
):
    """The loss and gradient norm of step 3 are finite, its update is not: the run ends there."""
    real, calls = torch.optim.AdamW.step, []

    def overflows_at_3(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 3:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("inf")
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", overflows_at_3)
    run = tmp_path / "run"
    args = ["train", *map(str, TINY), "--data", str(data), "--steps", "4", "--checkpoint-every", "2", "--keep", "5"]
    assert cli.main([*args, "--out", str(run)]) == 1
    last = _last_line(capsys.readouterr().err)
    newest = run / "checkpoints" / "step_000002"
    assert last == f"moe train: the weights are not finite after the update of step 3; newest checkpoint: {newest}"
    assert [p.name for p in (run / "checkpoints").glob("step_*")] == ["step_000002"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000002"


def test_a_checkpoint_of_nan_weights_is_never_written(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ckpt.save_checkpoint(tmp_path, 1, model, opt, {"step": 1}, keep=1)
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    with pytest.raises(ckpt.NonFiniteError, match="not finite after step 2"):
        ckpt.save_checkpoint(tmp_path, 2, model, opt, {"step": 2}, keep=1)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]
    assert (root / "latest").read_text().strip() == "step_000001"


# -- 2, 4. damaged checkpoints -------------------------------------------------------------------


def test_corrupt_tensor_data_is_detected_and_resume_falls_back(trained, tmp_path):
    run = _copy(trained, tmp_path)
    _flip(run / "checkpoints" / "step_000004" / "__0_0.distcp")
    proc = moe("train", "--out", run, "--resume")
    err = proc.stdout + proc.stderr
    assert "warning: checkpoint step_000004 skipped: __0_0.distcp does not match its checksum" in err, err
    assert "at step 2" in err
    assert [r["step"] for r in _metrics(run)] == list(range(7))
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000006"


@pytest.mark.parametrize(
    "damage",
    ["truncated", "zeroed", "garbled", "no_metadata", "no_rng", "no_manifest", "manifest_garbled", "folder_removed",
     "latest_empty", "latest_names_nothing"],
)  # fmt: skip
def test_each_kind_of_damage_is_named_and_the_older_checkpoint_chosen(trained, tmp_path, damage):
    run = _copy(trained, tmp_path)
    root = run / "checkpoints"
    step4 = root / "step_000004"
    data_file = step4 / "__0_0.distcp"
    if damage == "truncated":
        data_file.write_bytes(data_file.read_bytes()[:1000])
    elif damage == "zeroed":
        data_file.write_bytes(bytes(data_file.stat().st_size))
    elif damage == "garbled":
        _flip(data_file, n=4096)
    elif damage == "no_metadata":
        (step4 / ".metadata").unlink()
    elif damage == "no_rng":
        (step4 / "rng_rank0.pt").unlink()
    elif damage == "no_manifest":
        (step4 / MANIFEST).unlink()
    elif damage == "manifest_garbled":
        (step4 / MANIFEST).write_text("{not json")
    elif damage == "folder_removed":
        shutil.rmtree(step4)
    elif damage == "latest_empty":
        (root / "latest").write_text("")
    else:
        (root / "latest").write_text("step_000010\n")
    path, notes = ckpt.choose_checkpoint(run)
    assert path == root / ("step_000004" if damage.startswith("latest") else "step_000002")
    expected = {
        "truncated": "__0_0.distcp has 1000 bytes",
        "zeroed": "__0_0.distcp does not match its checksum",
        "garbled": "__0_0.distcp does not match its checksum",
        "no_metadata": ".metadata is missing",
        "no_rng": "rng_rank0.pt is missing",
        "no_manifest": "no manifest.json",
        "manifest_garbled": "manifest.json is damaged",
        "folder_removed": "checkpoints/latest names step_000004, which does not exist",
        "latest_empty": "checkpoints/latest is empty",
        "latest_names_nothing": "checkpoints/latest names step_000010, which does not exist",
    }[damage]
    assert len(notes) == 1 and expected in notes[0], notes


def test_many_faults_at_once_resume_from_what_is_left(trained, tmp_path):
    """latest removed, step 4 missing its .metadata, config.json and the last metrics line torn,
    loss.png unwritable: resume warns about each, continues from step 2, and the run reads as one."""
    run = _copy(trained, tmp_path)
    (run / "checkpoints" / "latest").unlink()
    (run / "checkpoints" / "step_000004" / ".metadata").unlink()
    config = (run / "config.json").read_text()
    (run / "config.json").write_text(config[: len(config) // 2])
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "loss": 3.')
    (run / "loss.png").unlink()
    (run / "loss.png").mkdir()  # the plot cannot be put in place
    (run / "loss.png" / "keep").write_text("")
    proc = moe("train", "--out", run, "--resume", "--eval-every", 1)
    err = proc.stderr
    assert "config.json is damaged" in err and "using the copy in" in err, err
    assert "checkpoint step_000004 skipped: .metadata is missing" in err
    assert err.count("the plots in") == 1 and "training goes on" in err and not list(run.glob("*.tmp.png"))
    assert [r["step"] for r in _metrics(run)] == list(range(7))
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 6
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000006"


def test_no_checkpoint_left_is_one_line_exit_2_for_train_generate_export(trained, tmp_path, capsys):
    run = _copy(trained, tmp_path)
    for folder in (run / "checkpoints").glob("step_*"):
        _flip(folder / "__0_0.distcp")
    proc = moe("train", "--out", run, "--resume", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert _last_line(proc.stderr).startswith("moe train: error: --resume: ")
    assert "has no usable checkpoint (step_000004: __0_0.distcp does not match" in proc.stderr
    for command in (["generate", "--run", run], ["export", "--run", run, tmp_path / "hf"]):
        assert cli.main([str(a) for a in command]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert "has no usable checkpoint" in lines[-1] and lines[-1].startswith(f"moe {command[0]}: error: ")
        assert all(line.startswith("warning: checkpoint step_") for line in lines[:-1])


def test_latest_removed_is_not_no_checkpoint_and_generate_falls_back(trained, tmp_path):
    run = _copy(trained, tmp_path)
    (run / "checkpoints" / "latest").unlink()
    _flip(run / "checkpoints" / "step_000004" / "__0_0.distcp")
    proc = moe("generate", "--run", run, "--max-new-tokens", 2)
    assert "checkpoint step_000004 skipped" in proc.stderr and "tokens/s" in proc.stderr
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    (empty / "config.json").write_text("{}")
    with pytest.raises(cli.UsageError, match="has no checkpoint yet"):
        cli._run_config(empty, "--resume")


def test_a_checkpoint_pruned_while_read_passes_to_the_next(trained, tmp_path, monkeypatch):
    run = _copy(trained, tmp_path)
    real = gen.load_model_weights
    seen = []

    def pruned_first(path, model):
        seen.append(path.name)
        if len(seen) == 1:  # a run still training removes it while it is read
            shutil.rmtree(path)
        real(path, model)

    monkeypatch.setattr(gen, "load_model_weights", pruned_first)
    model, _ = gen.load_run_model(run)
    assert seen == ["step_000004", "step_000002"] and all(bool(p.isfinite().all()) for p in model.parameters())


# -- 3. a no-op resume keeps its checkpoint ------------------------------------------------------


def test_noop_resume_leaves_the_checkpoint_untouched(trained, tmp_path):
    run = _copy(trained, tmp_path)
    folder = run / "checkpoints" / "step_000004"
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.iterdir()}
    moe("train", "--out", run, "--resume", "--stop-at", 4)
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.iterdir()} == before
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000004"


def test_rewriting_a_step_never_deletes_it_before_its_successor_is_complete(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ckpt.save_checkpoint(tmp_path, 2, model, opt, {"step": 2}, keep=2)

    def killed(state, checkpoint_id):
        raise KeyboardInterrupt("kill -9")

    monkeypatch.setattr(ckpt.dcp, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(tmp_path, 2, model, opt, {"step": 2}, keep=2)
    monkeypatch.undo()
    assert ckpt.choose_checkpoint(tmp_path) == (tmp_path / "checkpoints" / "step_000002", [])
    ckpt.save_checkpoint(tmp_path, 2, model, opt, {"step": 2}, keep=2)  # the swap: written, then replaced
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000002"]


def test_pruning_after_a_fallback_keeps_the_new_checkpoint(tmp_path):
    """Resumed from step 2 past a damaged step 4, the run's checkpoint of step 3 with --keep 1
    is kept (the damaged newer one is not counted among the newest) and chosen next time."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for step in (2, 4):
        ckpt.save_checkpoint(tmp_path, step, model, opt, {"step": step}, keep=3)
    root = tmp_path / "checkpoints"
    _flip(root / "step_000004" / "__0_0.distcp", n=16)
    ckpt.save_checkpoint(tmp_path, 3, model, opt, {"step": 3}, keep=1)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000003", "step_000004"]
    assert ckpt.choose_checkpoint(tmp_path)[0] == root / "step_000003"


# -- 5. full disk, read-only folder --------------------------------------------------------------


@pytest.fixture
def mounted(tmp_path):
    """A folder under which a test mounts a filesystem (skipped where mounting is not allowed)."""
    mounts = []

    def mount(*args):
        where = tmp_path / f"mnt{len(mounts)}"
        where.mkdir()
        proc = subprocess.run(["mount", *map(str, args), where], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"this environment cannot mount ({proc.stderr.strip()}): the in-process tests cover it")
        mounts.append(where)
        return where

    yield mount
    for where in reversed(mounts):
        subprocess.run(["umount", "-l", where], check=False)


def test_a_full_disk_ends_with_one_line_and_no_partial_checkpoint(data, mounted):
    disk = mounted("-t", "tmpfs", "-o", "size=8m", "tmpfs")
    (disk / "filler").write_bytes(bytes(6 << 20))  # ~2 MB left: the run starts, its 4.7 MB checkpoint does not fit
    run = disk / "run"
    proc = moe("train", *TINY, "--data", data, "--steps", 2, "--eval-every", 100, "--out", run, check=False)
    assert proc.returncode == 1, proc.stderr
    last = _last_line(proc.stderr)
    assert last.startswith(f"moe train: no space left on tmpfs (mounted at {disk}) writing {run}/checkpoints/")
    assert " bytes short (" in last and "Traceback" not in proc.stderr
    assert not list((run / "checkpoints").glob(".tmp-*"))


def test_a_full_disk_in_process(tmp_path, data, monkeypatch, capsys):
    def full(state, checkpoint_id):
        (tmp_path / "run" / "checkpoints" / ".tmp-step_000002").mkdir(parents=True)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.dcp, "save", full)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = ["train", *map(str, TINY), "--data", str(data), "--steps", "2", "--eval-every", "100"]
    assert cli.main([*args, "--out", str(tmp_path / "run")]) == 1
    last = _last_line(capsys.readouterr().err)
    assert last.startswith("moe train: no space left on ") and ".tmp-step_000002" in last, last
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))


def test_a_read_only_out_exits_2_before_any_work(mounted, tmp_path, data):
    source = tmp_path / "src"
    source.mkdir()
    ro = mounted("--bind", source)
    subprocess.run(["mount", "-o", "remount,bind,ro", ro], check=True)
    proc = moe("train", *TINY, "--data", data, "--steps", 2, "--out", ro / "run", check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"moe train: error: --out {ro / 'run'}: cannot write there (Read-only file system)"
    ]


def test_an_unwritable_out_in_process(tmp_path, monkeypatch):
    def refuses(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr("tempfile.TemporaryFile", refuses)
    with pytest.raises(cli.UsageError, match="cannot write there .Read-only file system"):
        cli._check_writable(tmp_path / "run")
