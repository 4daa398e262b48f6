"""The benchmark scripts run and report what they claim, at tiny sizes (no timings asserted)."""

import functools
from unittest import mock

import pytest
import torch

from benchmarks import grouped_gemm, routing


def test_routing_case_reports_every_method():
    rows = routing.run_case(256, 8, 1, "skewed", repeats=1, sinkhorn_iters=4)
    assert [r["method"] for r in rows] == ["base", "base_approx", "topk", "sinkhorn", "expert_choice"]
    base, approx = rows[:2]
    assert base["exact_balance"] and base["max_load"] == 1.0 and abs(base["gap_vs_exact"]) < 1e-6
    assert approx["exact_balance"] and approx["max_load"] == 1.0 and 0 <= approx["gap_vs_exact"] < 0.02
    wide = routing.run_case(64, 8, 2, "rank2", repeats=1, sinkhorn_iters=4)  # K > 1, the extra distribution
    assert [r["exact_balance"] for r in wide[:2]] == [True, True]
    assert rows[2]["quality"] == 1.0  # unconstrained top-k is its own bound
    assert "| 256 | 8 | 1 | skewed | base |" in routing.markdown(
        rows, {"command": "c", "machine": "m", "threads": 1, "torch": "t", "date": "d", "repeats": 1}
    )


def test_grouped_gemm_rows_have_a_dense_ratio():
    rows = grouped_gemm.run(scale=0.004, dtype=torch.float32, device=torch.device("cpu"), repeats=1)
    methods = {r["method"] for r in rows}
    assert {"ours (torch backend)", "per-expert loop", "dense (same FLOPs)"} <= methods
    assert all(r["fwd_vs_dense"] > 0 and r["fwdbwd_vs_dense"] > 0 for r in rows)
    assert {r["counts"] for r in rows} == {"uniform", "skewed"}


def test_moe_layer_benchmark_compares_with_mixtral_and_dense():
    import pytest

    pytest.importorskip("transformers", reason="needs the hf extra")
    from benchmarks import moe_layer

    rows = moe_layer.run(16, 24, 4, 2, 64, torch.float32, torch.device("cpu"), repeats=1, memory=False)
    names = [r["method"] for r in rows]
    assert names[0] == "ours (moe.MoE)" and names[-2:] == [moe_layer.DENSE, moe_layer.FLOOR]
    assert "transformers Mixtral (eager)" in names
    assert rows[-2]["x_dense"] == 1.0 and rows[0]["ours_speedup"] == 1.0
    # memory: measured in a fresh process; two steps over 16384 rows of width 48 need MiBs
    if moe_layer.memory_measurable(torch.device("cpu")):
        cpu = torch.device("cpu")
        peak, held = moe_layer.memory_mib("ours (moe.MoE)", (32, 48, 4, 2, 8192), torch.float32, cpu, {}, None)
        assert peak > 1 and peak < 1024 and 0 <= held <= peak  # MiB


def test_all_to_all_benchmark_rows(tmp_path):
    """One process (a group of one) runs the sweep and the dispatcher comparison."""
    import torch.distributed as dist

    from benchmarks import all_to_all

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        sweep = all_to_all.sweep([1024, 4096], repeats=1, device=torch.device("cpu"))
        assert [r["bytes"] for r in sweep] == [1024, 4096] and all(r["busbw"] == 0 for r in sweep)
        rows = all_to_all.dispatcher(64, 16, 4, torch.float32, repeats=1, device=torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    assert {(r["routing"], r["strategy"]) for r in rows} == {
        (routing, strategy)
        for routing in ("top-k (K=2), counted", "BASE (K=2), counted", "BASE (K=2), static splits")
        for strategy in ("resort", "per_expert")
    }
    assert all(r["rows_sent"] == 128 and r["ms_raw"] > 0 for r in rows)


def test_grouped_gemm_gather_methods_agree():
    """The fused-gather comparison computes the same product both ways (torch backend here; the
    benchmark runs it with the triton kernels on CUDA)."""
    counts = grouped_gemm.make_counts(48, 4, skewed=True)
    fns, t = grouped_gemm.gather_methods(counts, 2, "torch")
    x, w = torch.randn(t, 16), torch.randn(4, 16, 8)
    unfused, fused = (fn(x, w, counts) for fn in fns.values())
    assert t == 24 and fused.shape == (48, 8)
    torch.testing.assert_close(fused, unfused)


def test_layer_grid_point_has_every_contender_and_the_ratios():
    import pytest

    pytest.importorskip("torchtitan", reason="needs the torchtitan extra")
    pytest.importorskip("transformers", reason="needs the hf extra")
    from benchmarks import layer_grid

    only = [name for name in layer_grid.CONTENDERS if name != "Megatron"]  # Megatron: a process group
    row = layer_grid.point(64, 16, 32, 4, 2, repeats=1, only=only).strip("|").split("|")
    cells = [c.strip() for c in row]
    assert cells[:3] == ["64", "16/32", "4/2"]
    assert layer_grid.columns(only) == list(layer_grid.CONTENDERS)
    times = dict(zip(layer_grid.CONTENDERS, cells[3 : 3 + len(layer_grid.CONTENDERS)], strict=True))
    assert times["Megatron"] == "-" and all(times[n] != "-" for n in only)  # no contender skipped
    ours_vs_titan, ours_vs_megatron, ours_vs_dense, base_vs_dense = (c for c in cells[-4:])
    # ratios printed to two decimals: one repeat on a busy machine can print 0.00
    assert ours_vs_megatron == "-" and float(ours_vs_titan) >= 0 and float(ours_vs_dense) >= 0
    assert float(base_vs_dense) >= 0


def test_layer_grid_kept_contender_keeps_its_own_blocks_under_its_own_limit():
    from benchmarks import layer_grid
    from benchmarks.common import train_step
    from moe.kernels import workspace

    workspace.release()
    limit = workspace._limit[0]
    workspace.empty((1024, 1024), torch.float32, "cpu")  # a 4 MiB block the thread keeps, unused
    thread_pool = workspace._local.kept
    x = torch.randn(4096, 64)  # 8,192 rows: gate and up (8192, 128) fp32, 4 MiB each
    run, layer, scope = layer_grid._ours_kept(64, 128, 4, 2, limit=5 << 20)
    try:
        for _ in range(2):
            with scope():
                train_step(run, layer, x)
                own = workspace.kept_bytes()
                assert workspace._limit[0] == 5 << 20 and workspace._local.kept is not thread_pool
        assert 1 << 20 <= own <= 5 << 20  # blocks kept, no more than its limit
        # the thread's own pool and the limit are back as they were
        assert workspace._local.kept is thread_pool and workspace.kept_bytes() == 4 << 20
        assert workspace._limit[0] == limit
        train_step(*layer_grid._ours(64, 128, 4, 2), x)  # the plain contender keeps in the thread's blocks
        assert workspace.kept_bytes() > 5 << 20
        assert layer_grid._chosen("ours 2 GiB kept", ["ours 2 GiB kept"])
        assert not layer_grid._chosen("ours 2 GiB kept", None) and layer_grid._chosen("ours", None)
        assert "ours 2 GiB kept" not in layer_grid.columns(None) + layer_grid.columns(["ours"])
        assert layer_grid.columns(["ours 2 GiB kept"]) == list(layer_grid.CONTENDERS)
        row = layer_grid.point(64, 16, 32, 4, 2, repeats=1, only=["ours"]).strip("|").split("|")
        assert len(row) == 3 + len(layer_grid.columns(["ours"])) + 4  # no column for the opt-in one
    finally:
        workspace.release()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_adapters_slot_runs_both_layers_in_the_dtype_asked(dtype, capsys, monkeypatch):
    pytest.importorskip("torchtitan", reason="needs the torchtitan extra")
    from benchmarks import adapters

    seen, outputs, step = [], [], adapters.train_step

    def recording(run, module, x):
        seen.append((type(module).__name__, x.dtype, {p.dtype for p in module.parameters()}))
        hook = module.register_forward_hook(lambda _m, _i, out: outputs.append(out.dtype))
        try:
            return step(run, module, x)
        finally:
            hook.remove()

    monkeypatch.setattr(adapters, "train_step", recording)
    argv = ["--tokens", "32", "--dim", "16", "--hidden", "32", "--experts", "4", "--top-k", "2", "--repeats", "3"]
    adapters.main([*argv, "--dtype", dtype])
    want = getattr(torch, dtype)
    assert len(seen) == 2 * (1 + 3)  # one warm-up and three repeats each, taking turns
    assert [name for name, *_ in seen[:2]] == ["MoEFeedForward", "MoE"]
    assert all(x == want and params == {want} for _, x, params in seen)
    assert outputs == [want] * len(seen)  # each layer computes in the dtype, not only stores it
    cells = [c.strip() for c in capsys.readouterr().out.strip().strip("|").split("|")]
    assert cells[0] == f"T=32 D=16 F=32 E=4 K=2 {dtype}"
    for cell, name in zip(cells[1:3], ("ours", "torchtitan MoE"), strict=True):
        median, spread = cell.removeprefix(name + " ").split(" ms ")
        lo, hi = (float(v) for v in spread.strip("()").split("-"))
        assert lo <= float(median) <= hi
    assert float(cells[3].removeprefix("ours / theirs ")) > 0
    for bad, why in (("--tokens", "30"), ("--tokens", "0"), ("--repeats", "0")):
        with pytest.raises(SystemExit) as exc:
            adapters.main([*argv, bad, why])
        assert exc.value.code == 2
        assert (bad + " must be") in capsys.readouterr().err


@pytest.mark.parametrize("apart", [False, True], ids=["turns", "apart"])
def test_timed_turns_order_and_counts(apart):
    from benchmarks.common import timed_turns

    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "ab"}
    times = timed_turns(fns, repeats=3, before=lambda: calls.append("-"), warmup=2, apart=apart)
    assert {name: len(ts) for name, ts in times.items()} == {"a": 3, "b": 3}
    if apart:  # each one's warm-ups and repeats back to back, one after the other
        assert "".join(calls) == "aa-a-a-a" + "bb-b-b-b"
    else:  # every warm-up first, then the two take turns
        assert "".join(calls) == "aabb" + "-a-b" * 3


def test_layer_grid_touch_makes_fresh_memory_between_runs():
    from benchmarks import layer_grid

    assert layer_grid._touch(0) is None
    assert layer_grid._touch(3)().nbytes == 3 << 20


def test_combine_benchmark_times_both_paths():
    from benchmarks import combine

    cells = [c.strip() for c in combine.point(16, 2, 8, 4, repeats=1).strip("|").split("|")]
    assert cells[:3] == ["16", "2", "8"] and float(cells[-1]) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_grid_profile_splits_each_contenders_time(dtype):
    from benchmarks import layer_grid

    # a shape whose GEMMs take well over the table's 0.1 ms rounding (at 64 x 16 x 32 they rounded to 0.0)
    lines = layer_grid.profile_point(256, 64, 128, 4, 2, only=["ours", layer_grid.DENSE], steps=2, dtype=dtype)
    assert [line.split("|")[1].strip() for line in lines] == ["ours", layer_grid.DENSE]
    for line in lines:
        total, gemm, rest, calls = (float(c) for c in line.strip("|").split("|")[1:])
        assert 0 < gemm <= total and rest == pytest.approx(total - gemm, abs=0.11) and calls > 0


def test_layer_grid_gemm_roles_from_shapes_and_pass():
    from benchmarks import layer_grid

    def role(shapes, backward, name="aten::mm"):
        return layer_grid.gemm_role(layer_grid._matrices(name, shapes), {64, 128, 256, 4}, backward)

    assert role([[10, 64], [64, 128]], False) == "forward"
    assert role([[10, 64], [64, 128], [10, 128]], False) == "forward"  # mm's out= tensor
    assert role([[10, 128], [10, 64], [64, 128], [], []], False, "aten::addmm") == "forward"  # a 2-D bias
    assert role([[10, 128], [128, 64]], True) == "dX"
    assert role([[64, 10], [10, 128], [64, 128]], True) == "dW"
    assert role([[256, 10], [10, 64]], True) == "dW"  # gate and up as one (2F, D)
    assert role([[64, 10], [10, 4]], True) == "dW"  # the router's (D, E)
    # the dense floor's three matmuls, and ours: out= GEMMs, one expert at a time at 128 rows an
    # expert (3 a role an expert), the router's (one a role) and the combine's bmm over the K
    # slots (forward, and dX of the probabilities): forward, dX and dW told apart
    for name, t, e, calls in ((layer_grid.DENSE, 256, 4, [3, 3, 3]), ("ours", 512, 2, [8, 8, 7])):
        gemms = []
        layer_grid.profile_point(t, 64, 128, e, 2, only=[name], steps=2, gemms=gemms)
        cells = {row.split("|")[2].strip(): [float(c) for c in row.strip("|").split("|")[2:]] for row in gemms}
        assert sorted(cells) == ["dW", "dX", "forward"]
        assert [cells[r][0] for r in ("forward", "dX", "dW")] == calls and all(c[1] > 0 for c in cells.values())
        # every row through three (D x F) matrices, 2 FLOPs a multiply-add, 3 passes; the router's (D x E) GEMMs
        flops = 3 * 2 * t * 2 * 64 * 128 + (2 * t * 64 * e if name == "ours" else 0)
        assert sum(c[2] for c in cells.values()) == pytest.approx(3 * flops / 1e9, abs=0.0031)


def test_base_solvers_reads_fairseqs_answer_back_per_token():
    from benchmarks import base_solvers

    class Auction:  # fairseq's output: for each expert in turn, the T/E tokens it takes
        @staticmethod
        def balanced_assignment(s):
            return s[:, 0].argsort()

    s = torch.randn(12, 3)
    idx = base_solvers.fairseq_experts(Auction, s)
    order = s[:, 0].argsort()
    assert idx.shape == (12, 1) and idx[order[:4], 0].tolist() == [0] * 4 and idx[order[8:], 0].tolist() == [2] * 4


def test_base_solvers_small_table_times_both_paths(monkeypatch):
    from benchmarks import base_solvers
    from moe.routing.balanced import exact

    taken = []
    real = exact._host_solve
    monkeypatch.setattr(exact, "_host_solve", lambda *a: taken.append(1) or real(*a))
    monkeypatch.setattr(base_solvers, "SMALL_CASES", [(64, 4), (8192, 4)])  # within and beyond the limit
    monkeypatch.setattr(base_solvers, "WARMUP", 1)
    lines = base_solvers.small_table(repeats=2, seeds=2)
    assert [line.split("|")[1].strip() for line in lines[4:]] == ["64 x 4", "8192 x 4"]
    # per draw: a warm-up, 2 timed solves and the check of the totals take the numpy path
    assert len(taken) == 2 * 2 * (1 + 2 + 1)


def test_base_solvers_times_a_runs_router_scores_both_ways(tmp_path, capsys):
    from benchmarks import base_solvers
    from moe.routing.exchange import _Graph

    from .train.run import TINY, corpus, moe

    run_dir = tmp_path / "run"
    moe("train", *TINY, "--data", corpus(tmp_path), "--router", "base", "--experts", 8, "--top-k", 2, "--steps", 2,
        "--checkpoint-every", 2, "--out", run_dir)  # fmt: skip
    seen = []
    refresh = _Graph._refresh

    def counted(graph, slot, nodes, full=False):
        seen.append(full)
        refresh(graph, slot, nodes, full)

    with mock.patch.object(_Graph, "_refresh", counted):
        base_solvers.main(["--run", str(run_dir), "--step", "2", "--tokens", "512", "--repeats", "2"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "x 8" in line]
    assert [r.split("|")[1:3] for r in rows] == [[" 0 ", " 512 x 8 "], [" 1 ", " 512 x 8 "]]  # both BASE layers
    assert seen.count(True) > 0 and seen.count(False) > 0  # the rescanning contender rescans, ours does not
    with pytest.raises(SystemExit):
        base_solvers.main(["--run", str(run_dir)])  # no --step


def test_global_base_benchmark_rows_on_random_and_training_scores():
    from benchmarks.global_base import markdown, run, summary

    rows = run(3, 40, 8, 2, "random", 2, check=True) + run(2, 64, 8, 1, "training", 2, check=True)
    kinds = {(s, m) for s in ("random", "training") for m in ("cold", "warm")}
    assert {(r["scores"], r["mode"]) for r in rows} == kinds
    for r in rows:
        assert r["rounds"] >= 4 and 0 < r["bytes"] and r["gathered_bytes"] == r["W"] * r["T"] * r["E"] * 4
        assert 0 <= r["margin_rows"] <= r["W"] * r["T"]
        assert sum(r["parts"].values()) == r["bytes"] and r["parts"]["prices"] <= r["bytes"]
    assert "| 3 | 40 | 8 | 2 | random | warm |" in markdown(summary(rows))
    rows = run(2, 32, 8, 1, "random", 3, check=False, cold="first")  # later steps warm only
    assert [(r["step"], r["mode"]) for r in rows] == [(0, "cold"), (1, "warm"), (2, "warm")]
    with pytest.raises(ValueError, match="cold must be 'every' or 'first', got 'all'"):
        run(2, 32, 8, 1, "random", 2, check=False, cold="all")


def test_global_base_bytes_by_part_follow_the_solve_phases():
    """A cold solve's collectives in order (W = 4, E = 8: a chain's counts 8 x 18 + 33 values,
    the margin counts 8 + 4 + 33, the certificate's 8): the header's maxima, the start's
    gather, the price sums and the pair rounds' counts and max, a check that fails (the
    margin's counts on it) and one that holds, a band grown with a gather each, two
    certificate rounds."""
    from benchmarks.global_base import bytes_by_part

    log = [("max", 44, 1), ("max", 1, 2), ("gather", 32, 4), ("sum", 177, 8), ("sum", 354, 16), ("sum", 264, 32)]
    log += [("max", 9, 64), ("sum", 8 + 45, 53 * 128), ("sum", 264, 256), ("max", 9, 512), ("sum", 53, 53 * 1024)]
    log += [("gather", 300, 2048), ("sum", 45, 4096), ("gather", 100, 8192)]
    log += [("sum", 8, 16384), ("gather", 20, 32768), ("sum", 8, 65536)]
    parts = bytes_by_part(log, world=4, experts=8)
    assert parts == dict(
        header=3,
        start=4,
        prices=8 + 16 + 32 + 64 + 8 * 128 + 256 + 512 + 8 * 1024,
        margin_counts=45 * 128 + 45 * 1024 + 4096,
        margin_rows=2048 + 8192,
        check_counts=16384 + 65536,
        check_rows=32768,
    )
    # a warm call: its first update carries the ranks' own prices (177 + 4 x 8 int32), then
    # both chains' counts (354 int32)
    warm = [("max", 44, 1), ("sum", 177 + 32, 209 * 4), ("sum", 354, 354 * 4), ("sum", 45, 64), ("gather", 300, 128)]
    parts = bytes_by_part(warm, 4, 8)
    assert parts["start"] == 32 * 4 and parts["prices"] == 177 * 4 + 354 * 4 and parts["margin_counts"] == 64
    assert parts["margin_rows"] == 128
    without = bytes_by_part([("max", 44, 1), ("sum", 177, 8), ("sum", 45, 64), ("gather", 300, 128)], 4, 8)
    assert without["start"] == 0 and without["prices"] == 8 and without["margin_rows"] == 128
    # W = 16E (W = 1024, E = 64): a chain's counts (18 x 64 + 33) are as many values as a check
    # with the margin's counts on it (64 + 64 + 1024 + 33); only the sum after a pair max is one
    big = [("max", 3080, 1), ("sum", 1185, 2), ("sum", 1185, 4), ("sum", 1121, 8), ("gather", 300, 16)]
    big += [("sum", 2048, 32)]
    parts = bytes_by_part(big, 1024, 64)
    assert parts["prices"] == 6 and parts["margin_counts"] == 8 and parts["check_counts"] == 32
    # the certificate's start given (`PriceStats.check_from`): its checks' gathers, counts and
    # rows in one where a round is priced, are its rows; a sum of 2W before it is the margin's
    ahead = [("max", 44, 1), ("sum", 177, 2), ("sum", 8, 4), ("gather", 300, 8), ("gather", 8, 16), ("gather", 8, 32)]
    parts = bytes_by_part(ahead, 4, 8, check_from=4)
    assert parts["margin_counts"] == 4 and parts["margin_rows"] == 8 and parts["check_rows"] == 48
    assert parts["check_counts"] == 0


def test_global_base_benchmark_checks_up_to_its_limit_and_certifies_beyond():
    from benchmarks.global_base import markdown, run, summary, verify
    from moe.parallel.price_base import price_balanced_assignment
    from moe.parallel.reduction import ShardReduce

    rows = run(2, 32, 8, 1, "random", 2, check=True, check_max_gb=2 * 32 * 8 * 4 / 1e9)
    assert [r["objective"] for r in rows] == ["equal"] * 3
    rows = run(2, 32, 8, 2, "random", 2, check=True, check_max_gb=2 * 32 * 8 * 4 / 1e9 / 2)
    assert [r["objective"] for r in rows] == ["certified"] * 3  # by the prices' bound, no stacked solve
    assert all(r["gathered_bytes"] == 2 * 32 * 8 * 4 for r in rows)
    assert markdown(summary(rows)).splitlines()[-1].endswith("| certified |")
    # a balanced assignment that is not the optimum fails both checks
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    out, p, _ = price_balanced_assignment(list(x.split(32)), 1, ShardReduce(2))
    out = torch.cat(out)
    assert verify(x, out, p, 1, 1.0) == "equal" and verify(x, out, p, 1, 0.0) == "certified"
    i, j = 0, int((out[:, 0] != out[0, 0]).nonzero()[0])
    worse = out.clone()
    worse[i, 0], worse[j, 0] = out[j, 0], out[i, 0]
    for max_gb in (1.0, 0.0):
        with pytest.raises(AssertionError, match="the objective is"):
            verify(x, worse, p, 1, max_gb)


def test_global_base_benchmark_replays_the_chosen_checkpoints_of_a_run(tmp_path, capsys):
    from benchmarks import global_base

    from .train.run import TINY, corpus, moe

    run_dir = tmp_path / "run"
    moe("train", *TINY, "--data", corpus(tmp_path), "--router", "base", "--experts", 8, "--top-k", 1, "--steps", 4,
        "--checkpoint-every", 1, "--keep", 8, "--out", run_dir)  # fmt: skip
    seen, used = [], []
    use = global_base.ReplayedLayers.use
    with mock.patch.object(global_base.ReplayedLayers, "use", lambda self, a: used.append(a) or use(self, a)):
        rows = global_base.run(2, 64, 0, 0, "run", 2, True, run_dir=str(run_dir), replay=[1, 4], on_solve=seen.append)
    assert seen == rows  # each solve reported as it ends
    assert [tuple(a.shape) for a in used] == [(128, 1)] * 8  # each layer of each batch routed by its last solve
    solves = [(r["scores"], r["step"], r["mode"]) for r in rows if r["layer"] == 0]
    assert solves == [("run@1", 1, "cold"), ("run@1", 2, "cold"), ("run@1", 2, "warm"),
                      ("run@4", 4, "cold"), ("run@4", 5, "cold"), ("run@4", 5, "warm")]  # fmt: skip
    assert {r["layer"] for r in rows} == {0, 1}  # the tiny preset's two MoE layers
    assert all(r["E"] == 8 and r["K"] == 1 and r["objective"] == "equal" for r in rows)
    global_base.progress(rows[-1])
    assert capsys.readouterr().err.startswith("run@4 step 5 layer 1 warm: ")
    with pytest.raises(SystemExit, match="no checkpoint at steps \\[7\\]"):
        global_base.main(["--run", str(run_dir), "--replay-steps", "7", "--W", "2", "--T", "64"])
    with pytest.raises(SystemExit):
        global_base.main(["--replay-steps", "1"])


def test_global_base_replay_makes_each_layer_from_the_assignment_it_is_given(tmp_path):
    """The replay's layer-by-layer forward over chunks of sequences gives the whole batch's
    forward's scores (bit for bit in one chunk; over several, to the rounding of the experts'
    GEMMs on other row counts); each layer routes by the assignment given to ``use`` (a
    different one changes the next layer's scores as the whole forward's would), or else by its
    own solve; a cut-short last sequence gives the prefix of the whole one's scores."""
    from benchmarks import global_base

    from .train.run import TINY, corpus, moe

    run_dir = tmp_path / "run"
    moe("train", *TINY, "--data", corpus(tmp_path), "--router", "base", "--experts", 8, "--top-k", 1, "--steps", 2,
        "--checkpoint-every", 2, "--out", run_dir)  # fmt: skip
    ((_, _, layers),) = global_base.run_steps(str(run_dir), 2, 64, [2], 1)
    model, inputs = layers.model, torch.cat(layers.inputs)
    routers = [b.feed_forward.router for b in model.layers.values() if b.is_moe]
    assert inputs.shape == (4, 32) and len(routers) == 2

    def whole(first=None):
        """The whole batch's forward: every BASE layer's scores, layer 0 routed by ``first``."""
        seen, solves = [], [r.assign for r in routers]

        def record(s, k, _first, _solve, **options):
            seen.append(s.clone())
            return _first if _first is not None else _solve(s, k, **options)

        for i, (router, solve) in enumerate(zip(routers, solves, strict=True)):
            router.assign = functools.partial(record, _first=first if i == 0 else None, _solve=solve)
        try:
            with torch.no_grad():
                model(inputs)
        finally:
            for router, solve in zip(routers, solves, strict=True):
                router.assign = solve
        return seen

    own = whole()
    assert all(torch.equal(a, b) for a, b in zip(layers, own, strict=True))  # chunks of 64 sequences: one
    close = functools.partial(torch.allclose, rtol=0, atol=1e-6)
    by_one = list(global_base.ReplayedLayers(model, inputs, 128, chunk=1))  # four chunks
    assert torch.equal(by_one[0], own[0]) and close(by_one[1], own[1])
    other = (own[0].argmax(1, keepdim=True) + 1) % 8  # not the solve's: every token one expert on
    given = whole(other)
    assert torch.equal(given[0], own[0]) and not close(given[1], own[1], atol=1e-4)
    replayed = []
    for x in (it := global_base.ReplayedLayers(model, inputs, 128, chunk=3)):
        replayed.append(x)
        it.use(other)
    assert close(replayed[1], given[1])
    short = list(global_base.ReplayedLayers(model, inputs, 100, chunk=2))  # 3 sequences and 4 tokens
    assert close(short[0], own[0][:100]) and short[1].shape == (100, 8)  # causal: layer 0 a prefix
    with pytest.raises(ValueError, match="must be \\(N, K\\) = \\(128, 1\\), got \\(127, 1\\)"):
        for _ in (it := global_base.ReplayedLayers(model, inputs, 128)):
            it.use(other[:127])
    with pytest.raises(ValueError, match="n must be in \\[1, 128\\]"):
        global_base.ReplayedLayers(model, inputs, 129)
    assert all(r.assign.__name__ == "balanced_assignment" for r in routers)  # its own solver again after each
    spill = tmp_path / "spill"
    spill.mkdir()
    mapped = list(global_base.ReplayedLayers(model, inputs, 128, spill=str(spill)))  # held in files there
    assert all(str(x.untyped_storage().filename).startswith(str(spill)) for x in mapped)
    assert all(torch.equal(a, b) for a, b in zip(mapped, own, strict=True)) and not any(spill.iterdir())  # unlinked


def test_global_base_ranks_time_each_rank_over_gloo_on_the_simulated_solves():
    """W = 2 gloo processes solve the simulated group's problems, cold and warm, in the same
    rounds and to the same assignment, and each rank's CPU seconds are counted."""
    from benchmarks import global_base_ranks

    rows = global_base_ranks.run(2, 64, 8, 2, "random", 2, timeout_minutes=2)
    assert [(r["step"], r["mode"]) for r in rows] == [(0, "cold"), (1, "cold"), (1, "warm")]
    for r in rows:
        assert r["equal"] and r["rank_rounds"] == [r["rounds"]] and r["rounds"] >= 4
        assert len(r["rank_cpu"]) == 2
        assert all(0 < own <= cpu for own, cpu in zip(r["rank_own"], r["rank_cpu"], strict=True))
        assert r["group_s"] > 0 and r["rank_peak_mb"] > 0 and (r["W"], r["T"], r["E"], r["K"]) == (2, 64, 8, 2)
    (cold, warm) = global_base_ranks.summary(rows)
    assert (cold["n"], warm["n"]) == (2, 1) and cold["equal"] and warm["equal"]
    last = global_base_ranks.markdown([cold, warm]).splitlines()[-1]
    assert last.startswith("| 2 | 64 | 8 | 2 | random | warm | 1 |")
    assert not global_base_ranks.summary([rows[0] | dict(equal=False)])[0]["equal"]


def test_base_reruns_count_each_calls_collectives_and_check_the_routes():
    """W = 2 gloo processes, two checkpointed micro-batches a step with tied scores: each
    forward's collectives are its solve's (at least the header, the updates and a check); the
    first step's re-runs solve from their forwards' starts, the second's take their routes in
    one collective; every re-run routes as its forward."""
    import argparse

    from benchmarks import base_reruns

    args = argparse.Namespace(micro_batches=2, steps=2, tokens=24, dim=8, experts=4, k=2, tie=True)
    rows = base_reruns.run(2, args)
    assert [r[0] for r in rows] == [0, 1] and all(r[3] for r in rows)
    (_, forwards0, reruns0, _), (_, forwards1, reruns1, _) = rows
    assert len(forwards0) == len(reruns0) == 2 and min(forwards0 + forwards1 + reruns0) >= 4
    assert reruns1 == [1, 1]


def test_node_bytes_count_what_crosses_between_nodes(capsys):
    """The inter-node counts follow the uniform expectation without a node limit, the node limit
    caps the nodes a token reaches at M, and deduplication halves the top-8 bytes under M=4."""
    from benchmarks import all_to_all, node_bytes

    rows = {r["name"]: r for r in node_bytes.rows(tokens=4096)}
    for name in ("top-2 of 8 experts, 2 nodes", "top-8 of 256 experts, 8 nodes"):
        r = rows[name]
        assert (
            abs(r["flat_vectors"] - r["uniform_flat"]) < 0.05
            and abs(r["two_level_vectors"] - r["uniform_two_level"]) < 0.1
        )
        assert r["two_level_bytes"] < r["flat_bytes"]
    limited = rows["top-8 of 256 experts, 8 nodes, M=4"]
    assert limited["max_nodes"] == 4 and limited["ratio"] > 1.9
    all_to_all.main(["--hierarchical"])  # one process: the counts, no process group
    assert "| top-8 of 256 experts, 8 nodes, M=4 | 7168 |" in capsys.readouterr().out
