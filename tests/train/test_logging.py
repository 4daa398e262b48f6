"""`moe train --log tensorboard|wandb` and `--profile`: the logged scalars read back with each
tool's own reader equal metrics.jsonl's, and the profiler's trace names the layer's ops. One run
folder: TensorBoard and the profile for steps 1-2, then W&B (offline) on the resume to step 3."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .run import TINY, moe

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")


def _metrics(run):
    return {row["step"]: row for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _expected(row: dict) -> dict[str, float]:
    """metrics.jsonl's numbers under the documented keys: nested ones joined with '/'."""
    out = {k: float(v) for k, v in row.items() if k not in ("step", "moe")}
    for layer, stats in row.get("moe", {}).items():
        for key, value in stats.items():
            if key == "load":
                out.update({f"moe/{layer}/load/{e}": share for e, share in enumerate(value)})
            else:
                out[f"moe/{layer}/{key}"] = value
    return out


def _tensorboard(folder: Path) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    out: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            out.setdefault(event.step, {})[tag] = event.value
    return out


def _wandb_history(run: Path) -> dict[int, dict]:
    """The history records of the offline W&B run, through wandb's own reader of its log."""
    (log,) = run.glob("wandb/offline-run-*/run-*.wandb")
    tool = Path(sys.executable).with_name("wandb")
    lines = subprocess.run([tool, "leet", "inspect", "--json", log], capture_output=True, text=True, check=True)
    out = {}
    for line in lines.stdout.splitlines():
        record = json.loads(line)
        if record.get("type") == "history":
            item = record["history"]["item"]
            out[item["_step"]] = item
    return out


def test_tensorboard_wandb_and_profile(tmp_path, data):
    run = tmp_path / "run"
    common = [*TINY, "--data", data, "--steps", 3, "--eval-every", 2, "--eval-batches", 1]
    first = moe("train", *common, "--out", run, "--stop-at", 2, "--log", "tensorboard", "--profile", 1)
    rows = _metrics(run)
    logged = _tensorboard(run / "tensorboard")
    assert sorted(logged) == [0, 1, 2]
    for step, row in rows.items():
        expect = _expected(row)
        assert set(logged[step]) == set(expect), step  # the same keys as metrics.jsonl
        for key, value in expect.items():
            assert logged[step][key] == pytest.approx(value, rel=1e-6), (step, key)  # stored as fp32
    assert "moe/1/max_load" in logged[1] and "val_loss" in logged[2]

    # --profile 1: step 1 warms up, step 2 is traced; CPU only, so no memory snapshot, said once
    assert sorted(p.name for p in (run / "profile").iterdir()) == ["trace_rank0.json"]
    events = json.loads((run / "profile" / "trace_rank0.json").read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"moe::grouped_mm", "_TorchPermute", "ProfilerStep#1"} <= names
    assert "no CUDA memory snapshot" in first.stderr

    moe("train", "--out", run, "--resume", "--log", "wandb", drop_env=("WANDB_API_KEY", "WANDB_MODE"))
    rows = _metrics(run)
    history = _wandb_history(run)
    assert sorted(history) == [3]  # this job's step, offline (no key): nothing sent
    for key, value in _expected(rows[3]).items():
        assert history[3][key] == pytest.approx(value, rel=1e-12), key
    assert not (run / "profile" / "trace_rank1.json").exists()  # --profile is one job's, not kept
