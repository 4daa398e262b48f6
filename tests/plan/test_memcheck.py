"""The planner's whole-step memory against PyTorch's own memory tracker: one training step of
the real model, laid out by the real `parallelize_llama` / `pipeline_llama` on the fake process
group under FakeTensorMode (`moe.plan.memcheck`), part by part. Every part must be within 10%
of the tracker, or be one the case names as differing (docs/scale.md says why; those parts
summed must not fall more than 10% under the tracker's), and the planner's total must never be
below the tracker's peak: no layout the planner says fits can exceed the memory by its count.

MoE layers route by BASE's static path in the tracked step (`moe.plan.tracked_routing.tracked_config`):
the balanced loads the planner assumes, known on the host, so nothing is read from a fake tensor.
The two-level dispatch is told its splits on the host for the same loads (`_two_level_splits`),
checked here against the real count exchange over gloo.

The default suite runs five cases at real widths; ``-m slow`` runs the table of docs/scale.md."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from moe import MoE, MoEConfig
from moe.parallel import parallelize_moe
from moe.parallel.hierarchical import HierarchicalDispatcher
from moe.plan.cli import main
from moe.plan.memcheck import CASES, PARTS, WORST, Case, compare, measure
from moe.plan.tracked_routing import _tracked_expert_idx, _two_level_splits
from moe.routing import expert_capacities_list

from ..parallel.launch import init, spawn


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


def test_two_level_dispatch_step_against_tracker():
    """The two-level dispatch (two nodes of four ep ranks) measured as the flat one is: its
    splits told on the host for the balanced loads with the most (token, node) pairs, which for
    top-2 over two nodes is every token on both. It keeps for backward what the flat dispatch
    keeps (the received rows of the exchange between nodes are not kept for their gates, nor the
    partial sums for their index_add), so the planner's flat rule holds: the activations are
    within 2% of it (the received rows kept were 6.7% over)."""
    two_nodes = (("ranks_per_node", 4),)
    got = check(Case("mixtral-8x7b", "tp=2,ep=8,dp_shard=512,dispatch=hierarchical", n_layers=2, options=two_nodes))
    want, have = got["activations"]
    assert abs(have - want) <= 0.02 * want


def test_tracked_expert_idx_has_base_loads_and_the_most_pairs():
    """BASE's loads (the extra slots on the lowest experts), and every token whose slots come
    before the extra ones on min(K, N) nodes."""
    for tokens, k, experts, nodes in [(13, 3, 8, 2), (16, 2, 8, 2), (10, 8, 32, 4), (7, 1, 4, 4)]:
        idx = _tracked_expert_idx((tokens, k), experts, nodes, "balanced")
        assert idx.shape == (tokens, k)
        assert torch.bincount(idx.reshape(-1), minlength=experts).tolist() == expert_capacities_list(tokens, experts, k)
        reached = [len(set((row // (experts // nodes)).tolist())) for row in idx]
        whole = tokens * k // experts * experts // k  # the tokens before the extra slots
        assert reached[:whole] == [min(k, nodes)] * whole, (tokens, k, experts, nodes, idx)
    worst = _tracked_expert_idx((5, 2), 8, 2, "worst", first=6)
    assert (worst == 6).all()


def _splits_worker(rank: int, world: int, store: str) -> None:
    """4 ranks as 2 nodes x 2, 8 experts: every rank routes the tracked step's experts, and the
    table the count exchange gives each rank is the one `_two_level_splits` makes on the host."""
    init(rank, world, store)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        for chunks in (1, 2, 3):
            for k, tokens in ((2, 16), (3, 13)):
                torch.manual_seed(0)
                layer = MoE(MoEConfig(dim=8, hidden_dim=12, num_experts=8, top_k=k))
                d = parallelize_moe(layer, mesh, dispatch="hierarchical", ranks_per_node=2, chunks=chunks).dispatcher
                assert isinstance(d, HierarchicalDispatcher) and d.num_nodes == 2
                for routing in ("balanced", "worst"):
                    for victim in range(world):  # the rank whose first expert gets every slot, worst case
                        first = victim * (8 // world)
                        idx = _tracked_expert_idx((tokens, k), 8, d.num_nodes, routing, first)
                        read = []

                        def real(table, _routing, read=read):
                            read.append(table.tolist())
                            return read[-1]

                        d.read_splits = real
                        d.pairs(torch.randn(tokens, 8), SimpleNamespace(expert_idx=idx), torch.rand(tokens, k))
                        told = _two_level_splits(d, (tokens, k), routing, victim)
                        assert told == read[0], (rank, chunks, k, routing, victim, told, read[0])
                        if routing == "balanced":
                            break
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_two_level_splits_told_on_the_host_are_the_count_exchange():
    spawn(_splits_worker, 4)


def test_measure_needs_ranks_per_node_for_the_two_level_dispatch():
    cfg, lay, shape, rank = Case("tiny", "ep=2,dp_shard=4,dispatch=hierarchical", seq_len=128).setup()
    with pytest.raises(ValueError, match="ranks_per_node"):
        measure(cfg, lay, shape, rank)


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
    two_nodes = [*moe, "--gpus-per-node", "1"]  # one ep rank per node: the two-level dispatch over 2 nodes
    for layout in ("ep=2,dp_shard=4,dispatch=hierarchical", "ep=2,dp_shard=4,dispatch=hierarchical,chunks=2"):
        assert main([*two_nodes, "--layout", layout]) == 0
        out = capsys.readouterr().out
        assert "tracked step of rank 0" in out and "within the" in out
