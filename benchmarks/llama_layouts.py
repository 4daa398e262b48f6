"""Llama-2-MoE layouts side by side: bytes per rank of parameters, gradients and optimizer
state, and training-step tokens/s, for dp=2, fsdp=2, tp=2, ep=2 and pp=2 in one run.

    torchrun --nproc-per-node 2 -m benchmarks.llama_layouts            # gloo on CPU
    torchrun --nproc-per-node 2 -m benchmarks.llama_layouts --docs     # also rewrite docs/benchmarks.md
    torchrun --nproc-per-node 4 -m benchmarks.llama_layouts --docs     # the 4-rank layouts, their own section

Each layout builds the same model (``--preset``, default ``small``), lays it out with
`parallelize_llama` (or `pipeline_llama` for pp, 1F1B with 4 micro-batches), and runs AdamW
steps on the same global batch. Memory: the bytes each rank holds after a step (the local shards
of DTensors), the largest rank's, next to the one-process total divided by the ranks. Speed:
the median step time over ``--repeats`` steps after one warm-up, of the slowest rank; tokens/s
counts the global batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from benchmarks.common import run_meta, write_section
from moe import aux_loss
from moe.models import Llama, LlamaConfig
from moe.parallel import LlamaMesh, llama_loss, parallelize_llama, pipeline_llama

LAYOUTS = {  # name: (mesh dims, options)
    "dp=2": ({"dp_replicate": 2}, {}),
    "fsdp=2": ({"dp_shard": 2}, {}),
    "tp=2": ({"tp": 2}, {}),
    "ep=2": ({"dp_shard": 2}, {"ep": 2}),
    "pp=2": ({"pp": 2}, {"schedule": "1f1b", "microbatches": 4}),
    "tp=2 etp": ({"tp": 2}, {"etp": True}),
    "dp_replicate=2 x dp_shard=2": ({"dp_replicate": 2, "dp_shard": 2}, {}),
    "dp_shard=2 x tp=2": ({"dp_shard": 2, "tp": 2}, {}),
    "tp=2 x ep=2": ({"dp_shard": 2, "tp": 2}, {"ep": 2}),
    "pp=2 x ep=2": ({"pp": 2, "dp_shard": 2}, {"ep": 2, "schedule": "1f1b", "microbatches": 4}),
}


def _size(dims: dict) -> int:
    out = 1
    for v in dims.values():
        out *= v
    return out


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return local_bytes(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim())


def max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def one_process(cfg: LlamaConfig, batch) -> dict:
    """Bytes of the unparallelised model after one step (every rank computes the same)."""
    torch.manual_seed(0)
    model = Llama(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens, targets = batch
    (F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()) + aux_loss(model)).backward()
    opt.step()
    params = list(model.parameters())
    return {"params": local_bytes(params), "grads": local_bytes(p.grad for p in params), "optimizer": state_bytes(opt)}


def run_layout(cfg: LlamaConfig, name: str, batch, repeats: int) -> dict:
    dims, options = LAYOUTS[name]
    options = dict(options)
    mesh = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
    lm = LlamaMesh.build(mesh, ep=options.pop("ep", 1))
    torch.manual_seed(0)
    tokens, targets = (lm.local_batch(t) for t in batch)
    if "schedule" in options:
        pipe = pipeline_llama(Llama(cfg), lm, **options)
        params = list(pipe.parameters())

        def step():
            pipe.step(tokens, targets)
    else:
        model = parallelize_llama(Llama(cfg), lm, ep=lm.ep, **options)
        params = list(model.parameters())

        def step():
            llama_loss(model, model(tokens), targets).backward()

    opt = torch.optim.AdamW(params, lr=1e-4)
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        opt.step()
        if i < repeats:  # the last step's gradients stay for the count
            opt.zero_grad()
        times.append(max_over_ranks(time.perf_counter() - t0))
    seconds = statistics.median(times[1:])
    return {
        "params": max_over_ranks(local_bytes(params)),
        "grads": max_over_ranks(local_bytes(p.grad for p in params if p.grad is not None)),
        "optimizer": max_over_ranks(state_bytes(opt)),
        "step_s": seconds,
        "tokens_per_s": batch[0].numel() / seconds,
    }


def markdown(results: dict, total: dict, meta: dict, world: int) -> str:
    mib = 2**20
    lines = [
        f"`{meta['command']}` on {meta['machine']} ({meta['threads']} threads per rank, torch {meta['torch']}, "
        f"{meta['date']}); preset `{meta['preset']}`, global batch {meta['batch']}.",
        "",
        "| layout | params MiB/rank | grads MiB/rank | AdamW state MiB/rank | step s | tokens/s |",
        "|---|---|---|---|---|---|",
        f"| one process / {world} | {total['params'] / world / mib:.2f} | {total['grads'] / world / mib:.2f} | "
        f"{total['optimizer'] / world / mib:.2f} | | |",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['params'] / mib:.2f} | {r['grads'] / mib:.2f} | {r['optimizer'] / mib:.2f} | "
            f"{r['step_s']:.3f} | {r['tokens_per_s']:.0f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", default="8x128", help="global batch BxS")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layouts", default=None, help="comma-separated; default: every layout of this world size")
    parser.add_argument("--docs", action="store_true")
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    cfg = LlamaConfig.from_name(args.preset)
    b, s = (int(v) for v in args.batch.split("x"))
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=g)
    batch = (data[:, :-1], data[:, 1:])
    total = one_process(cfg, batch)
    names = args.layouts.split(",") if args.layouts else [n for n, (d, _) in LAYOUTS.items() if _size(d) == world]
    results = {name: run_layout(cfg, name, batch, args.repeats) for name in names}
    if dist.get_rank() == 0:
        meta = run_meta("benchmarks.llama_layouts", argv) | {"preset": args.preset, "batch": args.batch}
        meta["command"] = meta["command"].replace("python -m", f"torchrun --nproc-per-node {world} -m", 1)
        body = markdown(results, total, meta, world)
        print(body)
        print(json.dumps({"meta": meta, "one_process": total, "layouts": results}))
        if args.docs:
            write_section(f"llama-layouts-{world}", body, "## Llama-2-MoE layouts")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
