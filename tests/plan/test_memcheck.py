"""The planner's whole-step memory against PyTorch's own memory tracker: one training step of
the real model, laid out by the real `parallelize_llama` / `pipeline_llama` on the fake process
group under FakeTensorMode (`moe.plan.memcheck`), part by part. Every part must be within 10%
of the tracker, or be one the case names as differing (docs/scale.md says why; those parts
summed must not fall more than 10% under the tracker's), and the planner's total must never be
below the tracker's peak: no layout the planner says fits can exceed the memory by its count.

MoE layers route by BASE's static path in the tracked step (`moe.plan.memcheck.tracked_config`):
the balanced loads the planner assumes, known on the host, so nothing is read from a fake tensor.

The default suite runs four cases at real widths; ``-m slow`` runs the table of docs/scale.md."""

from __future__ import annotations

import json

import pytest

from moe.plan.cli import main
from moe.plan.memcheck import CASES, PARTS, WORST, Case, compare


def check(case: Case) -> dict:
    cfg, lay, shape, rank = case.setup()
    got = compare(cfg, lay, shape, rank, routing=case.routing, **dict(case.options))
    for part in PARTS:
        want, have = got[part]
        if part not in case.differs:
            assert abs(have - want) <= 0.1 * max(want, have), (case.name(), part, got)
    if case.differs:
        want, have = (sum(got[p][i] for p in case.differs) for i in (0, 1))
        assert want >= 0.9 * have, (case.name(), case.differs, got)
    assert got["total"][0] >= got["total"][1], (case.name(), "the planner is below the tracker's peak", got)
    return got


def test_llama2_70b_tp_fsdp_step_against_tracker():
    """llama2-70b's per-rank shapes in a 1024-rank world (two of its layers): the fp32 logits
    and log-softmax, the gathered root module and the reduce-scatter copy are all counted."""
    got = check(Case("llama2-70b", "tp=8,dp_shard=128", n_layers=2))
    want, have = got["optimizer"]
    assert 0 <= have - want < 1024  # AdamW's m and v exactly, and its step counters (4 bytes a parameter)


def test_pipeline_middle_stage_against_tracker():
    """A middle pipeline stage: no embedding, no logits, gathered parameters and gradients kept
    through the backward and reduced after it, as torch.distributed.pipelining does. FSDP2 keeps
    the gradients in fp32 (its reduce dtype) and the stage peaks at its first reduce-scatter, one
    unit's fp32 input where its bf16 parameters were: the planner's figure to the MiB. The
    activations of this short stage (two layers of 1,024 tokens) are below the backward's own
    gradients at their peak (docs/scale.md), so the two parts are compared summed too."""
    pipe = ("fsdp_buffers", "activations")
    got = check(Case("llama2-7b", "tp=2,pp=4,dp_shard=2", pp_rank=2, n_layers=8, seq_len=1024, differs=pipe))
    want, have = got["fsdp_buffers"]
    assert 0 <= want - have < 1 << 20


def test_mixtral_expert_parallel_step_against_tracker_and_its_worst_case_loads():
    """Mixtral's per-rank shapes in a 1024-rank world, one expert per ep rank held by 64 ranks:
    FSDP2 shards the experts' D (not the one-row expert dim, which would pad every rank to a
    whole expert and gather 64 of them), and the routed rows' activations are the planner's.
    Then every token of the ep group routed to this rank's experts (dropless routing's worst
    case): its receive buffers and expert activations are ep x T x K rows, beyond the balanced
    loads the planner assumes (docs/scale.md says so); the other parts are unchanged.
    The FSDP part peaks at the experts' reduce-scatter copy-in, the planner's moment: the root and
    two outer units gathered, the output projection's gradient, the experts' bf16 gradient as
    D-sharded copies with one original, and its fp32 reduce-scatter input
    (`moe.plan.memory.fsdp_backward_peak`); the planner pads the output's gradient as FSDP2 pads
    its parameter (16,384 vocabulary rows for 16,000: 3 MiB)."""
    got = check(Case(WORST.model, WORST.layout, n_layers=WORST.n_layers))
    assert got["params"][1] < 32 << 20  # 22 MiB a rank; 1.4 GiB on rank 0 with the expert dim sharded
    want, have = got["fsdp_buffers"]
    assert 0 <= want - have < 4 << 20
    want, have = got["activations"]
    assert abs(have - want) <= 0.05 * want
    cfg, lay, shape, rank = WORST.setup()
    worst = compare(cfg, lay, shape, rank, routing="worst")
    assert worst["activations"][1] > 3 * have
    assert worst["total"][1] > worst["total"][0]  # over the plan: why BASE or a capacity factor bound it
    for part in ("params", "grads", "optimizer"):
        assert worst[part] == got[part]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.name() for c in CASES])
def test_table_case_against_tracker(case):
    check(case)


def test_cli_check_memory(capsys, tmp_path):
    cfg = tmp_path / "dense.json"
    cfg.write_text(json.dumps(dict(dim=256, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=512, ffn_hidden_dim=704)))
    common = ["--model", str(cfg), "--gpus", "4", "--seq-len", "128", "--global-batch-tokens", "1024"]
    assert main([*common, "--layout", "tp=2,dp_shard=2", "--check-memory"]) == 0
    out = capsys.readouterr().out
    assert "tracked step of rank 0" in out and "within the" in out
    rows = {line.split()[0]: line.split()[1:3] for line in out.splitlines() if line.startswith("  ") and "(" in line}
    assert set(PARTS) | {"total"} <= set(rows) and float(rows["total"][1]) > 0
    assert main([*common, "--search", "--check-memory"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--check-memory" in err[0] and "--layout" in err[0]
    moe = ["--model", "tiny", *common[2:], "--check-memory"]
    assert main([*moe, "--layout", "ep=2,dp_shard=4"]) == 0
    out = capsys.readouterr().out
    assert "tracked step of rank 0" in out and "within the" in out
    assert main([*moe, "--layout", "dp_shard=4"]) == 0  # ep=1: the experts in the block's unit
    out = capsys.readouterr().out
    assert "tracked step of rank 0" in out and "within the" in out
    assert main([*moe, "--layout", "ep=2,dp_shard=4,dispatch=hierarchical"]) == 2  # refused in one line,
    err = capsys.readouterr().err.strip().splitlines()  # not a traceback from the child
    assert len(err) == 1 and "flat expert-parallel dispatch only" in err[0]
