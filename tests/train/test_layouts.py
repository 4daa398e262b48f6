"""`moe train` under parallel layouts (subprocesses through ``--nproc``, torchrun's agent):
the same seed and global batch give the one-process losses, and a checkpoint written under one
layout resumes under another.

Tolerances (fp32 on CPU): losses rtol 1e-5 (the layouts differ from one process only by the
order of their reductions); the gradient norm rtol 1e-3 (Adam with eps 1e-8 amplifies the
rounding of near-zero gradient entries from the second step on; the first step's norm agrees to ~1e-5).

The runs have no load-balancing loss (``--aux-loss-coef 0``): it is not linear in the tokens, so a
data-parallel rank's aux loss over its own rows, averaged over the ranks, is not the one over the
whole batch (the z-loss, a mean over tokens, is). BASE balances over the ep group (``global_base``)
as one process balances over the batch.
"""

import json
import subprocess
import sys

import pytest

from .run import ROOT, TINY, corpus, env, moe

LOSS = dict(rel=1e-5)
NORM = dict(rel=1e-3)


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _same(rows, expect, what):
    by_step = {r["step"]: r for r in expect}
    assert rows, what
    for r in rows:
        e = by_step[r["step"]]
        for key in ("loss", "val_loss"):
            if key in r or key in e:
                assert r[key] == pytest.approx(e[key], **LOSS), (what, r["step"], key)
        if "grad_norm" in e:
            assert r["grad_norm"] == pytest.approx(e["grad_norm"], **NORM), (what, r["step"])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return corpus(tmp_path_factory.mktemp("corpus"))


def test_ep2_and_tp2_give_the_one_process_losses_and_ep2_resumes_in_one_process(tmp_path, data):
    common = [*TINY, "--data", data, "--steps", 4, "--eval-every", 2, "--checkpoint-every", 10, "--aux-loss-coef", 0]
    one, ep2, tp2 = tmp_path / "one", tmp_path / "ep2", tmp_path / "tp2"
    moe("train", *common, "--out", one)
    expect = _metrics(one)
    moe("train", *common, "--out", ep2, "--nproc", 2, "--ep", 2, "--stop-at", 2)  # dp_shard=2 x ep=2
    _same(_metrics(ep2), expect, "ep=2")
    assert [r["step"] for r in _metrics(ep2)] == [0, 1, 2]
    moe("train", *common, "--out", tp2, "--nproc", 2, "--tp", 2, "--stop-at", 2)
    _same(_metrics(tp2), expect, "tp=2")
    proc = moe("train", "--out", ep2, "--resume")  # written by dp_shard=2 x ep=2, read by one process
    assert "at step 2" in proc.stdout + proc.stderr
    rows = _metrics(ep2)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    _same(rows, expect, "ep=2 -> ep=1")


def test_a_bad_layout_under_torchrun_exits_2_on_every_rank(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "moe", "train", "--tp", "3", "--out", str(tmp_path / "run")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT, timeout=120)
    assert proc.returncode != 0
    line = "moe train: error: layout tp=3 x pp=1 x dp_replicate=1 x dp_shard=-1 must multiply to the world size 2"
    # each rank checks alone and exits 2; torchrun may stop the slower one (SIGTERM) before it
    # prints, so the line comes once or twice
    assert proc.stderr.count(line) in (1, 2), proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_dp_shard2_resumes_under_tp2(tmp_path, data):
    # top-k without the aux loss routes each token on its own, so dp ranks equal one process
    common = [*TINY, "--data", data, "--steps", 4, "--eval-every", 2, "--checkpoint-every", 10,
              "--router", "topk", "--aux-loss-coef", 0]  # fmt: skip
    one, run = tmp_path / "one", tmp_path / "run"
    moe("train", *common, "--out", one)
    moe("train", *common, "--out", run, "--nproc", 2, "--stop-at", 2)  # dp_shard=2
    moe("train", "--out", run, "--resume", "--nproc", 2, "--tp", 2, "--dp-shard", 1)
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    _same(rows, _metrics(one), "dp_shard=2 -> tp=2")
