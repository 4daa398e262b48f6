"""`moe train` under parallel layouts (subprocesses through ``--nproc``, torchrun's agent):
the same seed and global batch give the one-process losses and expert loads, a checkpoint
written under one layout resumes under another, and Ctrl-C stops every rank with a checkpoint.

Tolerances (fp32 on CPU): losses rtol 1e-5 (the layouts differ from one process only by the
order of their reductions); the gradient norm rtol 1e-3 (Adam with eps 1e-8 amplifies the
rounding of near-zero gradient entries from the second step on; the first step's norm agrees to
~1e-5); the per-layer balance stats (from integer counts summed over the ranks) rtol 1e-9:
the same tokens go to the same experts, and a rounding difference in a router score that
flipped one choice would show.

The runs have no load-balancing loss (``--aux-loss-coef 0``): it is not linear in the tokens, so a
data-parallel rank's aux loss over its own rows, averaged over the ranks, is not the one over the
whole batch (the z-loss, a mean over tokens, is). BASE balances over the ep group (``global_base``)
as one process balances over the batch.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from moe.train.manifest import verify

from .run import ROOT, TINY, env, moe

LOSS = dict(rel=1e-5)
NORM = dict(rel=1e-3)
LOADS = dict(rel=1e-9, abs=1e-12)
# top-k without the aux loss routes each token on its own: data-parallel ranks, micro-batches
# and pipeline stages route the one-process batch's tokens as one process does. These runs read
# short documents (`docs`) with document-level masking, so each layout also carries the masks
# (to every pipeline stage, in each micro-batch's rows).
TOPK = [*TINY, "--steps", 4, "--eval-every", 2, "--checkpoint-every", 10, "--router", "topk", "--aux-loss-coef", 0,
        "--doc-mask"]  # fmt: skip


@pytest.fixture(scope="module")
def docs(data, tmp_path_factory):
    """The lines of the `data` corpus as the documents of a .jsonl file: nearly every window of
    the tiny runs holds an end-of-text token, so their masks are not the causal one."""
    lines = [line for f in sorted(data.iterdir()) for line in f.read_text().splitlines() if line.strip()]
    path = tmp_path_factory.mktemp("docs") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return path


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
        if "moe" in e:  # the whole global batch's loads, not rank 0's share
            assert sorted(r["moe"]) == sorted(e["moe"]) != [], (what, r["step"])
            for layer, stats in e["moe"].items():
                got = r["moe"][layer]
                for key in ("max_load", "cv", "dropped", "load", "preferred"):
                    if key in stats or key in got:  # preferred: BASE routers only
                        assert got[key] == pytest.approx(stats[key], **LOADS), (what, r["step"], layer, key)


@pytest.fixture(scope="module")
def topk_one(tmp_path_factory, docs):
    """The one-process metrics of the `TOPK` run."""
    run = tmp_path_factory.mktemp("topk") / "one"
    moe("train", *TOPK, "--data", docs, "--out", run)
    return _metrics(run)


def test_ep2_then_tp2_then_one_process_give_the_one_process_losses(tmp_path, data):
    """One run through three layouts: dp_shard=2 x ep=2 (the exchange in 2 overlapped chunks)
    for steps 1-2, resumed under tp=2 x dp_shard=1 for step 3, then in one process for step 4;
    every step's loss equals the uninterrupted one-process run's."""
    common = [*TINY, "--data", data, "--steps", 4, "--eval-every", 2, "--checkpoint-every", 10, "--aux-loss-coef", 0]
    one, run = tmp_path / "one", tmp_path / "run"
    moe("train", *common, "--out", one)
    expect = _metrics(one)
    moe("train", *common, "--out", run, "--nproc", 2, "--ep", 2, "--ep-chunks", 2, "--stop-at", 2)  # dp_shard=2 x ep=2
    _same(_metrics(run), expect, "ep=2")
    assert json.loads((run / "config.json").read_text())["moe_dispatch"] == ["ChunkedDispatcher"]
    assert [r["step"] for r in _metrics(run)] == [0, 1, 2]
    saved = run / "checkpoints" / "step_000002"  # the manifest covers both ranks' files
    listed = json.loads((saved / "manifest.json").read_text())["files"]
    ranks = ["__0_0.distcp", "__1_0.distcp", "config.json", "rng_rank0.pt", "rng_rank1.pt"]
    assert sorted(listed) == [".metadata", *ranks]
    assert verify(saved) is None
    proc = moe("train", "--out", run, "--resume", "--nproc", 2, "--tp", 2, "--stop-at", 3)
    assert "at step 2" in proc.stdout + proc.stderr
    _same(_metrics(run), expect, "ep=2 -> tp=2")
    assert [r["step"] for r in _metrics(run)] == [0, 1, 2, 3]
    proc = moe("train", "--out", run, "--resume", "--nproc", 1)  # written by tp=2, read by one process
    assert "at step 3" in proc.stdout + proc.stderr
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    _same(rows, expect, "ep=2 -> tp=2 -> one process")


def test_base_balance_rank_under_ep2_is_dp_shard2_without_ep(tmp_path, data):
    """--base-balance rank: each ep rank balances its own tokens, as each data-parallel rank does
    without ep, so ep=2 gives the dp_shard=2 run's losses and loads (and not the ep=2 group's)."""
    common = [*TINY, "--data", data, "--steps", 2, "--eval-every", 2, "--aux-loss-coef", 0, "--nproc", 2]
    per_rank, dp = tmp_path / "rank", tmp_path / "dp"
    moe("train", *common, "--out", per_rank, "--ep", 2, "--base-balance", "rank")
    moe("train", *common, "--out", dp)
    rows = _metrics(per_rank)
    _same(rows, _metrics(dp), "ep=2 --base-balance rank vs dp_shard=2")
    assert all("preferred" in stats for stats in rows[-1]["moe"].values())
    assert json.loads((per_rank / "config.json").read_text())["train"]["base_balance"] == "rank"


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


def test_pp2_gives_the_one_process_losses_and_resumes_in_one_process(tmp_path, docs, topk_one):
    """Interleaved 1F1B (two stages per rank, so a rank's StageView joins two stage modules)
    with two micro-batches: the losses, the global gradient norm over both stages and the loads
    (layer 3 lives on the second rank) equal one process; the checkpoint, keyed by the whole
    model's names, resumes in one process."""
    import torch.distributed.checkpoint as dcp

    from moe.models.llama import Llama
    from moe.train.config import model_config_from_dict

    run = tmp_path / "pp2"
    layout = ["--nproc", 2, "--pp", 2, "--pp-schedule", "interleaved", "--micro-batches", 2]
    moe("train", *TOPK, "--data", docs, "--out", run, *layout, "--stop-at", 2)
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    _same(rows, topk_one, "pp=2")

    saved = dcp.FileSystemReader(str(run / "checkpoints" / "step_000002")).read_metadata().state_dict_metadata
    model = Llama(model_config_from_dict(json.loads((run / "config.json").read_text())["model"]))
    names = set(model.state_dict())
    assert {k.removeprefix("model.") for k in saved if k.startswith("model.")} == names
    assert {k.removeprefix("optim.state.").rsplit(".", 1)[0] for k in saved if k.startswith("optim.state.")} == {
        n for n, _ in model.named_parameters()
    }

    proc = moe("train", "--out", run, "--resume", "--nproc", 1)  # a new layout: one process, no stages
    assert "at step 2" in proc.stdout + proc.stderr
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    _same(rows, topk_one, "pp=2 -> pp=1")


def test_dualpipev_gives_the_one_process_losses(tmp_path, docs, topk_one):
    """DualPipeV through the command (stages p and 3 - p on rank p, 2 x pp micro-batches by
    default, its paired steps): the losses, validation losses, gradient norm and loads of one
    process."""
    run = tmp_path / "dualpipev"
    moe("train", *TOPK, "--data", docs, "--out", run, "--nproc", 2, "--pp", 2, "--pp-schedule", "dualpipev",
        "--stop-at", 2)  # fmt: skip
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2] and "val_loss" in rows[-1]
    _same(rows, topk_one, "pp=2 dualpipev")
    saved = json.loads((run / "config.json").read_text())["train"]
    assert (saved["pp_schedule"], saved["micro_batches"]) == ("dualpipev", None)


@pytest.mark.parametrize(
    "layout",
    [["--dp-replicate", 2], ["--tp", 2, "--etp"], ["--grad-accum", 2],
     ["--ep", 2, "--dispatch", "hierarchical", "--ranks-per-node", 1]],
    ids=["dp_replicate2", "tp2_etp", "dp_shard2_grad_accum2", "ep2_two_nodes"],
)  # fmt: skip
def test_dp_replicate_and_etp_give_the_one_process_losses_and_loads(tmp_path, docs, topk_one, layout):
    run = tmp_path / "run"
    moe("train", *TOPK, "--data", docs, "--out", run, "--nproc", 2, *layout, "--stop-at", 2)
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    _same(rows, topk_one, " ".join(map(str, layout)))
    if "--dispatch" in layout:  # the two-level dispatcher ran (config.json says which)
        assert json.loads((run / "config.json").read_text())["moe_dispatch"] == ["HierarchicalDispatcher"]


def test_router_groups_on_nodes_give_the_one_process_losses(tmp_path, docs, topk_one):
    """--router-groups 2 --topk-groups 1 on ep=2 as two nodes of one rank: one group per node, so
    every token's experts lie on one node; the two-level run gives the one-process losses of the
    same model, which differ from the unlimited router's."""
    grouped = [*TOPK, "--data", docs, "--router-groups", 2, "--topk-groups", 1]
    one, two = tmp_path / "one", tmp_path / "two"
    moe("train", *grouped, "--out", one, "--stop-at", 2)
    moe("train", *grouped, "--out", two, "--nproc", 2, "--ep", 2, "--dispatch", "hierarchical", "--ranks-per-node", 1,
        "--stop-at", 2)  # fmt: skip
    _same(_metrics(two), _metrics(one), "grouped ep2 two nodes")
    options = json.loads((two / "config.json").read_text())["model"]["moe"]["router_options"]
    assert options["n_groups"] == 2 and options["topk_groups"] == 1, options
    assert _metrics(one)[1]["loss"] != pytest.approx(topk_one[1]["loss"], **LOSS)  # the limit changes the routing


def _wait_for_steps(proc, metrics, n):
    for _ in range(1200):  # until n steps have finished (no time is asserted)
        if proc.poll() is not None or (metrics.exists() and metrics.read_text().count("\n") >= n + 1):
            return
        time.sleep(0.25)


def test_ctrl_c_under_nproc2_checkpoints_every_rank_and_resumes(tmp_path, data):
    """Ctrl-C as a terminal sends it (SIGINT to the launcher's process group) during an ep=2 run:
    every rank finishes its step, the checkpoint is complete, the exit is 130; the ep=2 loads
    until then, and the run resumed in one process, equal an uninterrupted one-process run."""
    common = [*TINY, "--data", data, "--steps", 1000, "--eval-every", 1000, "--checkpoint-every", 1000,
              "--router", "topk", "--aux-loss-coef", 0]  # fmt: skip
    run, ref = tmp_path / "run", tmp_path / "ref"
    cmd = [sys.executable, "-m", "moe", "train", *map(str, common), "--out", str(run), "--nproc", "2", "--ep", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=ROOT,
                            start_new_session=True)  # fmt: skip
    _wait_for_steps(proc, run / "metrics.jsonl", 2)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "SIGINT: stopped after step" in out and "resume with: moe train --out" in out, out + err
    steps = [r["step"] for r in _metrics(run)]
    k = steps[-1]
    assert steps == list(range(k + 1)) and 2 <= k < 1000
    ckpt = run / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == f"step_{k:06d}"  # nothing since the last step is lost
    assert sorted(p.name for p in (ckpt / f"step_{k:06d}").glob("rng_rank*.pt")) == ["rng_rank0.pt", "rng_rank1.pt"]
    assert not list(ckpt.glob(".tmp-*"))

    moe("train", "--out", run, "--resume", "--nproc", 1, "--stop-at", k + 2)  # the layout: one process
    moe("train", *common, "--out", ref, "--stop-at", k + 2)
    rows = _metrics(run)
    assert [r["step"] for r in rows] == list(range(k + 3))
    _same(rows, _metrics(ref), "ep=2, Ctrl-C, resumed in one process")


@pytest.mark.slow
def test_dp_shard2_resumes_under_tp2(tmp_path, docs, topk_one):
    run = tmp_path / "run"
    moe("train", *TOPK, "--data", docs, "--out", run, "--nproc", 2, "--stop-at", 2)  # dp_shard=2
    moe("train", "--out", run, "--resume", "--nproc", 2, "--tp", 2, "--dp-shard", 1)
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    _same(rows, topk_one, "dp_shard=2 -> tp=2")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--ep", 2], ["--tp", 2]], ids=["pp2_ep2", "pp2_tp2"])
def test_pp2_with_ep2_or_tp2_on_four_processes(tmp_path, docs, topk_one, layout):
    run = tmp_path / "run"
    moe("train", *TOPK, "--data", docs, "--out", run, "--nproc", 4, "--pp", 2, *layout, "--stop-at", 2)
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    _same(rows, topk_one, "pp=2 " + " ".join(map(str, layout)))


def test_activation_checkpointing_and_bf16_through_the_command(tmp_path, docs, topk_one):
    """--ac re-runs the blocks in backward: the same numbers as without (one process, and through
    parallelize_llama under --nproc 2); --dtype bf16 autocasts on CPU too: near fp32, not equal."""
    for extra in (["--ac", "full"], ["--nproc", 2, "--ac", "selective"]):
        run = tmp_path / "-".join(map(str, extra))
        moe("train", *TOPK, "--data", docs, "--out", run, "--stop-at", 2, *extra)
        _same(_metrics(run), topk_one, " ".join(map(str, extra)))
    run = tmp_path / "bf16"
    moe("train", *TOPK, "--data", docs, "--out", run, "--stop-at", 1, "--dtype", "bf16")
    got, ref = _metrics(run)[1]["loss"], topk_one[1]["loss"]
    assert got != ref and got == pytest.approx(ref, rel=2e-2)


@pytest.mark.slow
def test_pp2_tp2_etp_without_reshard_gives_the_one_process_losses(tmp_path, docs, topk_one):
    """The kind of layout moe plan picks for the 1.2T preset on 1024 H200: expert-tensor
    parallelism inside pipeline stages, FSDP2 keeping the blocks gathered (reshard=0)."""
    run = tmp_path / "run"
    moe("train", *TOPK, "--data", docs, "--out", run, "--layout", "tp=2,pp=2,etp=1,reshard=0", "--stop-at", 2)
    _same(_metrics(run), topk_one, "tp=2,pp=2,etp=1,reshard=0")
    saved = json.loads((run / "config.json").read_text())["train"]
    assert (saved["tp"], saved["pp"], saved["etp"], saved["reshard"]) == (2, 2, True, 0)
    assert json.loads((run / "config.json").read_text())["expert_shard"] == [4, 64, 48]  # F=96 split over tp


def test_reshard_0_gives_the_one_process_losses(tmp_path, docs, topk_one):
    run = tmp_path / "run"
    moe("train", *TOPK, "--data", docs, "--out", run, "--nproc", 2, "--reshard", 0, "--stop-at", 2)
    _same(_metrics(run), topk_one, "--nproc 2 --reshard 0")


@pytest.mark.slow  # inductor compiles each block for about 40 s on CPU
@pytest.mark.parametrize("layout", [[], ["--nproc", 2, "--ep", 2]], ids=["one_process", "nproc2_ep2"])
def test_compile_gives_the_eager_losses(tmp_path, docs, topk_one, layout):
    """--compile: the blocks compiled by inductor (the MoE layer whole in one process; under
    ep its exchange stays eager, parallelize_llama compiling the rest of each block) train as
    eager does, with the z-loss alone (--aux-loss-coef 0 once made the backward raise)."""
    run = tmp_path / "compiled"
    moe("train", *TOPK, "--data", docs, "--out", run, "--stop-at", 2, "--compile", *layout, timeout=900)
    _same(_metrics(run), topk_one, " ".join(map(str, ["--compile", *layout])))
    assert json.loads((run / "config.json").read_text())["train"]["compile"] is True


@pytest.mark.slow
def test_ep4_as_two_nodes_of_two_gives_the_one_process_losses(tmp_path, docs, topk_one):
    run = tmp_path / "run"
    moe("train", *TOPK, "--data", docs, "--out", run, "--nproc", 4, "--ep", 4, "--dispatch", "hierarchical",
        "--ranks-per-node", 2, "--stop-at", 2)  # fmt: skip
    _same(_metrics(run), topk_one, "ep4 as 2 x 2")
    assert json.loads((run / "config.json").read_text())["moe_dispatch"] == ["HierarchicalDispatcher"]
