"""The planner's rules and numbers without a process group: shard arithmetic against torch,
memory conservation over the ranks, schedule and FLOP conventions, layout checks, the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from moe.config import MoEConfig
from moe.models.llama import LlamaConfig
from moe.parallel.pipeline import stage_layers as real_stage_layers
from moe.plan.cli import main
from moe.plan.hardware import GPUS, gpu_from_spec
from moe.plan.layout import Layout, parse_layout
from moe.plan.memory import TrainShape, fsdp_backward_peak, live_chunks, memory, peak_memory
from moe.plan.search import check_layout, evaluate
from moe.plan.shards import Unit, chunk, gathered_numel, rank_params, stage_layers, stage_specs, stage_summary
from moe.plan.time import model_flops_per_token, step_time


def test_chunk_is_torch_chunk():
    for n in range(0, 13):
        for k in range(1, 9):
            pieces = [len(p) for p in torch.arange(n).chunk(k)] if n else []
            pieces += [0] * (k - len(pieces))  # torch.chunk returns fewer pieces; FSDP pads them empty
            assert [chunk(n, k, i) for i in range(k)] == pieces, (n, k)


@pytest.mark.parametrize("layers,stages", [(4, 4), (7, 3), (80, 16), (61, 16), (5, 2)])
def test_stage_layers_is_pipeline_llamas(layers, stages):
    real = real_stage_layers([str(i) for i in range(layers)], stages)
    assert [[str(i) for i in r] for r in stage_layers(layers, stages)] == real


@pytest.mark.parametrize(
    "lay,copies",
    [
        (Layout(pp=2, ep=2, dp_shard=4), 1),  # pipeline, FSDP and EP partition every parameter
        (Layout(ep=4, dp_shard=4, dp_replicate=2), 2),  # HSDP: two replicas, the experts sharded over both
        (Layout(pp=3, dp_shard=5), 1),  # uneven FSDP pieces still add up
    ],
)
def test_shards_add_up_to_the_model(lay, copies):
    cfg = LlamaConfig.from_name("tiny", n_layers=6, vocab_size=131)
    total = sum(sum(rank_params(cfg, lay, r).values()) for r in range(lay.world))
    experts = len(cfg.moe_layers) * 3 * cfg.moe.num_experts * cfg.dim * cfg.moe.hidden_dim
    # expert weights are fully sharded over the ranks holding the same experts, dp_replicate
    # included (edp), so only the other parameters have a copy per replica
    assert total == copies * (cfg.num_params() - experts) + experts


def test_tp_replicates_norms_routers_and_the_moe_layer():
    """Under tp without etp the whole MoE layer and the norms are on every tp rank."""
    cfg = LlamaConfig.from_name("tiny")
    lay = Layout(tp=2)
    got = [rank_params(cfg, lay, r) for r in range(2)]
    assert got[0]["layers.1.feed_forward.experts.w1"] == 4 * 64 * 96
    assert got[0]["layers.0.attention.wq.weight"] == 32 * 64  # colwise half
    assert got[1]["layers.0.attention.wo.weight"] == 64 * 32  # rowwise half
    etp = rank_params(cfg, Layout(tp=2, etp=True), 0)
    assert etp["layers.1.feed_forward.experts.w1"] == 4 * 64 * 48
    assert etp["layers.1.feed_forward.router.weight"] == 2 * 64  # FSDP over dp x tp = 2 ranks


def test_memory_components_single_gpu():
    cfg = LlamaConfig.from_name("tiny")
    mem = memory(cfg, Layout(), TrainShape(seq_len=16, global_batch_tokens=64), 0)
    n = cfg.num_params()
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (4 * n, 4 * n, 8 * n)
    assert mem["fsdp_buffers"] == 0 and mem["moe_dispatch"] == 0
    assert mem["logits"] == 16 * cfg.vocab_size * 14  # bf16 + fp32 copy, log-softmax and gradient in fp32
    assert mem["total"] == sum(v for k, v in mem.items() if k != "total")


def test_fsdp_backward_peak_moments():
    """Uniform dense blocks peak as a post-backward begins: the root, the block, its bf16 gradient
    and the block prefetched in bf16, the last reduce-scatter input in fp32. Experts sharded on D
    inside a small outer unit peak at their copy-in: the outer unit twice (around them, and
    prefetched), their bf16 gradient and one original, their fp32 input. A root larger than the
    blocks peaks at its own copy-in (bf16 gradient, fp32 input)."""
    root, b = 50, 100
    assert fsdp_backward_peak((("dense", 4, (Unit(b),)),), root, 2) == 2 * (root + 3 * b) + 4 * b
    outer, ex = 10, Unit(300, d_numel=300, d_max=100)
    moe = (("moe", 2, (Unit(outer), ex)),)
    assert fsdp_backward_peak(moe, root, 2) == 2 * (root + 2 * outer + 300 + 100) + 4 * 300
    assert fsdp_backward_peak((("dense", 4, (Unit(b),)),), 5000, 2) == 5000 * (2 + 4)


def test_moe_block_on_one_ranks_experts_is_one_fsdp_unit():
    """Without expert parallelism (ep=1, no etp) `parallelize_llama` shards an MoE block whole,
    its experts with the attention and router: the backward prefetches the block before with its
    experts, beside the last block's fp32 reduce-scatter input. The tracker measured 13,579 MiB
    of FSDP buffers for two mixtral layers at tp=8, dp_shard=128 (docs/scale.md); with the experts
    counted as a unit of their own the planner said 9,078. Under ep or etp they are their own."""
    cfg = LlamaConfig.from_name("mixtral-8x7b", n_layers=2)
    lay = Layout(tp=8, dp_shard=128)
    ((kind, n, units),) = stage_summary(cfg, lay, 0, lay.coords(0)).units
    assert (kind, n, len(units)) == ("moe", 2, 1)
    fsdp = memory(cfg, lay, TrainShape(seq_len=4096, global_batch_tokens=4096 * 128), 0)["fsdp_buffers"]
    assert 13579 << 20 <= fsdp <= 1.1 * (13579 << 20)
    for other in (Layout(tp=8, etp=True, dp_shard=128), Layout(tp=8, ep=8, dp_shard=128)):
        ((_, _, units),) = stage_summary(cfg, other, 0, other.coords(0)).units
        assert len(units) == 2


def test_gathered_numel_pads_like_fsdp2():
    """FSDP2's all-gather output is k pieces of the first piece's length: 32,000 vocabulary rows
    over 1,024 ranks gather as 32,768."""
    cfg = LlamaConfig.from_name("llama2-7b", n_layers=1)
    lay = Layout(dp_shard=1024)
    emb = next(s for s in stage_specs(cfg, lay, 0) if s.name == "tok_embeddings.weight")
    assert gathered_numel(emb, lay, lay.coords(0)) == 32768 * 4096


def test_recompute_and_schedules_shrink_activations():
    cfg = LlamaConfig.from_name("llama2-70b")
    shape = TrainShape(seq_len=4096, global_batch_tokens=4096 * 64)
    base = Layout(tp=8, pp=4, dp_shard=2)
    act = {}
    for name, lay in {
        "1f1b": base,
        "gpipe": Layout(tp=8, pp=4, dp_shard=2, schedule="gpipe"),
        "recompute": Layout(tp=8, pp=4, dp_shard=2, recompute=True),
    }.items():
        act[name] = memory(cfg, lay, shape, lay.rank(pp=0))["activations"]
    assert act["recompute"] < act["1f1b"] < act["gpipe"]
    assert live_chunks(base, 0, 32) == 4 and live_chunks(base, 3, 32) == 1
    inter = Layout(pp=4, vpp=2, schedule="interleaved_1f1b")
    assert live_chunks(inter, 0, 8) == (2 - 1) * 4 + 2 * 3 + 1


def test_peak_rank_is_the_largest():
    """peak_memory compares only coordinate-0 ranks; no other rank needs more."""
    cfg = LlamaConfig.from_name("tiny", vocab_size=1031)  # equal stages: the last one's logits weigh most
    lay = Layout(tp=2, pp=2, ep=2, dp_shard=6, schedule="gpipe")
    shape = TrainShape(seq_len=64, global_batch_tokens=64 * 24)  # logits outweigh the embedding's gradient
    rank, peak = peak_memory(cfg, lay, shape)
    assert max(memory(cfg, lay, shape, r)["total"] for r in range(lay.world)) == peak["total"]
    assert lay.coords(rank)["pp"] == 1


def test_model_flops_match_nemo_convention():
    """NeMo's published 836 TFLOP/s at 1,880 tokens/s/GPU for Llama 2 70B (seq 4096) imply
    4.447e11 FLOPs per token; the planner's convention gives the same within 0.5%."""
    per_token = model_flops_per_token(LlamaConfig.from_name("llama2-70b"), 4096)
    assert abs(per_token / (836e12 / 1880) - 1) < 0.005


def test_bubble_by_schedule():
    cfg = LlamaConfig.from_name("llama2-13b")
    shape = TrainShape(seq_len=4096, global_batch_tokens=4096 * 32)
    one = step_time(cfg, Layout(tp=2, pp=4, dp_shard=1), shape, GPUS["h100"])
    inter = step_time(cfg, Layout(tp=2, pp=4, vpp=2, schedule="interleaved_1f1b", dp_shard=1), shape, GPUS["h100"])
    m = 32
    assert one.bubble_s == pytest.approx(3 / m * (one.compute_s + one.exposed_s["tp"]), rel=1e-9)
    assert inter.bubble_s == pytest.approx(3 / (2 * m) * (inter.compute_s + inter.exposed_s["tp"]), rel=1e-9)


@pytest.mark.parametrize(
    "lay,match",
    [
        (Layout(tp=3, dp_shard=2), "n_heads"),
        (Layout(ep=3, dp_shard=6), "num_experts"),
        (Layout(pp=8, dp_shard=1), "layers"),
        (Layout(dp_shard=4), "not the 6 GPUs"),
    ],
)
def test_check_layout_reasons(lay, match):
    cfg = LlamaConfig.from_name("tiny", n_heads=4, n_kv_heads=4)
    with pytest.raises(ValueError, match=match):
        check_layout(cfg, lay, TrainShape(seq_len=12, global_batch_tokens=12 * 48), 6 if "GPUs" in match else lay.world)


def test_layout_parsing():
    lay = parse_layout("tp=8,pp=4,ep=8,recompute=1", gpus=512)
    assert (lay.dp_shard, lay.recompute, lay.schedule) == (16, True, "1f1b")
    assert parse_layout("pp=4,vpp=2", gpus=8).schedule == "interleaved_1f1b"
    with pytest.raises(ValueError, match="ep=3 must divide dp_shard=4"):
        parse_layout("ep=3,dp_shard=4")
    with pytest.raises(ValueError, match="unknown layout key 'cp'"):
        parse_layout("cp=2")
    assert gpu_from_spec("h100", "hbm_bytes=96e9").hbm_bytes == 96_000_000_000


def _run(capsys, *argv):
    status = main(list(argv))
    out = capsys.readouterr()
    return status, out.out, out.err


ARGS = ("--model", "mixtral-8x7b", "--gpu", "h100", "--gpus", "64", "--seq-len", "4096", "--global-batch-tokens")


def test_cli_layout_that_fits(capsys):
    status, out, _ = _run(capsys, *ARGS, str(256 * 4096), "--layout", "pp=4,ep=8,reshard=0,recompute=1", "--json")
    assert status == 0
    obj = json.loads(out)
    assert obj["fits"] and obj["layout"].startswith("tp=1,pp=4,ep=8,dp_shard=16")
    for key in ("bytes_per_rank", "hbm_bytes", "tokens_per_s_per_gpu", "mfu", "total_params", "active_params"):
        assert key in obj
    assert obj["bytes_per_rank"]["total"] <= 0.9 * obj["hbm_bytes"]


def test_cli_bad_layouts_exit_2(capsys):
    status, _, err = _run(capsys, *ARGS, str(256 * 4096), "--layout", "tp=8,pp=8")
    assert status == 2 and "does not fit" in err and "nearest layouts that fit" in err
    status, _, err = _run(capsys, *ARGS, str(256 * 4096), "--layout", "tp=3")
    assert status == 2 and "does not divide the 64 GPUs" in err and "layouts that fit" in err
    status, _, err = _run(capsys, *ARGS, str(256 * 4096), "--layout", "ep=16")
    assert status == 2 and "ep=16 does not divide num_experts=8" in err and "nearest layouts that fit" in err
    status, _, err = _run(capsys, *ARGS, "1000", "--layout", "ep=8")
    assert status == 2 and "global_batch_tokens=1000 must be a multiple of seq_len=4096" in err


def test_cli_bad_values_exit_2_with_one_line_first(capsys, tmp_path):
    """Values that used to end in a traceback: a zero layout size (a division by zero when
    dp_shard is derived), a zero micro-batch, a negative --top, a PNG into a missing folder."""
    cases = [
        (["--layout", "tp=0"], "layout tp must be a positive int, got 0"),
        (["--search", "--micro-batch", "0"], "--micro-batch and --top must be >= 1, got 0, 10"),
        (["--search", "--top", "-1"], "--micro-batch and --top must be >= 1, got 1, -1"),
        (["--search", "--png", str(tmp_path / "no" / "mem.png")], "the folder " + str(tmp_path / "no")),
        (["--search", "--gpus-per-node", "x"], "argument --gpus-per-node: invalid int value: 'x'"),
    ]
    for extra, message in cases:
        status, _, err = _run(capsys, *ARGS, str(256 * 4096), *extra)
        assert status == 2 and message in err.splitlines()[0] and "Traceback" not in err, (extra, err)
    assert not (tmp_path / "no").exists()


def test_cli_search_json_and_png(capsys, tmp_path):
    png = tmp_path / "mem.png"
    status, out, _ = _run(capsys, *ARGS, str(64 * 4096), "--search", "--json", "--png", str(png))
    assert status == 0
    plans = json.loads(out)
    fits = [p for p in plans if p["fits"]]
    assert fits and all(p["reason"] for p in plans if not p["fits"])
    speeds = [p["tokens_per_s_per_gpu"] for p in fits]
    assert speeds == sorted(speeds, reverse=True) and plans[: len(fits)] == fits
    assert png.stat().st_size > 1000


def test_evaluate_matches_cli_search_order():
    cfg = LlamaConfig.from_name("llama2-7b")
    shape = TrainShape(seq_len=4096, global_batch_tokens=4096 * 32)
    a = evaluate(cfg, Layout(tp=2, dp_shard=4), shape, GPUS["h100"], 8)
    b = evaluate(cfg, Layout(tp=2, dp_shard=4, recompute=True), shape, GPUS["h100"], 8)
    assert a.fits and b.fits and a.time.step_s < b.time.step_s  # recompute costs a forward
    assert b.memory["activations"] < a.memory["activations"]


def test_mixed_precision_needs_data_parallel_ranks():
    """parallelize_llama applies bf16 through FSDP2 and rejects mp_policy at dp=1."""
    cfg = LlamaConfig.from_name("tiny")
    shape = TrainShape(seq_len=16, global_batch_tokens=16 * 8)
    with pytest.raises(ValueError, match="needs data-parallel ranks"):
        check_layout(cfg, Layout(tp=2, pp=2), shape, 4)
    check_layout(cfg, Layout(tp=2, pp=2, precision="fp32"), shape, 4)


def test_cli_model_from_json_file(capsys, tmp_path):
    path = tmp_path / "model.json"
    fields = dict(dim=512, n_layers=4, n_heads=8, vocab_size=1000, ffn_hidden_dim=1408)
    fields["moe"] = dict(dim=512, hidden_dim=704, num_experts=4, top_k=2)
    path.write_text(json.dumps(fields))
    status, out, _ = _run(
        capsys, "--model", str(path), "--gpus", "8", "--seq-len", "512", "--global-batch-tokens", "8192",
        "--layout", "ep=4,dp_shard=8", "--json",
    )  # fmt: skip
    obj = json.loads(out)
    want = LlamaConfig(**fields | {"moe": MoEConfig(**fields["moe"])})
    assert status == 0 and (obj["total_params"], obj["active_params"]) == (want.num_params(), want.num_active_params())
    status, _, err = _run(capsys, "--model", "nope", "--gpus", "8", "--seq-len", "8", "--global-batch-tokens", "8",
                          "--search")  # fmt: skip
    assert status == 2 and "neither a preset" in err


def test_dualpipev_layout_holds_the_v_and_its_own_chunks():
    """A dualpipev layout: stages p and 2P-1-p on pipeline rank p, as pipeline_llama places
    them; its live chunks (2P + 1 on every rank) and its bubble from the schedule's own order."""
    from moe.plan.dualpipev import bubble_fraction

    lay = parse_layout("pp=4,schedule=dualpipev,dp_shard=2")
    assert (lay.vpp, lay.stages_of(0), lay.stages_of(3)) == (2, [0, 7], [3, 4])
    assert Layout(pp=4, vpp=2, schedule="interleaved_1f1b").stages_of(0) == [0, 4]
    with pytest.raises(ValueError, match="dualpipev takes vpp=2"):
        Layout(pp=2, vpp=3, schedule="dualpipev")
    for pp in (2, 4, 8):
        for m in (2 * pp, 4 * pp):
            lay = Layout(pp=pp, vpp=2, schedule="dualpipev")
            assert [live_chunks(lay, p, m) for p in range(pp)] == [2 * pp + 1] * pp, (pp, m)
            # DualPipe's published bubble with whole backwards (F 1, B 2, W 0): (P - 1)(F&B + B)
            # = 5 (P - 1) of the 6 M per rank; the first pair of the last rank is not paired
            assert abs(6 * m * bubble_fraction(pp, m) - 5 * (pp - 1)) <= 1, (pp, m, bubble_fraction(pp, m))
    assert bubble_fraction(1, 4) == 0.0
    with pytest.raises(ValueError, match="dualpipev needs microbatches"):
        bubble_fraction(4, 6)


def test_dualpipev_plans_between_1f1b_and_interleaved():
    """The same model and cluster: DualPipeV's bubble is below 1F1B's and above interleaved
    1F1B's (its backwards are whole), its rank 0 holds the V's ends (embedding and output)."""
    cfg = LlamaConfig(dim=256, n_layers=8, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_hidden_dim=512, max_seq_len=256)
    shape = TrainShape(seq_len=256, global_batch_tokens=256 * 32)
    times = {}
    for text in ("pp=4,schedule=1f1b", "pp=4,schedule=interleaved_1f1b", "pp=4,schedule=dualpipev"):
        lay = parse_layout(text + ",dp_shard=2", gpus=8)
        times[lay.schedule] = step_time(cfg, lay, shape, GPUS["h100"]).bubble_s
    assert times["interleaved_1f1b"] < times["dualpipev"] < times["1f1b"], times
    lay = parse_layout("pp=4,schedule=dualpipev,dp_shard=2", gpus=8)
    assert memory(cfg, lay, shape, 0)["logits"] > 0  # the last stage (7) is on rank 0


def test_cli_states_the_price_of_a_round_of_global_base(capsys, tmp_path):
    """A BASE router over an ep group: the plan says what a round of the solver's collectives
    costs on that group's link (``base_round_bytes``), in its text and its JSON."""
    from moe.plan import base_time
    from moe.plan.hardware import GPUS
    from moe.plan.time import EFFICIENCY

    path = tmp_path / "model.json"
    fields = dict(dim=512, n_layers=4, n_heads=8, vocab_size=1000, ffn_hidden_dim=1408)
    fields["moe"] = dict(dim=512, hidden_dim=704, num_experts=4, top_k=2, router="base")
    path.write_text(json.dumps(fields))
    args = ["--model", str(path), "--gpus", "8", "--seq-len", "512", "--global-batch-tokens", "8192",
            "--layout", "ep=4,dp_shard=8"]  # fmt: skip
    want = base_time.ROUND_LATENCY_S * GPUS["h100"].nvlink_bw * EFFICIENCY.nvlink  # ep = 4 within a node
    status, out, _ = _run(capsys, *args, "--json")
    assert status == 0 and json.loads(out)["base_round_bytes"] == pytest.approx(want)
    status, out, _ = _run(capsys, *args)
    assert status == 0 and f"{want:.3g} bytes: set the router option base_round_bytes" in out, out
