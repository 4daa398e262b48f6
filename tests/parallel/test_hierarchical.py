"""The two-level dispatcher over gloo, 4 ranks as 2 nodes x 2: the flat dispatcher's outputs and
every gradient for top-k, group-limited top-k (a group per node), BASE and global BASE, with a
rank that has no tokens and a node that receives nothing; the rows sent between nodes are the
deduplicated count; a failing rank fails every rank; bad arguments raise; the same in 2-4
overlapped chunks, with no more host reads. One launch."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from moe import MoE, MoEConfig, aux_loss
from moe.parallel import FlatDispatcher, HierarchicalDispatcher, parallelize_moe

from ..host_reads import HostReads
from .launch import check_nan_on_one_rank, init, spawn

pytestmark = pytest.mark.distributed
TOL = dict(rtol=1e-5, atol=1e-6)
NODES, PER_NODE, E = 2, 2, 8
CASES = {
    "topk": dict(router="topk", top_k=2, aux_loss_coef=0.01, z_loss_coef=1e-3),
    "topk-dropping": dict(router="topk", top_k=2, capacity_factor=1.0),
    "grouped": dict(router="topk", top_k=2, router_options={"n_groups": NODES, "topk_groups": 1}),
    "base": dict(router="base", top_k=2),
    "base-global": dict(router="base", top_k=1, combine="sigmoid_residual", num_shared_experts=1),
}


def build(case: str, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    return MoE(MoEConfig(dim=8, hidden_dim=12, num_experts=E, **CASES[case]))


def tokens_of(case: str, rank: int, n: int) -> torch.Tensor:
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(1000 * len(case) + 17 * rank + n))


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def internode_pairs(expert_idx: torch.Tensor, node: int) -> int:
    """Sum over tokens of the distinct nodes of their kept slots, the token's own node left out."""
    nodes = torch.where(expert_idx >= 0, expert_idx // (E // NODES), -1)
    hit = torch.zeros(expert_idx.shape[0], NODES, dtype=torch.bool)
    for k in range(nodes.shape[1]):
        kept = nodes[:, k] >= 0
        hit[kept.nonzero().squeeze(1), nodes[kept, k]] = True
    hit[:, node] = False
    return int(hit.sum())


def check_same_as_flat(
    mesh, case: str, tokens: list[int], *, away_from: int | None = None, ranks_per_node: int | None = None, **options
) -> tuple[int, int]:
    """Outputs, x.grad and every parameter's (local) gradient equal the flat dispatcher's on the
    same rank; the rows sent between nodes are the deduplicated count, returned with the
    flat dispatcher's (one per kept slot on another node). ``away_from``: a node
    whose experts no token chooses (a selection bias), so it receives nothing."""
    rank = dist.get_rank()
    ranks_per_node = ranks_per_node or PER_NODE
    base = build(case)
    if away_from is not None:
        with torch.no_grad():
            base.router.bias[away_from * E // NODES : (away_from + 1) * E // NODES] = -1e4
    x_in = tokens_of(case, rank, tokens[rank])
    scale = torch.linspace(-1, 1, 8)
    results = {}
    for dispatch in ("flat", "hierarchical"):
        layer = parallelize_moe(copy.deepcopy(base), mesh, dispatch=dispatch, ranks_per_node=ranks_per_node, **options)
        assert isinstance(layer.dispatcher, FlatDispatcher)
        assert isinstance(layer.dispatcher, HierarchicalDispatcher) == (dispatch == "hierarchical")
        assert getattr(layer.dispatcher, "chunks", 1) == options.get("chunks", 1)
        x = x_in.clone().requires_grad_()
        y = layer(x)
        ((y * scale).sum() + aux_loss(layer)).backward()
        grads = {name: local(p.grad).clone() for name, p in layer.named_parameters()}
        results[dispatch] = (y.detach(), x.grad, grads, layer)
    (y_flat, gx_flat, g_flat, _), (y, gx, g, layer) = results["flat"], results["hierarchical"]
    torch.testing.assert_close(y, y_flat, **TOL, msg=lambda m: f"{case} output: {m}")
    torch.testing.assert_close(gx, gx_flat, **TOL, msg=lambda m: f"{case} x.grad: {m}")
    assert g.keys() == g_flat.keys() and {"router.weight", "experts.w1", "experts.w2", "experts.w3"} <= g.keys()
    for name, grad in g.items():
        torch.testing.assert_close(grad, g_flat[name], **TOL, msg=lambda m, n=name: f"{case} {n}.grad: {m}")
    node = dist.get_rank(layer.dispatcher.ep_group) // ranks_per_node
    expect = internode_pairs(layer.last_routing.expert_idx, node)
    assert layer.dispatcher.last_internode_rows == expect, (case, layer.dispatcher.last_internode_rows, expect)
    if away_from is not None:  # nothing reached that node: its experts got no gradient
        ranks = range(away_from * ranks_per_node, (away_from + 1) * ranks_per_node)
        if rank in ranks:
            assert not g["experts.w1"].any()
    idx = layer.last_routing.expert_idx
    return expect, int(((idx // (E // NODES) != node) & (idx >= 0)).sum())


def check_dedup_saves(mesh) -> None:
    """Top-2 over 8 experts on 2 nodes: summed over the ranks, fewer rows cross between nodes
    than the flat dispatcher's one per (token, slot) on another node."""
    dedup, per_slot = check_same_as_flat(mesh, "topk", [9, 0, 7, 5])
    total = torch.tensor([dedup, per_slot])
    dist.all_reduce(total)
    assert 0 < total[0] < total[1], total


def check_no_new_host_reads(mesh) -> None:
    """The two-level dispatcher, in one piece or in chunks, reads its splits back from the
    device once per forward (after its one count exchange), and in all no more than the flat
    one (the other reads are the router's); nothing in the backward."""
    x = tokens_of("topk", dist.get_rank(), 7).requires_grad_()
    reads = {}
    for dispatch, chunks in (("flat", 1), ("hierarchical", 1), ("hierarchical", 3)):
        layer = parallelize_moe(build("topk"), mesh, dispatch=dispatch, ranks_per_node=PER_NODE, chunks=chunks)
        with HostReads(x, *layer.parameters()) as seen:
            y = layer(x)
        with HostReads(x, *layer.parameters()) as seen_back:
            (y * torch.linspace(-1, 1, 8)).sum().backward()
        reads[dispatch, chunks] = seen.reads, seen_back.reads
    flat, _ = reads["flat", 1]
    for key in (("hierarchical", 1), ("hierarchical", 3)):
        forward, backward = reads[key]
        assert forward.count("Tensor.tolist") == 1 and not backward, (key, reads)  # the splits, once
        assert len(forward) <= len(flat) and set(forward) <= set(flat), (key, reads)  # the rest: the router's


def check_failing_rank(mesh, chunks: int = 1) -> None:
    """A rank whose input cannot be routed (NaN) raises, and so do the others; the group stays usable."""
    layer = parallelize_moe(build("topk"), mesh, dispatch="hierarchical", ranks_per_node=PER_NODE, chunks=chunks)
    check_nan_on_one_rank(layer, lambda: tokens_of("topk", dist.get_rank(), 5), bad_rank=2)


def check_bad_arguments(mesh) -> None:
    with pytest.raises(ValueError, match="ranks_per_node=3 must divide the ep size, 4"):
        parallelize_moe(build("topk"), mesh, dispatch="hierarchical", ranks_per_node=3)
    with pytest.raises(ValueError, match="ranks_per_node must be a positive int"):
        parallelize_moe(build("topk"), mesh, dispatch="hierarchical", ranks_per_node=0)
    with pytest.raises(ValueError, match="dispatch must be one of"):
        parallelize_moe(build("topk"), mesh, dispatch="tree")
    with pytest.raises(ValueError, match="has no static path .* got static_splits=True"):
        parallelize_moe(build("base"), mesh, dispatch="hierarchical", ranks_per_node=2, static_splits=True)
    auto = parallelize_moe(build("topk"), mesh, dispatch="auto", ranks_per_node=PER_NODE)
    assert type(auto.dispatcher) is HierarchicalDispatcher
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    one_node = parallelize_moe(build("topk"), mesh, dispatch="auto")  # no LOCAL_WORLD_SIZE: one node
    assert type(one_node.dispatcher) is FlatDispatcher
    os.environ["LOCAL_WORLD_SIZE"] = str(PER_NODE)  # as torchrun sets it
    from_env = parallelize_moe(build("topk"), mesh, dispatch="auto")
    assert type(from_env.dispatcher) is HierarchicalDispatcher and from_env.dispatcher.ranks_per_node == PER_NODE
    os.environ["LOCAL_WORLD_SIZE"] = "4" if dist.get_rank() == 3 else "2"  # rank 3 would see one node
    with pytest.raises(ValueError, match="disagree"):
        parallelize_moe(build("topk"), mesh, dispatch="auto")
    # ep outermost: the ep group {0, 2} (or {1, 3}) has one rank on each node of 2 ranks
    ep_dp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "dp"))
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    strided = parallelize_moe(build("topk"), ep_dp, dispatch="auto")
    assert type(strided.dispatcher) is HierarchicalDispatcher and strided.dispatcher.ranks_per_node == 1
    os.environ["LOCAL_WORLD_SIZE"] = "3"  # ranks 0-2 and 3: {0, 2} shares a node, {1, 3} does not
    with pytest.raises(ValueError, match="disagree"):
        parallelize_moe(build("topk"), ep_dp, dispatch="hierarchical")
    os.environ["LOCAL_WORLD_SIZE"] = "3"  # ranks 0-2 on one node, 3 on another: ep rank 3 alone
    with pytest.raises(ValueError, match=r"not whole nodes of consecutive ep ranks .* nodes \[0, 0, 0, 1\]"):
        parallelize_moe(build("topk"), mesh, dispatch="hierarchical")
    del os.environ["LOCAL_WORLD_SIZE"]


def worker(rank: int, world: int, store: str) -> None:
    init(rank, world, store)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        check_dedup_saves(mesh)
        check_same_as_flat(mesh, "topk-dropping", [6, 6, 0, 4], dispatch_strategy="resort")
        check_same_as_flat(mesh, "grouped", [6, 3, 0, 8])
        check_same_as_flat(mesh, "grouped", [5, 4, 7, 6], away_from=1)  # node 1 receives nothing
        check_same_as_flat(mesh, "base", [6, 6, 5, 8])
        check_same_as_flat(mesh, "base", [8, 0, 6, 6], dispatch_strategy="resort")
        check_same_as_flat(mesh, "base-global", [5, 0, 6, 3], global_base=True)
        check_same_as_flat(mesh, "topk-dropping", [6, 1, 0, 4], chunks=2)  # both in chunks: fewer rows than chunks
        check_same_as_flat(mesh, "grouped", [5, 4, 7, 6], away_from=1, chunks=3)
        check_same_as_flat(mesh, "base-global", [5, 0, 6, 3], global_base=True, chunks=4)
        check_failing_rank(mesh)
        check_failing_rank(mesh, chunks=2)
        check_no_new_host_reads(mesh)
        check_bad_arguments(mesh)
        dp_ep = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))  # ep groups {0, 1}, {2, 3}
        check_same_as_flat(dp_ep, "topk", [4, 7, 0, 5], ranks_per_node=1)  # two nodes of one rank
        check_same_as_flat(dp_ep["ep"], "base", [6, 3, 5, 0], ranks_per_node=1)  # a slice, as parallelize_llama's
        ep_etp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "etp"))  # ep groups {0, 2}, {1, 3}
        check_same_as_flat(ep_etp, "topk", [5, 3, 0, 6], ranks_per_node=1, etp="etp")  # experts sharded over F
        check_same_as_flat(ep_etp, "base-global", [4, 6, 2, 0], ranks_per_node=1, etp="etp", global_base=True, chunks=2)
    finally:
        dist.destroy_process_group()


def test_hierarchical_matches_flat():
    spawn(worker, NODES * PER_NODE)


def worker_8(rank: int, world: int, store: str, nodes: int) -> None:
    """8 ranks as ``nodes`` x 8 / nodes: the module's layout constants set for this process."""
    global NODES, PER_NODE
    NODES, PER_NODE = nodes, world // nodes
    CASES["grouped"] = dict(CASES["grouped"], router_options={"n_groups": nodes, "topk_groups": 1})
    init(rank, world, store)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        dedup, per_slot = check_same_as_flat(mesh, "topk", [9, 0, 7, 5, 3, 6, 1, 8])
        assert dedup <= per_slot
        check_same_as_flat(mesh, "topk-dropping", [6, 6, 0, 4, 5, 2, 7, 3], dispatch_strategy="resort")
        check_same_as_flat(mesh, "grouped", [6, 3, 0, 8, 2, 5, 4, 7])
        check_same_as_flat(mesh, "grouped", [5, 4, 7, 6, 3, 3, 2, 9], away_from=nodes - 1)  # a node receives nothing
        check_same_as_flat(mesh, "base", [6, 6, 5, 8, 0, 4, 3, 7])
        check_same_as_flat(mesh, "base-global", [5, 0, 6, 3, 4, 4, 2, 1], global_base=True)
        check_same_as_flat(mesh, "grouped", [6, 3, 0, 8, 2, 5, 4, 7], chunks=2)
        check_failing_rank(mesh)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [2, 4], ids=["2x4", "4x2"])
def test_hierarchical_matches_flat_on_8_ranks(nodes):
    spawn(worker_8, 8, nodes)
