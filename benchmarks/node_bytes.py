"""Bytes between nodes per token: the flat expert-parallel dispatcher against the two-level one
(`moe.parallel.HierarchicalDispatcher`), for `benchmarks.all_to_all --hierarchical`.

    python -m benchmarks.all_to_all --hierarchical                    # the counts, one process
    torchrun --nproc-per-node 4 -m benchmarks.all_to_all --hierarchical --ranks-per-node 2   # + gloo times

Counts: the real router (top-k, or group-limited top-k with a group per node, M groups per
token) on random inputs and weights (seed 0), T tokens split evenly over N nodes. Per token and
forward, what crosses between nodes (out and back):
- flat: one D-vector per kept slot whose expert is on another node, out, and one back;
- two-level: one (D + K)-vector (the token and its gates for that node) plus K int64 expert ids
  per distinct other node hosting at least one of its experts, out, and one D-vector back.
The expected counts under uniform routing are printed beside them. No timing is involved, so
the counts are exact for the seed.

Times (under torchrun, gloo on CPU, indicative only): one MoE layer's forward + backward with
each dispatcher, the ep group laid out as nodes x ``--ranks-per-node``.
"""

from __future__ import annotations

import copy
from math import comb

import torch

from moe import MoE, MoEConfig
from moe.plan.dispatch_time import expected_nodes

# (name, experts, top-k, nodes, node limit M or None, model dim D)
SHAPES = [
    ("top-2 of 8 experts, 2 nodes", 8, 2, 2, None, 4096),
    ("top-8 of 256 experts, 8 nodes", 256, 8, 8, None, 7168),
    ("top-8 of 256 experts, 8 nodes, M=4", 256, 8, 8, 4, 7168),
]
ELEMENT = 2  # bf16 activations on the wire


def _uniform(experts: int, k: int, nodes: int, limit: int | None) -> tuple[float, float]:
    """Expected (other-node slots, distinct other nodes) per token when the K experts (within
    M uniformly chosen nodes, under a limit) are uniform without replacement."""
    per_node = experts // nodes
    if limit is None:  # the planner's expectation
        return k * (nodes - 1) / nodes, expected_nodes(experts, k, nodes) * (nodes - 1) / nodes
    pool = per_node * limit  # the K experts come from the M chosen nodes' experts
    hit = 1 - comb(pool - per_node, k) / comb(pool, k)
    away = (nodes - 1) / nodes  # a chosen node is another node with this chance
    return k * away, limit * away * hit


def node_counts(experts: int, k: int, nodes: int, limit: int | None, tokens: int = 8192) -> dict:
    torch.manual_seed(0)
    options = {"n_groups": nodes, "topk_groups": limit} if limit is not None else {}
    layer = MoE(MoEConfig(dim=64, hidden_dim=8, num_experts=experts, top_k=k, router="topk", router_options=options))
    with torch.no_grad():
        idx_TK = layer.router(torch.randn(tokens, 64)).expert_idx
    node_TK = idx_TK // (experts // nodes)
    home_T = torch.arange(tokens) * nodes // tokens  # contiguous blocks of tokens per node
    away_TK = node_TK != home_T.unsqueeze(1)
    hit_TN = torch.zeros(tokens, nodes, dtype=torch.bool).scatter_(1, node_TK, True)
    hit_TN[torch.arange(tokens), home_T] = False
    flat, two_level = away_TK.sum(1).double().mean().item(), hit_TN.sum(1).double().mean().item()
    most = int(torch.zeros(tokens, nodes, dtype=torch.bool).scatter_(1, node_TK, True).sum(1).max())
    return {"flat_vectors": flat, "two_level_vectors": two_level, "max_nodes": most}


def rows(shapes=SHAPES, tokens: int = 8192) -> list[dict]:
    out = []
    for name, experts, k, nodes, limit, dim in shapes:
        got = node_counts(experts, k, nodes, limit, tokens)
        flat_bytes = 2 * got["flat_vectors"] * dim * ELEMENT
        two_bytes = got["two_level_vectors"] * ((dim + k) * ELEMENT + 8 * k + dim * ELEMENT)
        u_flat, u_two = _uniform(experts, k, nodes, limit)
        out.append(
            dict(name=name, dim=dim, tokens=tokens, **got, flat_bytes=flat_bytes, two_level_bytes=two_bytes,
                 ratio=flat_bytes / two_bytes, uniform_flat=u_flat, uniform_two_level=u_two)
        )  # fmt: skip
    return out


def markdown(table: list[dict], times: list[dict] | None = None) -> str:
    lines = [
        "| shape | D | flat: vectors out per token | two-level: nodes per token | most nodes a token reaches "
        "| flat bytes per token | two-level bytes per token | flat / two-level |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['name']} | {r['dim']} | {r['flat_vectors']:.3f} (uniform {r['uniform_flat']:.3f}) "
        f"| {r['two_level_vectors']:.3f} (uniform {r['uniform_two_level']:.3f}) | {r['max_nodes']} "
        f"| {r['flat_bytes']:,.0f} | {r['two_level_bytes']:,.0f} | {r['ratio']:.2f}x |"
        for r in table
    ]
    if times:
        lines += [
            "",
            "| layer | ranks | nodes x ranks per node | flat (ms) | two-level (ms) |",
            "|---|---:|---|---:|---:|",
        ]
        lines += [
            f"| {t['shape']} | {t['world']} | {t['layout']} | {t['ms_flat']:.2f} | {t['ms_two_level']:.2f} |"
            for t in times
        ]
    return "\n".join(lines)


def gloo_times(ranks_per_node: int, repeats: int, time_fn, tokens: int = 2048, dim: int = 256) -> list[dict]:
    """Forward + backward of one layer (top-2 of 8 experts, and top-8 of 32 with a group per
    node and M=2), flat against two-level, under the current process group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from moe.parallel import parallelize_moe

    world = dist.get_world_size()
    nodes = world // ranks_per_node
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    out = []
    for experts, k, limit in ((8, 2, None), (32, 8, 2)):
        options = {"n_groups": nodes, "topk_groups": limit} if limit is not None else {}
        torch.manual_seed(0)
        cfg = MoEConfig(
            dim=dim, hidden_dim=2 * dim, num_experts=experts, top_k=k, router="topk", router_options=options
        )
        base = MoE(cfg)
        x = torch.randn(tokens, dim, generator=torch.Generator().manual_seed(dist.get_rank()), requires_grad=True)
        fns = {}
        for kind in ("flat", "hierarchical"):
            layer = parallelize_moe(copy.deepcopy(base), mesh, dispatch=kind, ranks_per_node=ranks_per_node)
            fns[kind] = lambda layer=layer, x=x: layer(x).sum().backward()
        ms = time_fn(fns, repeats)
        shape = f"top-{k} of {experts}" + (f", M={limit}" if limit is not None else "")
        out.append(dict(shape=f"{shape}, {tokens}x{dim} per rank", world=world, layout=f"{nodes} x {ranks_per_node}",
                        ms_flat=ms["flat"] * 1e3, ms_two_level=ms["hierarchical"] * 1e3))  # fmt: skip
    return out
