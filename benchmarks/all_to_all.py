"""All-to-all benchmark, in the manner of nccl-tests' alltoall, then the expert-parallel
dispatcher's overhead over the raw all-to-all of the same bytes.

    torchrun --nproc-per-node 2 -m benchmarks.all_to_all            # gloo on CPU, NCCL on GPUs
    torchrun --nproc-per-node 2 -m benchmarks.all_to_all --shapes 512x64 --max-bytes 4096   # quick
    torchrun --nproc-per-node 2 -m benchmarks.all_to_all --docs     # also rewrite docs/benchmarks.md

1. Sweep: ``all_to_all_single`` with even splits, total message size S bytes per rank.
   algbw = S / time; busbw = algbw * (W - 1) / W (each rank keeps 1/W of its data).
2. Dispatcher: T tokens x H hidden (each of ``--shapes``), E experts spread over the W ranks. Rows sorted by expert
   go out and come back: `moe.parallel.dispatch` + `combine` (count exchange, the all-to-all,
   the local re-sort or the per-expert exchange, and back) against two raw all-to-alls with the
   same splits. Routings: top-k (random scores, K=2, uneven loads, counted path) and BASE
   (balanced loads; counted and static-split paths); both dispatch strategies.
3. The static path's agreement (`moe.parallel.agreement`): the exchange of the W token counts
   that checks ``static_splits``' promise and carries failures, checked on the device (with the
   finiteness pass over the T x H tokens) or read on the host, beside the static path's
   dispatch + combine at the same shape.

Times are the median over repeats of the slowest rank.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from benchmarks.common import run_meta, timed_turns, write_section
from moe.parallel import combine, dispatch
from moe.parallel.agreement import Agreement, exchange_sizes
from moe.routing import expert_capacities


def _time(fns: dict, repeats: int, device: torch.device) -> dict[str, float]:
    """Median seconds of each function, on the slowest rank: the functions take turns, and every
    run starts together on every rank (an untimed barrier first)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    samples = timed_turns(fns, repeats, sync, before=dist.barrier)
    t = torch.tensor([samples[name] for name in fns], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # each run takes as long as its slowest rank
    return {name: float(t[i].median()) for i, name in enumerate(fns)}


def sweep(sizes: list[int], repeats: int, device: torch.device) -> list[dict]:
    world = dist.get_world_size()
    rows = []
    for size in sizes:
        n = max(size // 4 // world, 1) * world  # fp32 elements, divisible by the world size
        x = torch.randn(n, device=device)
        out = torch.empty_like(x)
        seconds = _time({"a2a": lambda x=x, out=out: dist.all_to_all_single(out, x)}, repeats, device)["a2a"]
        algbw = n * 4 / seconds / 1e9
        rows.append({"bytes": n * 4, "us": seconds * 1e6, "algbw": algbw, "busbw": algbw * (world - 1) / world})
    return rows


def _raw(x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
    """Out and back with the splits of a dispatch: the bytes the dispatcher must move."""
    out = x.new_empty(sum(recv), *x.shape[1:])
    dist.all_to_all_single(out, x, recv, send)
    back = torch.empty_like(x)
    dist.all_to_all_single(back, out, send, recv)
    return back


def dispatcher(tokens: int, hidden: int, experts: int, dtype, repeats: int, device: torch.device) -> list[dict]:
    """Dispatch + combine (identity experts) against the raw all-to-all, per routing."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens * 2, hidden, generator=gen).to(device, dtype)  # room for K = 2
    cases = []
    # top-k: each token's 2 best of random scores (uneven loads); rows sorted by expert
    idx = torch.randn(tokens, experts, generator=gen).topk(2, dim=1).indices
    cases.append(("top-k (K=2), counted", torch.bincount(idx.flatten(), minlength=experts), False))
    base = expert_capacities(tokens, experts, 2)  # BASE's loads: exactly balanced
    cases += [("BASE (K=2), counted", base, False), ("BASE (K=2), static splits", base, True)]
    rows = []
    for strategy in ("resort", "per_expert"):
        fns, sent = {}, {}
        for name, counts, static in cases:
            known = counts.tolist() if static else None
            if strategy == "per_expert":  # rows sorted by (local expert, destination rank)
                counts = counts.view(world, -1).T.reshape(-1)
            counts = counts.to(device)
            xs = x[: int(counts.sum())]

            def ours(xs=xs, counts=counts, known=known, strategy=strategy):
                local, _, info = dispatch(xs, counts, known_counts=known, strategy=strategy)
                return combine(local, info)

            _, _, info = dispatch(xs, counts, known_counts=known, strategy=strategy)
            assert torch.equal(ours(), xs)  # identity experts: the rows come back in place
            send, recv = [sum(r) for r in info.send], [sum(r) for r in info.recv]
            fns[name] = ours
            fns[f"raw {name}"] = lambda xs=xs, send=send, recv=recv: _raw(xs, send, recv)
            sent[name] = xs.shape[0]
        reps = repeats if tokens * hidden >= 1 << 22 else 5 * repeats  # small shapes: cheap, noisier
        times = _time(fns, reps, device)
        for name, _, _ in cases:
            rows.append(
                {
                    "shape": f"{tokens} x {hidden}",
                    "routing": name,
                    "strategy": strategy,
                    "rows_sent": sent[name],
                    "ms_dispatcher": times[name] * 1e3,
                    "ms_raw": times[f"raw {name}"] * 1e3,
                    "overhead": times[name] / times[f"raw {name}"] - 1,
                    "repeats": reps,
                }
            )
    return rows


def agreement_cost(tokens: int, hidden: int, experts: int, dtype, repeats: int, device: torch.device) -> dict:
    """The static path's agreement beside its dispatch + combine (per_expert, BASE K=2 loads)."""
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
    agreement = Agreement(mesh, mesh.get_group(0), None, experts)
    x = torch.randn(tokens * 2, hidden, generator=torch.Generator().manual_seed(dist.get_rank())).to(device, dtype)
    known = expert_capacities(tokens, experts, 2).tolist()
    counts = torch.tensor(known).view(world, -1).T.reshape(-1).to(device)

    def static():
        local, _, info = dispatch(x, counts, known_counts=known, strategy="per_expert")
        return combine(local, info)

    fns = {
        "static": static,
        "device": lambda: agreement.on_device(x[:tokens], None),
        "host": lambda: exchange_sizes(tokens, mesh.get_group(0), device),
    }
    reps = repeats if tokens * hidden >= 1 << 22 else 5 * repeats
    times = _time(fns, reps, device)
    return {"shape": f"{tokens} x {hidden}", "repeats": reps, **{f"ms_{k}": v * 1e3 for k, v in times.items()}}


def markdown(sweep_rows: list[dict], disp_rows: list[dict], agree_rows: list[dict], meta: dict, args) -> str:
    lines = [
        f"Command: `{meta['command']}` (launched with `torchrun --nproc-per-node {meta['world']}`). "
        f"Machine: {meta['machine']}, {meta['world']} ranks, backend {meta['backend']}, "
        f"{meta['threads']} threads per rank, torch {meta['torch']}, {meta['date']}; "
        f"median of {args.repeats} repeats (dispatcher rows: as listed) of the slowest rank, the compared "
        "functions taking turns.",
        "",
        "| bytes per rank | time (us) | algbw (GB/s) | busbw (GB/s) |",
        "|---:|---:|---:|---:|",
    ]
    lines += [f"| {r['bytes']} | {r['us']:.1f} | {r['algbw']:.3f} | {r['busbw']:.3f} |" for r in sweep_rows]
    lines += [
        "",
        f"Dispatcher, tokens x hidden ({args.dtype}) per rank, {args.experts} experts; dispatch + combine "
        "against two raw all-to-alls of the same splits:",
        "",
        "| tokens x hidden | routing | strategy | rows sent | repeats | dispatcher (ms) | raw all-to-all (ms) "
        "| overhead |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['shape']} | {r['routing']} | {r['strategy']} | {r['rows_sent']} | {r['repeats']} "
        f"| {r['ms_dispatcher']:.2f} | {r['ms_raw']:.2f} | {r['overhead']:+.1%} |"
        for r in disp_rows
    ]
    lines += [
        "",
        "The static path's agreement (the W token counts exchanged, checked on the device with the pass over "
        "the tokens for finiteness, or read on the host) beside its dispatch + combine (per_expert):",
        "",
        "| tokens x hidden | repeats | static dispatch + combine (ms) | agreement on the device (ms) | share "
        "| read on the host (ms) | share |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['shape']} | {r['repeats']} | {r['ms_static']:.2f} | {r['ms_device']:.3f} "
        f"| {r['ms_device'] / r['ms_static']:.1%} | {r['ms_host']:.3f} | {r['ms_host'] / r['ms_static']:.1%} |"
        for r in agree_rows
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["16384x4096", "1024x512"], help="tokens x hidden per rank")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--max-bytes", type=int, default=1 << 26)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--docs", action="store_true", help="rewrite the all-to-all section of docs/benchmarks.md")
    p.add_argument("--hierarchical", action="store_true",
                   help="bytes between nodes per token, flat against two-level (benchmarks/node_bytes.py); "
                   "under torchrun also the gloo times")  # fmt: skip
    p.add_argument("--ranks-per-node", type=int, default=None, help="--hierarchical under torchrun: the layout")
    args = p.parse_args(argv)
    if args.hierarchical:
        return _hierarchical(args, argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        if args.experts % dist.get_world_size():
            raise ValueError(f"--experts must be divisible by the {dist.get_world_size()} ranks, got {args.experts}")
        sizes = [1 << s for s in range(10, args.max_bytes.bit_length(), 2)]
        sweep_rows = sweep(sizes, args.repeats, device)
        disp_rows, agree_rows = [], []
        for shape in args.shapes:
            tokens, hidden = (int(v) for v in shape.split("x"))
            dtype = getattr(torch, args.dtype)
            disp_rows += dispatcher(tokens, hidden, args.experts, dtype, args.repeats, device)
            agree_rows.append(agreement_cost(tokens, hidden, args.experts, dtype, args.repeats, device))
        if dist.get_rank() == 0:
            meta = run_meta("benchmarks.all_to_all", argv, device)
            meta.update(world=dist.get_world_size(), backend=dist.get_backend())
            text = markdown(sweep_rows, disp_rows, agree_rows, meta, args)
            print(text)
            if args.docs:
                write_section("all-to-all", text, "## All-to-all and the expert-parallel dispatcher")
    finally:
        dist.destroy_process_group()


def _hierarchical(args, argv) -> None:
    from benchmarks import node_bytes

    times = None
    if "WORLD_SIZE" in os.environ:  # launched by torchrun: time the two dispatchers too
        dist.init_process_group("gloo")
        try:
            world = dist.get_world_size()
            ranks_per_node = args.ranks_per_node or max(world // 2, 1)
            times = node_bytes.gloo_times(
                ranks_per_node, args.repeats, lambda fns, n: _time(fns, n, torch.device("cpu"))
            )
        finally:
            dist.destroy_process_group()
    if times is None or int(os.environ.get("RANK", 0)) == 0:
        text = node_bytes.markdown(node_bytes.rows(), times)
        print(text)
        if args.docs:
            write_section("node-bytes", text, "## Bytes between nodes: flat and two-level dispatch")


if __name__ == "__main__":
    main()
