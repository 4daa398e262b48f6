"""parallelize_llama / pipeline_llama over gloo: each layout's three AdamW steps (losses, the
first step's gradients, the parameters after) equal one process with the same seed and global
batch, for a BASE (top-1, sigmoid residual) and a top-k (aux + z loss) MoE; bad layouts raise
on every rank. The rule and tolerance: tests/parallel/llama_layouts.py.

Layouts are grouped per spawn, so process start-up is paid once per group."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from . import llama_layouts as L
from .launch import init, spawn

pytestmark = pytest.mark.distributed

ROUTERS = tuple(L.ROUTERS)


def _mesh(shape, names):
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def two_rank_layouts(rank, world, store):
    from moe import MoE
    from moe.parallel import HierarchicalDispatcher, parallelize_llama

    init(rank, world, store)
    cfg = L.config("topk")
    L.run_parallel(cfg, _mesh((2,), ("tp",)), "tp=2 loss_parallel", loss_parallel=True)
    L.run_parallel(cfg, _mesh((2,), ("dp_shard",)), "ep=2 checkpointed", ep=2, activation_checkpoint=True)
    hierarchical = dict(dispatch="hierarchical", ranks_per_node=1)  # two nodes of one rank: ep's slice unflattened
    L.run_parallel(cfg, _mesh((2,), ("dp_shard",)), "ep=2 hierarchical", ep=2, **hierarchical)
    L.run_parallel(cfg, _mesh((2,), ("dp_shard",)), "ep=2 in 2 chunks", ep=2, chunks=2)
    model = parallelize_llama(L.build(cfg), _mesh((2,), ("dp_shard",)), ep=2, **hierarchical)
    assert {type(m.dispatcher) for m in model.modules() if isinstance(m, MoE)} == {HierarchicalDispatcher}
    for router in ROUTERS:
        cfg = L.config(router)
        L.run_parallel(cfg, _mesh((2,), ("dp_replicate",)), f"dp_replicate=2 {router}")
        L.run_parallel(cfg, _mesh((2,), ("dp_shard",)), f"dp_shard=2 {router}")
        L.run_parallel(cfg, _mesh((2,), ("tp",)), f"tp=2+SP {router}")
        L.run_parallel(cfg, _mesh((2,), ("dp_shard",)), f"ep=2 {router}", ep=2)
        L.run_parallel(cfg, _mesh((2,), ("tp",)), f"tp=2 etp {router}", etp=True)


def test_two_rank_layouts():
    spawn(two_rank_layouts, 2)


def mixed_precision(rank, world, store):
    """bf16 compute through FSDP2's MixedPrecisionPolicy: the sharded parameters, their
    gradients and AdamW's state stay fp32, and the first loss is the fp32 one to bf16 accuracy;
    then pipeline stages under bf16 autocast, likewise."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from moe.parallel import LlamaMesh, llama_loss, parallelize_llama

    init(rank, world, store)
    cfg = L.config("topk")
    lm = LlamaMesh.build(_mesh((2,), ("dp_shard",)), ep=2)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = parallelize_llama(L.build(cfg), lm, ep=2, mp_policy=mp)
    tokens, targets = (lm.local_batch(t) for t in L.data(cfg, 0))
    logits = model(tokens)
    assert logits.dtype == torch.bfloat16
    loss = llama_loss(model, logits, targets)
    loss.backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    expect = L.cached_reference(cfg, lm.dp_size)[0][0]
    torch.testing.assert_close(lm.mean_over_dp(loss).item(), expect, rtol=2e-2, atol=0)

    # pipeline stages under bf16 autocast (what `moe train` does on a GPU; CPU autocast here):
    # the fp32 residual stream passes between stages, the loss is fp32's to bf16 accuracy
    from moe.parallel import pipeline_llama

    cfg = L.config("topk", n_layers=2)
    pp = LlamaMesh.build(_mesh((2,), ("pp",)))
    pipe = pipeline_llama(L.build(cfg), pp, schedule="1f1b", microbatches=2)
    tokens, targets = (pp.local_batch(t) for t in L.data(cfg, 0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.step(tokens, targets).item()
    expect = L.cached_reference(cfg, 2)[0][0]
    assert abs(loss - expect) > 1e-5, "the stages ran in fp32: autocast did not reach them"
    torch.testing.assert_close(loss, expect, rtol=2e-2, atol=0)
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in pipe.parameters())


def test_mixed_precision():
    spawn(mixed_precision, 2)


def pipeline_layouts(rank, world, store, schedules):
    init(rank, world, store)
    mesh = _mesh((2,), ("pp",))
    for schedule, n_layers in schedules:
        for router in ROUTERS:
            cfg = L.config(router, n_layers=n_layers)
            L.run_pipeline(cfg, mesh, f"pp=2 {schedule} {router}", schedule=schedule, microbatches=4)


def test_pipeline_gpipe_1f1b():
    spawn(pipeline_layouts, 2, [("gpipe", 2), ("1f1b", 2)])


@pytest.mark.slow
def test_pipeline_interleaved():
    spawn(pipeline_layouts, 2, [("interleaved_1f1b", 4)])


def _paired_steps(pipe, rank: int) -> int:
    """The schedule's paired forward/backward actions of this pp rank in one step."""
    from torch.distributed.pipelining.schedules import OVERLAP_F_B

    order = pipe.schedule.pipeline_order[rank]
    return sum(a is not None and a.computation_type == OVERLAP_F_B for a in order)


def dualpipev_layouts(rank, world, store, with_ep):
    """DualPipeV with its paired steps run as forward and backward taking turns at each layer:
    the one-process steps, with every paired step run as a pair that took turns. Under ep the
    two sides' all-to-alls (in 2 chunks, async) go through one group in turns."""
    init(rank, world, store)
    mesh = _mesh((2, 2), ("pp", "dp_shard")) if with_ep else _mesh((2,), ("pp",))
    options = dict(ep=2, chunks=2) if with_ep else {}
    for router in ROUTERS:
        cfg = L.config(router, n_layers=4)
        what = f"pp=2 dualpipev {router} {options}"
        pipe = L.run_pipeline(cfg, mesh, what, schedule="dualpipev", microbatches=4, **options)
        pp_rank = pipe.mesh.world["pp"].get_local_rank()
        assert pipe.indices == [pp_rank, 3 - pp_rank], pipe.indices  # the V
        assert pipe.paired.pairs == L.STEPS * _paired_steps(pipe, pp_rank) > 0, (what, pipe.paired.pairs)
        # each side gave the turn at its layers and got it back ("FBF" alone: the backward ran whole)
        assert pipe.paired.last_log.startswith("FBFB"), (what, pipe.paired.last_log)
    if not with_ep:  # evaluation: the forwards alone, as 1F1B's; then a step is still the reference's
        from moe.parallel import pipeline_llama

        cfg = L.config("topk", n_layers=4)
        tokens, targets = L.data(cfg, 0)
        pipes = {s: pipeline_llama(L.build(cfg), mesh, schedule=s, microbatches=4) for s in ("1f1b", "dualpipev")}
        ce = {s: p.evaluate(tokens, targets).item() for s, p in pipes.items()}
        assert abs(ce["dualpipev"] - ce["1f1b"]) < 1e-6, ce
        loss = pipes["dualpipev"].step(tokens, targets).item()
        assert abs(loss - L.cached_reference(cfg, 4)[0][0]) < 1e-5, loss


def test_pipeline_dualpipev():
    spawn(dualpipev_layouts, 2, False)


def test_pipeline_dualpipev_with_expert_parallel():
    spawn(dualpipev_layouts, 4, True)


def four_rank_layouts(rank, world, store, which):
    init(rank, world, store)
    for router in ROUTERS:
        cfg = L.config(router)
        if "tp_ep" in which:
            L.run_parallel(cfg, _mesh((2, 2), ("dp_shard", "tp")), f"tp=2 x ep=2 {router}", ep=2)
            if router == "topk":  # the two-level dispatch with the experts sharded over tp (two nodes of one ep rank)
                L.run_parallel(
                    cfg, _mesh((2, 2), ("dp_shard", "tp")), "tp=2 etp x ep=2 hierarchical", ep=2, etp=True,
                    dispatch="hierarchical", ranks_per_node=1,
                )  # fmt: skip
        if "dp_tp" in which:
            L.run_parallel(cfg, _mesh((2, 2), ("dp_shard", "tp")), f"dp_shard=2 x tp=2 {router}")
        if "ep_d_sharded" in which and router == "topk":  # one expert per ep rank, held by 2 ranks:
            one = L.config(router, num_experts=2)  # FSDP shards the experts' D, not the expert dim
            L.run_parallel(one, _mesh((4,), ("dp_shard",)), "dp_shard=4 x ep=2, D-sharded experts", ep=2)
            L.run_parallel(one, _mesh((4,), ("dp_shard",)), "dp_shard=4, 2 experts in the block's unit, D-sharded")
        if "pp_ep" in which:
            L.run_pipeline(
                L.config(router, n_layers=2), _mesh((2, 2), ("pp", "dp_shard")), f"pp=2 x ep=2 {router}",
                schedule="1f1b", microbatches=2, ep=2,
            )  # fmt: skip
        if "hsdp_etp" in which:
            L.run_parallel(cfg, _mesh((2, 2), ("dp_replicate", "tp")), f"dp_replicate=2 x tp=2 etp {router}", etp=True)
    if "pp_tp" in which:  # stages pass the sequence shards
        L.run_pipeline(L.config("topk"), _mesh((2, 2), ("pp", "tp")), "pp=2 x tp=2", schedule="1f1b", microbatches=2)


def test_four_rank_tp_ep_and_dp_tp():
    spawn(four_rank_layouts, 4, ("tp_ep", "dp_tp", "ep_d_sharded"))


@pytest.mark.slow
def test_four_rank_pp_ep_and_hsdp_etp():
    spawn(four_rank_layouts, 4, ("pp_ep", "hsdp_etp", "pp_tp"))


def _raises(match: str, fn, *args, **kwargs) -> None:
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)


def bad_layouts(rank, world, store):
    from torch.distributed.device_mesh import DeviceMesh

    from moe.parallel import llama_loss, parallelize_llama, pipeline_llama

    init(rank, world, store)
    tp, shard = _mesh((2,), ("tp",)), _mesh((2,), ("dp_shard",))
    cfg = L.config("topk")
    _raises("must span every process", parallelize_llama, L.build(cfg), DeviceMesh("cpu", [0], mesh_dim_names=("tp",)))
    _raises("not one of", parallelize_llama, L.build(cfg), _mesh((2,), ("model",)))
    _raises("n_kv_heads=1", parallelize_llama, L.build(L.config("topk", n_kv_heads=1)), tp)
    _raises("ep=2 must divide dp_shard=1", parallelize_llama, L.build(cfg), tp, ep=2)
    _raises("ep=2 must divide num_experts=3", parallelize_llama, L.build(L.config("topk", num_experts=3)), shard, ep=2)
    _raises(
        "fewer than the 2 pipeline stages",
        pipeline_llama,
        L.build(L.config("topk", n_layers=1)),
        _mesh((2,), ("pp",)),
        microbatches=2,
    )
    pp = _mesh((2,), ("pp",))
    _raises("dualpipev takes 2", pipeline_llama, L.build(L.config("topk", n_layers=6)), pp, schedule="dualpipev",
            microbatches=6, stages_per_rank=3)  # fmt: skip
    _raises("dualpipev needs microbatches \\(2\\) >= its 2 x pp = 4", pipeline_llama,
            L.build(L.config("topk", n_layers=4)), pp, schedule="dualpipev", microbatches=2)  # fmt: skip
    _raises("ranks disagree", parallelize_llama, L.build(L.config("topk", vocab_size=64 + rank)), shard)
    model = parallelize_llama(L.build(cfg), tp)
    tokens, targets = L.data(cfg, 0)
    _raises("divisible by tp=2", model, tokens[:, :7])
    llama_loss(model, model(tokens), targets)  # the model still works after the refusal


def test_bad_layouts_raise_on_every_rank():
    spawn(bad_layouts, 2)


def test_stage_layers():
    from moe.parallel.pipeline import stage_layers

    names = [str(i) for i in range(5)]
    assert stage_layers(names, 2) == [["0", "1", "2"], ["3", "4"]]
    assert stage_layers(names, 5) == [[n] for n in names]
    with pytest.raises(ValueError, match="fewer than the 6"):
        stage_layers(names, 6)


def test_router_loss_attached_once():
    """The autograd function hands the stage's router loss the gradient 1, the output its own."""
    from moe.parallel.pipeline import _AttachLoss

    out = torch.randn(3, requires_grad=True)
    loss = torch.tensor(0.5, requires_grad=True)
    (_AttachLoss.apply(out, loss) * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert loss.grad.item() == 1.0
    torch.testing.assert_close(out.grad, torch.tensor([1.0, 2.0, 3.0]))


def compiled_and_checkpointed(rank, world, store):
    """One rank: compile (fullgraph, so a graph break fails: whole blocks, the MoE ones too),
    activation checkpointing, and both (the MoE layer then stays eager) give the eager model's
    loss and gradients."""
    from moe.parallel import llama_loss, parallelize_llama

    init(rank, world, store)
    cfg = L.config("topk")
    tokens, targets = L.data(cfg, 0)
    eager = L.build(cfg)
    llama_loss(eager, eager(tokens), targets).backward()
    mesh = _mesh((1,), ("dp_shard",))
    traced = {"backend": "aot_eager", "fullgraph": True}
    both = dict(compile=traced, activation_checkpoint=True)
    for options in (dict(compile=traced), dict(activation_checkpoint=True), both):
        torch._dynamo.reset()  # each model compiles the blocks' forwards anew
        model = parallelize_llama(L.build(cfg), mesh, **options)
        calls = []
        # a side effect in a checkpoint traced whole would fail: with both, watch the MoE block
        # (checkpointed eagerly, its attention compiled)
        watched = next(b for b in model.layers.values() if b.is_moe) if options is both else model.layers["0"]
        watched.attention.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        loss = llama_loss(model, model(tokens), targets)
        loss.backward()
        expect = {n: p.grad for n, p in eager.named_parameters()}
        L.check_params(f"{options} gradient of", {n: p.grad for n, p in model.named_parameters()}, expect)
        for block in model.layers.values():
            whole = getattr(block, "_compiled_call_impl", None) is not None
            parts = getattr(block.attention, "_compiled_call_impl", None) is not None
            if block.is_moe and options is both:  # a checkpointed MoE block: attention and norms only
                assert not whole and parts, options
            else:
                assert whole == ("compile" in options) and not parts, options
        assert any(block.is_moe for block in model.layers.values())
        assert len(calls) == (2 if "activation_checkpoint" in options else 1), (options, calls)  # re-run in backward


def test_compile_and_activation_checkpointing():
    spawn(compiled_and_checkpointed, 1)
