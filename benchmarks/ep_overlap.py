"""The overlap of the expert-parallel exchange with the experts' compute: one MoE layer's
forward, and forward + backward, with the exchange in C = 1, 2, 4 chunks
(`moe.parallel.ChunkedDispatcher`; C = 1 is the flat dispatcher).

    torchrun --nproc-per-node 4 -m benchmarks.ep_overlap                     # gloo on CPU, NCCL on GPUs
    torchrun --nproc-per-node 2 -m benchmarks.ep_overlap --shape 256x64 --hidden 32 --repeats 1   # quick

One compute thread per process on CPU (``torch.set_num_threads(1)``; gloo's own threads move the
rows), so the exchange and the GEMMs compete for nothing but memory. Beside the layer's times:
the grouped experts alone on this rank's received rows, and the two raw all-to-alls of the
same rows, so a shape where the two are alike can be chosen (``--shape``, ``--hidden``). What
overlap can save is at most the smaller of the two. Times are the median over repeats of the
slowest rank; on CPU indicative only.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from benchmarks.common import run_meta, timed_turns
from moe import MoE, MoEConfig
from moe.kernels import permute
from moe.parallel import dispatch, parallelize_moe


def _time(fns: dict, repeats: int, device: torch.device) -> dict[str, float]:
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    samples = timed_turns(fns, repeats, sync, before=dist.barrier)
    t = torch.tensor([samples[name] for name in fns], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # each run takes as long as its slowest rank
    return {name: float(t[i].median()) * 1e3 for i, name in enumerate(fns)}


def measure(tokens: int, dim: int, hidden: int, experts: int, k: int, chunks: list[int], repeats: int, device):
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
    torch.manual_seed(0)
    cfg = MoEConfig(dim=dim, hidden_dim=hidden, num_experts=experts, top_k=k, router="topk")
    base = MoE(cfg).to(device)
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    x = torch.randn(tokens, dim, device=device, generator=gen, requires_grad=True)
    layers = {c: parallelize_moe(copy.deepcopy(base), mesh, chunks=c) for c in chunks}

    def forward(layer):
        with torch.no_grad():
            layer(x)

    fns = {f"forward C={c}": lambda layer=layer: forward(layer) for c, layer in layers.items()}
    fns |= {f"forward+backward C={c}": lambda layer=layer: layer(x).sum().backward() for c, layer in layers.items()}

    # the parts: the rows this rank's experts receive, through the experts alone; the raw exchange
    layer = layers[chunks[0]]
    with torch.no_grad():
        routing = layer.router(x)
        xs, info = permute(x, routing.expert_idx, num_experts=experts)
        x_local, counts_local, d_info = dispatch(xs, info.counts, layer.dispatcher.ep_group, strategy="resort")
    send, recv = [sum(r) for r in d_info.send], [sum(r) for r in d_info.recv]
    out_buf, back_buf = xs.new_empty(sum(recv), dim), xs.new_empty(sum(send), dim)

    def exchange():
        dist.all_to_all_single(out_buf, xs, recv, send)
        dist.all_to_all_single(back_buf, out_buf, send, recv)

    def experts_alone():
        with torch.no_grad():
            layer.experts(x_local, counts_local)

    fns |= {"experts alone": experts_alone, "exchange alone (out and back)": exchange}
    return _time(fns, repeats, device)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="4096x512", help="tokens x model dim per rank")
    p.add_argument("--hidden", type=int, default=128, help="each expert's hidden dim F")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        tokens, dim = (int(v) for v in args.shape.split("x"))
        ms = measure(tokens, dim, args.hidden, args.experts, args.top_k, args.chunks, args.repeats, device)
        if dist.get_rank() == 0:
            meta = run_meta("benchmarks.ep_overlap", argv, device)
            print(
                f"{meta}\n\n{dist.get_world_size()} ranks ({dist.get_backend()}), {tokens}x{dim} per rank, "
                f"F={args.hidden}, top-{args.top_k} of {args.experts} experts, median of {args.repeats}:\n"
            )
            print("| step | ms |\n|---|---:|")
            print("\n".join(f"| {name} | {t:.2f} |" for name, t in ms.items()))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
