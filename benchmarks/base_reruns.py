"""The collectives of a global-BASE layer's calls under activation checkpointing, in a pipeline
schedule's order: W processes over gloo, one MoE layer with global BASE by prices over them,
each step running M micro-batches' checkpointed forwards and then their backwards (so every
re-run comes after the other micro-batches' forwards, as on a pipeline's first stage).

Per step: the collectives of the forwards' calls and of the re-runs' (median, range), how many
re-runs solved, and whether every re-run routed as its forward did. ``--tie`` makes the
router's first two experts score alike, so every token ties between them (a start other than
the forward's would route it otherwise). Counts only: nothing here is timed.

    python -m benchmarks.base_reruns --W 2 4 --micro-batches 4 --steps 3 --tie
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from benchmarks.common import count_collectives
from moe import MoE, MoEConfig
from moe.parallel import parallelize_moe
from moe.routing.common import in_backward


def _rank(rank: int, world: int, store: str, args, out) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    try:
        torch.manual_seed(0)
        cfg = MoEConfig(dim=args.dim, hidden_dim=2 * args.dim, num_experts=args.experts, router="base", top_k=args.k)
        layer = MoE(cfg)
        if args.tie:
            with torch.no_grad():
                layer.router.weight[1] = layer.router.weight[0]
        parallelize_moe(layer, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)), global_base=True)
        balance = layer.router.assign
        calls = []

        def counted(scores, k, **options):
            with count_collectives() as n:
                idx = balance(scores, k, **options)
            calls.append((in_backward(), n[0], idx.clone()))
            return idx

        layer.router.assign = counted
        rows = []
        gen = torch.Generator().manual_seed(100 + rank)
        for step in range(args.steps):
            calls.clear()
            xs = [torch.randn(args.tokens, args.dim, generator=gen) for _ in range(args.micro_batches)]
            ys = [checkpoint(layer, x, use_reentrant=False) for x in xs]
            for y in ys:
                y.square().mean().backward()
            forwards = [(n, idx) for again, n, idx in calls if not again]
            reruns = [(n, idx) for again, n, idx in calls if again]
            same = len(forwards) == len(reruns) and all(
                torch.equal(a, b) for (_, a), (_, b) in zip(forwards, reruns, strict=True)
            )
            rows.append((step, [n for n, _ in forwards], [n for n, _ in reruns], same))
        if rank == 0:
            out.put(rows)
    finally:
        dist.destroy_process_group()


def run(world: int, args) -> list[tuple]:
    """Every step's (step, the forwards' collectives, the re-runs', re-runs equal to their forwards)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, (world, f"{tmp}/store", args, out), nprocs=world, join=True, start_method="spawn")
    return out.get()


def _span(ns: list[int]) -> str:
    return f"{statistics.median(ns):g} ({min(ns)}-{max(ns)})" if ns else "-"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--W", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="per rank and micro-batch")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--tie", action="store_true", help="the router's first two experts score alike")
    args = ap.parse_args(argv)
    if min(args.W) < 1 or args.micro_batches < 1 or args.steps < 1 or args.tokens < 0:
        ap.error("--W, --micro-batches and --steps must be >= 1, --tokens >= 0")
    print("| W | step | forwards: collectives a call | re-runs: collectives a call | re-runs that solved | "
          "re-runs routed as their forwards |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for world in args.W:
        for step, forwards, reruns, same in run(world, args):
            solved = sum(n > 1 for n in reruns)
            print(f"| {world} | {step} | {_span(forwards)} | {_span(reruns)} | {solved} of {len(reruns)} | {same} |")


if __name__ == "__main__":
    main()
