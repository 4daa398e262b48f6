"""Grouped-GEMM benchmark: our kernels against torch._grouped_mm, a per-expert loop and one
dense GEMM of the same FLOPs (the practical ceiling), forward and forward + backward.

    python -m benchmarks.grouped_gemm            # GPU: full shapes; CPU: shapes scaled down
    python -m benchmarks.grouped_gemm --docs     # also rewrite its section of docs/benchmarks.md

Legend: M rows (tokens * k), I inner dim, N output dim, E experts. Shapes: the Mixtral 8x7B
expert up-projection (E=8, I=4096, N=14336, k=2) and DeepSeek-V3's local experts (E=32, I=7168,
N=2048, k=8), 16k tokens, with uniform counts and skewed ones (one expert at 4x the mean, a
quarter of the experts empty). Reports median ms, TFLOP/s and the ratio to the dense GEMM.
Writes JSON and markdown under --out ($OUT when set).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from benchmarks.common import run_meta, timed_turns, write_section
from moe.kernels import gather_grouped_mm, grouped_mm, sort_slots

SHAPES = {"mixtral-8x7b": dict(E=8, I=4096, N=14336, k=2), "deepseek-v3": dict(E=32, I=7168, N=2048, k=8)}
TOKENS = 16384


def make_counts(m: int, e: int, skewed: bool) -> torch.Tensor:
    if not skewed:
        return torch.full((e,), m // e, dtype=torch.int64) + (torch.arange(e) < m % e)
    share = torch.ones(e)
    share[: max(1, e // 4)] = 0.0  # a quarter of the experts get nothing
    share[-1] = 4.0  # one expert gets 4x the mean of the others
    counts = (share / share.sum() * m).floor().long()
    counts[-1] += m - counts.sum()
    return counts


def closures(fn, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> tuple:
    """fn forward, and forward + backward into x and w (no accumulation), as functions of no
    arguments; runs fn once, so a method that cannot run here raises now."""
    dy = torch.randn_like(fn(x, w, counts))
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    return (lambda: fn(x, w, counts)), (lambda: torch.autograd.grad(fn(xg, wg, counts), (xg, wg), dy))


def methods(device: torch.device) -> dict:
    out = {
        "ours (torch backend)": lambda x, w, c: grouped_mm(x, w, c, backend="torch"),
        "per-expert loop": lambda x, w, c: torch.cat([x_e @ w[e] for e, x_e in enumerate(x.split(c.tolist()))]),
    }
    if hasattr(torch, "_grouped_mm"):
        out["torch._grouped_mm"] = lambda x, w, c: torch._grouped_mm(x, w, offs=torch.cumsum(c, 0).to(torch.int32))
    if device.type == "cuda":
        out = {"ours (triton)": lambda x, w, c: grouped_mm(x, w, c, backend="triton"), **out}
        try:
            from megablocks import grouped_gemm as mb  # optional peer, GPU only

            out["megablocks"] = lambda x, w, c: mb.gmm(x, w, c.cpu())
        except ImportError:
            pass
    return out


def gather_methods(counts: torch.Tensor, k: int, backend: str) -> tuple[dict, int]:
    """The first expert GEMM with the permutation's gather: sorted copy then GEMM, against the
    gather fused into the GEMM's A-load. Takes the (T, I) tokens; returns the methods and T.
    Slots are dealt to experts at random, so the gathered rows are scattered over x."""
    m = int(counts.sum())
    t = m // k
    g = torch.Generator().manual_seed(1)
    expert_of_slot = torch.repeat_interleave(torch.arange(counts.numel()), counts.cpu())[torch.randperm(m, generator=g)]
    info = sort_slots(expert_of_slot[: t * k].view(t, k).to(counts.device), num_experts=counts.numel())
    return {
        f"ours ({backend}), sorted copy + GEMM": lambda x, w, c: grouped_mm(
            x[info.token], w, info.counts, backend=backend
        ),
        f"ours ({backend}), gather fused": lambda x, w, c: gather_grouped_mm(x, w, info, backend=backend),
    }, t


def _row(shape: str, mine: tuple[int, int, int, int], skewed: bool, method: str, fwd: float, fb: float) -> dict:
    """One table row: times and TFLOP/s (forward 2*M*I*N FLOPs, forward + backward three times that)."""
    m, i, n, e = mine
    flops = 2 * m * i * n
    return dict(shape=shape, M=m, I=i, N=n, E=e, counts="skewed" if skewed else "uniform", method=method,
                fwd_ms=fwd * 1e3, fwd_tflops=flops / fwd / 1e12, fwdbwd_ms=fb * 1e3,
                fwdbwd_tflops=3 * flops / fb / 1e12)  # fmt: skip


def run(scale: float, dtype: torch.dtype, device: torch.device, repeats: int) -> list[dict]:
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    rows = []
    for name, sh in SHAPES.items():
        e, i, n = sh["E"], max(16, int(sh["I"] * scale)), max(16, int(sh["N"] * scale))
        m = max(e, int(TOKENS * sh["k"] * scale))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(m, i, generator=g).to(device, dtype)
        w = (torch.randn(e, i, n, generator=g) / i**0.5).to(device, dtype)
        for skewed in (False, True):
            counts = make_counts(m, e, skewed).to(device)
            cases = {meth: (fn, w) for meth, fn in methods(device).items()}
            cases["dense (same FLOPs)"] = (lambda x, w, c: x @ w, w[0].contiguous())  # one (I, N) weight
            fwd_fns, fb_fns, sizes = {}, {}, {}
            for meth, (fn, weight) in cases.items():
                try:
                    fwd_fns[meth], fb_fns[meth] = closures(fn, x, weight, counts)
                    sizes[meth] = (m, i, n, e)
                except (RuntimeError, NotImplementedError) as err:  # e.g. a dtype a peer lacks
                    print(f"skip {meth} on {name}: {err}", file=sys.stderr)
            if device.type == "cuda":  # the fusion only changes anything with the triton kernels
                fused, t = gather_methods(counts, sh["k"], "triton")
                x_tokens = torch.randn(t, i, generator=g).to(device, dtype)
                for meth, fn in fused.items():
                    fwd_fns[meth], fb_fns[meth] = closures(fn, x_tokens, w, counts)
                    sizes[meth] = (t * sh["k"], i, n, e)
            # the methods take turns within each repeat, so drift in the machine's speed hits them alike
            fwd_t, fb_t = timed_turns(fwd_fns, repeats, sync), timed_turns(fb_fns, repeats, sync)
            dense = "dense (same FLOPs)"
            for meth in fwd_fns:
                fwd, fb = statistics.median(fwd_t[meth]), statistics.median(fb_t[meth])
                row = _row(name, sizes[meth], skewed, meth, fwd, fb)
                row["fwd_vs_dense"] = statistics.median(fwd_t[dense]) / fwd
                row["fwdbwd_vs_dense"] = statistics.median(fb_t[dense]) / fb
                rows.append(row)
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"Command: `{meta['command']}` on {meta['machine']} ({meta['threads']} torch threads, torch {meta['torch']}), "
        f"{meta['date']}, {meta['dtype']}, shapes scaled by "
        f"{meta['scale']} (M, I, N). Median of {meta['repeats']} repeats, the methods taking turns within each. "
        "x dense = time of one dense GEMM with the "
        "same FLOPs / time of the method (1.0 = the dense ceiling).",
        "",
        "| shape | M x I x N | counts | method | fwd ms | fwd TFLOP/s | fwd x dense | fwd+bwd ms | fwd+bwd x dense |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['M']} x {r['I']} x {r['N']} | {r['counts']} | {r['method']} | {r['fwd_ms']:.2f} | "
            f"{r['fwd_tflops']:.3f} | {r.get('fwd_vs_dense', float('nan')):.2f} | {r['fwdbwd_ms']:.2f} | "
            f"{r.get('fwdbwd_vs_dense', float('nan')):.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--scale", type=float, default=None, help="shape scale (default 1 on GPU, 1/8 on CPU)")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default bf16 on GPU, fp32 on CPU")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/grouped_gemm")))
    ap.add_argument("--docs", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    scale = args.scale or (1.0 if device.type == "cuda" else 0.125)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    rows = run(scale, dtype, device, args.repeats)
    meta = {
        **run_meta("benchmarks.grouped_gemm", argv, device),
        "dtype": str(dtype).replace("torch.", ""),
        "scale": scale,
        "repeats": args.repeats,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "grouped_gemm.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = markdown(rows, meta)
    (args.out / "grouped_gemm.md").write_text(md)
    print(md)
    if args.docs:
        write_section("grouped-gemm", md, "## Grouped GEMM")


if __name__ == "__main__":
    main()
