"""The combine (`unpermute`) in bf16, forward + backward, by its two CPU paths side by side.

    python -m benchmarks.combine --repeats 15

Rows (T*K, D) in bf16 with every slot kept. With gates in the rows' dtype (what the layer
passes) the combine and its backward are batched matmuls in bf16, which accumulate in fp32;
with fp32 gates the rows are cast to fp32 first and the backward runs elementwise in fp32
(every path before the bf16 one existed). Both round the same products; the table gives each
one's median ms (min-max) over the repeats, the two taking turns, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from benchmarks.common import run_meta, timed_turns
from moe.kernels import permute, unpermute

SHAPES = [
    (512, 2, 256, 8),
    (2048, 2, 256, 8),
    (8192, 2, 256, 8),
    (2048, 2, 1024, 8),
    (1024, 4, 256, 16),
    (512, 8, 256, 64),
    (2048, 8, 256, 64),
]


def _combine_step(y, info, gates, dout):
    def step():
        out = unpermute(y, info, gates)
        out.backward(dout)
        y.grad = gates.grad = None

    return step


def point(t: int, k: int, d: int, e: int, repeats: int) -> str:
    g = torch.Generator().manual_seed(0)
    idx = torch.rand(t, e, generator=g).topk(k, dim=1).indices
    _, info = permute(torch.zeros(t, 1), idx, num_experts=e)
    y = torch.randn(t * k, d, generator=g).bfloat16().requires_grad_()
    dout = torch.randn(t, d, generator=g).bfloat16()
    gates = torch.rand(t, k, generator=g)
    fns = {
        "bf16 gates": _combine_step(y, info, gates.bfloat16().requires_grad_(), dout),
        "fp32 gates": _combine_step(y, info, gates.clone().requires_grad_(), dout),
    }
    times = timed_turns(fns, repeats, warmup=3)
    med = {n: statistics.median(ts) * 1e3 for n, ts in times.items()}
    cells = " | ".join(f"{med[n]:.3f} ({min(ts) * 1e3:.2f}-{max(ts) * 1e3:.2f})" for n, ts in times.items())
    return f"| {t} | {k} | {d} | {cells} | {med['bf16 gates'] / med['fp32 gates']:.2f} |"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    meta = run_meta("benchmarks.combine", argv)
    print(
        f"`{meta['command']}`: {meta['machine']}, {meta['threads']} threads, torch {meta['torch']}, {meta['date']}, "
        f"load before {os.getloadavg()[0]:.2f}; median ms of {args.repeats} (min-max), forward + backward\n"
    )
    print("| T | K | D | bf16 gates (bf16 matmuls) | fp32 gates (fp32 rows) | bf16 / fp32 gates |")
    print("|---|---|---|---|---|---|")
    for t, k, d, e in SHAPES:
        print(point(t, k, d, e, args.repeats), flush=True)
    print(f"\nload after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
