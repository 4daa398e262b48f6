"""MoE layer benchmark: our `MoE` against transformers' Mixtral sparse MoE block (each of its
experts implementations) and a dense SwiGLU doing the same FLOPs, forward + backward.

    python -m benchmarks.moe_layer           # CPU: D=512, F=1408, E=8, k=2, T=4096
    python -m benchmarks.moe_layer --docs    # also rewrite its section of docs/benchmarks.md

All modules hold the same weights (initialised N(0, 0.02)); the dense SwiGLU runs T*k tokens
through one expert, the practical ceiling. Reports the median ms of forward + backward,
tokens/s, the ratio to dense and our speedup over each transformers variant.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import run_meta, timed_turns, write_section
from moe import MoE, MoEConfig


def fwd_bwd(module, x):
    x = x.detach().requires_grad_()
    y = module(x)
    y.backward(torch.ones_like(y))


def run(d: int, f: int, e: int, k: int, t: int, dtype, device, repeats: int) -> list[dict]:
    from transformers.models.mixtral import modeling_mixtral as mm

    from moe.adapters.hf import to_mixtral

    torch.manual_seed(0)
    ours = MoE(MoEConfig(dim=d, hidden_dim=f, num_experts=e, top_k=k)).to(device, dtype)
    x = torch.randn(1, t, d, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    cases = {"ours (moe.MoE)": ours}
    if device.type == "cuda":  # the fused permutation changes something only with the triton kernels
        fused = MoE(dataclasses.replace(ours.config, fused=True)).to(device, dtype)
        fused.load_state_dict(ours.state_dict())
        cases["ours (moe.MoE, fused)"] = fused
    state = to_mixtral(ours).state_dict()  # the same weights in Mixtral's layout
    for impl in ("eager", "grouped_mm", "batched_mm"):
        try:
            mm_cfg = mm.MixtralConfig(hidden_size=d, intermediate_size=f, num_local_experts=e, num_experts_per_tok=k)
            mm_cfg._experts_implementation = impl
            fresh = mm.MixtralSparseMoeBlock(mm_cfg).to(device, dtype)
            fresh.load_state_dict(state)
            fwd_bwd(fresh, x)  # an implementation this install lacks raises here
            cases[f"transformers Mixtral ({impl})"] = fresh
        except (ValueError, KeyError, RuntimeError, NotImplementedError) as err:
            print(f"skip transformers experts implementation {impl!r}: {err}", file=sys.stderr)
    w1, w3, w2 = (
        ours.experts.w1[0].detach().clone(),
        ours.experts.w3[0].detach().clone(),
        ours.experts.w2[0].detach().clone(),
    )
    for w in (w1, w3, w2):
        w.requires_grad_()

    def dense(x_):
        x2 = x_.reshape(-1, d).repeat(k, 1)  # T*k tokens through one expert: the same FLOPs
        return (F.silu(x2 @ w1) * (x2 @ w3)) @ w2

    cases["dense SwiGLU (same FLOPs)"] = dense
    rows = []
    fns = {name: (lambda module=module: fwd_bwd(module, x)) for name, module in cases.items()}
    for name, times in timed_turns(fns, repeats, sync).items():  # side by side, taking turns
        sec = statistics.median(times)
        rows.append({"method": name, "ms": sec * 1e3, "tokens_per_s": t / sec})
    dense_ms = rows[-1]["ms"]
    ours_ms = rows[0]["ms"]
    for r in rows:
        r["x_dense"] = r["ms"] / dense_ms
        r["ours_speedup"] = r["ms"] / ours_ms
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"Command: `{meta['command']}` on {meta['machine']} ({meta['threads']} torch threads, torch {meta['torch']}), "
        f"{meta['date']}, {meta['dtype']}, D={meta['d']}, "
        f"F={meta['f']}, E={meta['e']}, k={meta['k']}, T={meta['t']}. Forward + backward, median of {meta['repeats']} "
        "(the methods taking turns within each repeat).",
        "",
        "| method | ms | tokens/s | time / dense | our speedup over it |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['ms']:.1f} | {r['tokens_per_s']:.0f} | {r['x_dense']:.2f} "
            f"| {r['ours_speedup']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--shape", nargs=5, type=int, default=None, metavar=("D", "F", "E", "K", "T"))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/moe_layer")))
    ap.add_argument("--docs", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    d, f, e, k, t = args.shape or ((4096, 14336, 8, 2, 16384) if device.type == "cuda" else (512, 1408, 8, 2, 4096))
    dtype = getattr(torch, args.dtype)
    rows = run(d, f, e, k, t, dtype, device, args.repeats)
    meta = {
        **run_meta("benchmarks.moe_layer", argv, device),
        "dtype": args.dtype,
        "d": d, "f": f, "e": e, "k": k, "t": t,
        "repeats": args.repeats,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe_layer.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = markdown(rows, meta)
    print(md)
    if args.docs:
        write_section("moe-layer", md, "## MoE layer")


if __name__ == "__main__":
    main()
