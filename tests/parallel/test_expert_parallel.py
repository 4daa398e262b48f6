"""parallelize_moe over gloo: EP=2, EP=4, EP=2 x ETP=2 and DP=2 x EP=2 give the single-process
layer's outputs and gradients for every router; BASE's static splits skip the count exchange;
global BASE balances over the group; ranks that disagree fail; checkpoints move between EP sizes.

The reference for a rank is the unparallelised layer applied to the tokens routed together with
that rank's (its own, or its etp group's under expert-tensor parallelism)."""

import contextlib
import copy
import importlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from moe import MoE, MoEConfig, aux_loss
from moe.kernels import permute
from moe.parallel import FlatDispatcher, parallelize_moe, reduce_gradients
from moe.routing import expert_capacities

from ..host_reads import HostReads
from .launch import check_nan_on_one_rank, init, spawn

pytestmark = pytest.mark.distributed
a2a_module = importlib.import_module("moe.parallel.all_to_all")  # the module, not the function

CASES = {
    "base": dict(router="base", top_k=1, combine="sigmoid_residual", num_shared_experts=1),
    "base-k2": dict(router="base", top_k=2),
    "base-approx": dict(router="base", top_k=2, router_options={"base_solver": "approx"}),
    "topk": dict(router="topk", top_k=2, aux_loss_coef=0.01, z_loss_coef=1e-3, capacity_factor=1.0),
    "topk-bias": dict(router="topk", top_k=2, router_options={"score_func": "sigmoid", "bias_update_rate": 0.01}),
    "sinkhorn": dict(router="sinkhorn", top_k=1, aux_loss_coef=0.01),
    "expert_choice": dict(router="expert_choice", top_k=2),
}
TOL = dict(rtol=1e-5, atol=1e-6)


def build(case: str, seed: int = 0, extras: str | None = None, **overrides) -> MoE:
    """``extras``: BASE's ``base_extras`` ("lowest" for static_splits, which needs it)."""
    torch.manual_seed(seed)
    options = dict(CASES[case])
    if extras is not None:
        options["router_options"] = {**options.get("router_options", {}), "base_extras": extras}
    return MoE(MoEConfig(**{"dim": 8, "hidden_dim": 12, "num_experts": 4, **options, **overrides}))


def tokens_of(case: str, rank: int, n: int) -> torch.Tensor:
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(1000 * len(case) + 17 * rank + n))


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def check_layer(case: str, mesh, tokens: list[int], etp: str | None = None, **options) -> None:
    """Outputs, input and parameter gradients of the parallel layer equal the reference's."""
    rank = dist.get_rank()
    layer = build(case, extras="lowest" if options.get("static_splits") and case.startswith("base") else None)
    ref = copy.deepcopy(layer)
    parallelize_moe(layer, mesh, etp=etp, **options)
    assert isinstance(layer.dispatcher, FlatDispatcher) and layer.parallel is layer.dispatcher
    assert list(layer.state_dict()) == list(ref.state_dict())  # the dispatcher holds no state
    group = dist.get_process_group_ranks(mesh.get_group(etp)) if etp else [rank]
    blocks = [tokens_of(case, r, tokens[r]) for r in group]
    start = sum(tokens[r] for r in group[: group.index(rank)])
    scale = torch.linspace(-1, 1, 8)

    x_full = torch.cat(blocks).requires_grad_()
    y_full = ref(x_full)
    ((y_full * scale).sum() + aux_loss(ref)).backward()
    x = blocks[group.index(rank)].clone().requires_grad_()
    y = layer(x)
    ((y * scale).sum() + aux_loss(layer)).backward()

    mine = slice(start, start + tokens[rank])
    torch.testing.assert_close(y, y_full[mine], **TOL, msg=lambda m: f"{case} output: {m}")
    torch.testing.assert_close(x.grad, x_full.grad[mine], **TOL, msg=lambda m: f"{case} x.grad: {m}")
    reduce_gradients(layer, mesh, op="sum")
    params = dict(layer.named_parameters())
    for name, p in ref.named_parameters():
        expect = p.grad.clone()
        dist.all_reduce(expect)
        expect /= len(group)  # the ranks of a group computed the same reference
        got = full(params[name].grad)
        torch.testing.assert_close(got, expect, **TOL, msg=lambda m, n=name: f"{case} {n}.grad: {m}")
    if case == "topk-bias":  # the bias moved by the loads summed over every rank
        load = torch.bincount(ref.last_routing.expert_idx.flatten(), minlength=4).float()
        slots = torch.tensor([float(ref.last_routing.expert_idx.numel())])
        dist.all_reduce(load)
        dist.all_reduce(slots)
        expect = 0.01 * torch.sign(slots / 4 - load)
        torch.testing.assert_close(layer.router.bias, expect, msg=lambda m: f"bias: {m}")


@contextlib.contextmanager
def counting_all_to_all():
    """Record (dtype, numel) of every all-to-all moe.parallel issues (functional or in place)."""
    calls = []
    functional, in_place = a2a_module.all_to_all_single_autograd, dist.all_to_all_single

    def counted_functional(x, *args, **kwargs):
        calls.append((x.dtype, x.numel()))
        return functional(x, *args, **kwargs)

    def counted_in_place(out, x, *args, **kwargs):
        calls.append((x.dtype, x.numel()))
        return in_place(out, x, *args, **kwargs)

    a2a_module.all_to_all_single_autograd, dist.all_to_all_single = counted_functional, counted_in_place
    try:
        yield calls
    finally:
        a2a_module.all_to_all_single_autograd, dist.all_to_all_single = functional, in_place


def check_static_splits(mesh) -> None:
    """BASE with static splits: the count exchange (E int64) is gone, replaced by the W token
    counts that check the promise; the rows move as before, the numbers are the same."""
    for case, n in (("base-k2", 6), ("base", 5), ("base-approx", 5)):  # 5 or 6 tokens on 4 experts: uneven loads
        x = tokens_of(case, dist.get_rank(), n)
        outputs, calls = {}, {}
        for static in (False, True):
            layer = parallelize_moe(build(case, extras="lowest"), mesh, static_splits=static)
            with counting_all_to_all() as calls[static]:
                outputs[static] = layer(x)
        world = dist.get_world_size()
        assert [c for c in calls[False] if c[0] == torch.int64] == [(torch.int64, 4)], calls
        assert [c for c in calls[True] if c[0] == torch.int64] == [(torch.int64, world)], calls
        rows = {static: [c for c in calls[static] if c[0] != torch.int64] for static in calls}
        assert rows[False] == rows[True], calls
        torch.testing.assert_close(outputs[True], outputs[False], rtol=0, atol=0)
        check_layer(case, mesh, [n] * dist.get_world_size(), static_splits=True)


def check_static_path_reads_nothing(mesh) -> None:
    """The static path with the sync-free solver reads no value back on the host, forward and
    backward; the counted path and the exact solver do (so the check can see reads)."""
    x = tokens_of("base-approx", dist.get_rank(), 6).requires_grad_()
    for case, k, static, silent in (
        ("base-approx", 2, True, True),
        ("base-approx", 1, True, True),
        ("base-approx", 2, False, False),
        ("base-k2", 2, True, False),
    ):
        layer = parallelize_moe(build(case, extras="lowest", top_k=k), mesh, static_splits=static)
        with HostReads(x, *layer.parameters()) as seen:
            (layer(x) * torch.linspace(-1, 1, 8)).sum().backward()
        assert (seen.reads == []) == silent, (case, k, static, seen.reads)


def check_global_base(mesh, tokens: list[int]) -> None:
    """Global BASE: every expert gets exactly its share of the group's tokens; the result is the
    single-process layer's on all the group's tokens. The router config's ``base_round_bytes``
    reaches the solver (it decides which collectives run, so the config check keeps it alike)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for case, round_bytes in (("base", 0.0), ("base-k2", 1.25e6)):
        layer = build(case, router_options={"base_round_bytes": round_bytes})
        ref = copy.deepcopy(layer)
        parallelize_moe(layer, mesh, global_base=True)
        assert layer.router.assign.round_bytes == round_bytes
        blocks = [tokens_of(case, r, tokens[r]) for r in range(world)]
        y = layer(blocks[rank])
        y_ref = ref(torch.cat(blocks))
        start = sum(tokens[:rank])
        torch.testing.assert_close(y, y_ref[start : start + tokens[rank]], **TOL)
        counts = layer.last_routing.counts.clone()
        dist.all_reduce(counts)
        k = layer.config.top_k
        # exact balance over the group; which experts take the extra tokens follows the scores
        assert torch.equal(counts.sort(descending=True).values, expert_capacities(sum(tokens), 4, k)), (case, counts)


def check_global_base_reruns(mesh) -> None:
    """Activation checkpointing with global BASE, three micro-batches' forwards before their
    backwards (a pipeline schedule's order), two steps: the same outputs and gradients as
    without checkpointing. The router's first two experts score alike, so every token ties
    between them, and a re-run solved from another start than its forward's routes otherwise."""
    from torch.utils.checkpoint import checkpoint

    rank = dist.get_rank()
    scale = torch.linspace(-1, 1, 8)
    got = {}
    for checkpointed in (False, True):
        layer = build("base-k2")
        with torch.no_grad():
            layer.router.weight[1] = layer.router.weight[0]
        parallelize_moe(layer, mesh, global_base=True)
        run = (lambda x, layer=layer: checkpoint(layer, x, use_reentrant=False)) if checkpointed else layer
        for step in range(2):
            xs = [tokens_of("tied", rank, 10 + 3 * m + step).requires_grad_() for m in range(3)]
            ys = [run(x) for x in xs]
            for y in ys:
                (y * scale).sum().backward()
            got[checkpointed, step] = [*ys, *(x.grad for x in xs), *(p.grad.clone() for p in layer.parameters())]
            layer.zero_grad()
    for step in range(2):
        for a, b in zip(got[True, step], got[False, step], strict=True):
            torch.testing.assert_close(a, b, **TOL)


def check_disagreement(mesh) -> None:
    """A rank with another configuration: every rank raises, none hangs."""
    layer = build("topk", hidden_dim=12 if dist.get_rank() == 0 else 16)
    with pytest.raises(ValueError, match="disagree.*hidden_dim"):
        parallelize_moe(layer, mesh)
    with pytest.raises(ValueError, match="static_splits"):
        parallelize_moe(build("topk"), mesh, static_splits=dist.get_rank() == 1)


def worker_ep2(rank: int, world: int, store: str) -> None:
    init(rank, world, store)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
        for case in CASES:
            for tokens in ([7, 3], [5, 0]):  # uneven; a rank without tokens
                check_layer(case, mesh, tokens)  # "auto": per_expert on CPU
            check_layer(case, mesh, [7, 3], dispatch_strategy="resort")
        check_static_splits(mesh)
        check_static_path_reads_nothing(mesh)
        check_global_base(mesh, [7, 3])
        check_global_base_reruns(mesh)
        check_disagreement(mesh)
        check_bad_arguments(mesh)
        check_training(mesh, [6, 3])
        check_hf_llama(mesh)
        check_failing_rank(mesh)
        check_promises_and_missing_grads(mesh)
    finally:
        dist.destroy_process_group()


def worker_ep4(rank: int, world: int, store: str) -> None:
    init(rank, world, store)
    try:
        ep4 = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        ep_etp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "etp"))
        dp_ep = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        for case in CASES:
            check_layer(case, ep4, [5, 0, 3, 6])
            check_layer(case, ep_etp, [4, 3, 0, 5], etp="etp")
            check_layer(case, dp_ep, [2, 5, 4, 1])
        check_layer("base-k2", ep_etp, [4, 4, 4, 4], etp="etp", static_splits=True)
        check_layer("topk", ep4, [5, 0, 3, 6], dispatch_strategy="resort")
        check_disagreement_2d(dp_ep)
        from .test_failures import check_etp  # here, not above: that module imports this one

        check_etp(ep_etp)
    finally:
        dist.destroy_process_group()


def test_ep2_every_router():
    spawn(worker_ep2, 2)


def test_ep4_etp_and_dp_every_router():
    spawn(worker_ep4, 4)


def worker_checkpoint(rank: int, world: int, store: str, path: str) -> None:
    init(rank, world, store)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        if world == 2:  # save at EP=2, and what was saved, gathered whole, beside it
            layer = parallelize_moe(build("topk-bias"), mesh)
            layer(tokens_of("topk-bias", rank, 6))  # moves the bias buffer too
            dcp.save(layer.state_dict(), checkpoint_id=path)
            expect = {name: full(value).clone() for name, value in layer.state_dict().items()}
            if rank == 0:
                torch.save(expect, os.path.join(path, "expect.pt"))
        else:  # load at EP=4 into a layer built from another seed
            layer = parallelize_moe(build("topk-bias", seed=1), mesh)
            state = layer.state_dict()
            dcp.load(state, checkpoint_id=path)
            expect = torch.load(os.path.join(path, "expect.pt"))
            for name, value in layer.state_dict().items():
                torch.testing.assert_close(full(value), expect[name], rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # EP=1 loads without a group, on purpose
def test_checkpoint_moves_between_ep_sizes(tmp_path):
    path = str(tmp_path / "ckpt")
    spawn(worker_checkpoint, 2, path)
    expect = torch.load(os.path.join(path, "expect.pt"))
    assert expect["router.bias"].abs().sum() > 0  # the step moved the bias before the save
    # EP=1: one process, no process group, plain tensors
    layer = build("topk-bias", seed=1)
    state = layer.state_dict()
    dcp.load(state, checkpoint_id=path, no_dist=True)
    assert state.keys() == expect.keys()
    for name, value in layer.state_dict().items():
        torch.testing.assert_close(value, expect[name], rtol=0, atol=0)
    spawn(worker_checkpoint, 4, path)


def check_training(mesh, tokens: list[int]) -> None:
    """Three AdamW steps of a small model around a parallelised MoE equal three steps of the same
    model on one process over every rank's tokens (the loss summed over ranks)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for case in ("base", "topk"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), build(case), torch.nn.Linear(8, 8))
        ref = copy.deepcopy(model)
        parallelize_moe(model, mesh)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
        for step in range(3):
            batches = [tokens_of(case, 10 * step + r, tokens[r]) for r in range(world)]
            for opt in opts:
                opt.zero_grad()
            (model(batches[rank]).square().mean() + aux_loss(model)).backward()
            reduce_gradients(model, mesh, op="sum")
            for batch in batches:  # the reference sees every rank's batch, one routing each
                (ref(batch).square().mean() + aux_loss(ref)).backward()
            for opt in opts:
                opt.step()
        params = dict(model.named_parameters())
        for name, p in ref.named_parameters():
            torch.testing.assert_close(full(params[name].detach()), p.detach(), rtol=1e-4, atol=1e-5)


def check_hf_llama(mesh) -> None:
    """A MoE-ified transformers Llama (two MoE layers, the aux loss added by its hook) trained
    one step with parallelize_moe: each rank's loss and the reduced gradients equal the
    single-process model's on the same batches."""
    pytest.importorskip("transformers", reason="needs the hf extra")
    from transformers import LlamaConfig, LlamaForCausalLM

    from moe.adapters import hf

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    hf.moeify(model, MoEConfig(dim=32, hidden_dim=48, num_experts=4, top_k=2, aux_loss_coef=0.01), noise=0.05)
    model.train()
    ref = copy.deepcopy(model)
    parallelize_moe(model, mesh)
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(r)) for r in range(world)]
    loss = model(batches[rank], labels=batches[rank]).loss
    loss.backward()
    reduce_gradients(model, mesh, op="sum")
    ref_losses = [ref(ids, labels=ids).loss for ids in batches]
    sum(ref_losses).backward()
    torch.testing.assert_close(loss, ref_losses[rank], rtol=1e-5, atol=1e-6)
    params = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        got = full(params[name].grad)
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def check_disagreement_2d(mesh) -> None:
    """On a (dp, ep) mesh, one rank with another layer or another argument: every rank raises,
    also those whose own groups agree."""
    rank = dist.get_rank()
    with pytest.raises(ValueError, match="disagree"):
        parallelize_moe(build("topk", hidden_dim=16 if rank == 0 else 12), mesh)
    with pytest.raises(ValueError, match="disagree"):
        parallelize_moe(build("topk"), mesh, ep="bogus" if rank == 3 else "ep")


def check_failing_rank(mesh) -> None:
    """A rank whose input cannot be routed (NaN) raises, and so do the others, instead of waiting
    for it in the next collective: counted dispatch and global BASE."""
    cases = (("topk", {}), ("base", {"global_base": True}), ("base-approx", {}), ("base-approx", {"global_base": True}))
    for case, options in cases:
        layer = parallelize_moe(build(case), mesh, **options)
        check_nan_on_one_rank(layer, lambda c=case: tokens_of(c, dist.get_rank(), 5), bad_rank=1, at=(2, 3))


def check_bad_arguments(mesh) -> None:
    """Bad arguments raise ValueError naming the argument, on every rank alike."""
    with pytest.raises(ValueError, match="ep must name a dimension"):
        parallelize_moe(build("topk"), mesh, ep="experts")
    with pytest.raises(ValueError, match="different mesh dimensions"):
        parallelize_moe(build("topk"), mesh, etp="ep")
    with pytest.raises(ValueError, match="no MoE layer"):
        parallelize_moe(torch.nn.Linear(2, 2), mesh)
    with pytest.raises(ValueError, match="num_experts=3 must be divisible"):
        parallelize_moe(build("topk", num_experts=3), mesh)
    with pytest.raises(ValueError, match="global_base=True needs BASE"):
        parallelize_moe(build("topk"), mesh, global_base=True)
    for case in ("base", "base-approx"):  # the static path sends loads known from T alone
        with pytest.raises(ValueError, match="static_splits=True needs base_extras='lowest'.*got 'best'"):
            parallelize_moe(build(case), mesh, static_splits=True)
    parallelize_moe(build("base"), mesh, static_splits=True, global_base=True)  # counts exchanged: any rule
    layer = parallelize_moe(build("topk"), mesh)
    with pytest.raises(ValueError, match="already parallelised"):
        parallelize_moe(layer, mesh)
    with pytest.raises(ValueError, match="dispatch_strategy must be one of"):
        parallelize_moe(build("topk"), mesh, dispatch_strategy="fast")
    with pytest.raises(ValueError, match="op must be"):
        reduce_gradients(layer, mesh, op="mean")


def check_promises_and_missing_grads(mesh) -> None:
    """static_splits' counts are checked on the device; reduce_gradients leaves grad None where
    no rank has a gradient and counts a missing one as zero where another rank has one."""
    layer = parallelize_moe(build("base-k2", extras="lowest"), mesh, static_splits=True)
    x = tokens_of("base-k2", dist.get_rank(), 6)
    res = layer.router(x)
    xs, info = permute(x, layer.parallel.sort_key(res.expert_idx), num_experts=4)
    wrong = info.counts.flip(0) + torch.tensor([1, 0, 0, -1])  # not the balanced loads
    with pytest.raises(RuntimeError):
        layer.parallel.run_experts(layer, xs, wrong, res)

    model = torch.nn.ModuleDict({"moe": build("topk"), "unused": torch.nn.Linear(2, 2), "some": torch.nn.Linear(2, 2)})
    parallelize_moe(model, mesh)
    if dist.get_rank() == 0:  # only rank 0 uses "some"
        model["some"](torch.ones(1, 2)).sum().backward()
    reduce_gradients(model, mesh, op="sum")
    assert model["unused"].weight.grad is None
    torch.testing.assert_close(model["some"].weight.grad, torch.ones(2, 2))
