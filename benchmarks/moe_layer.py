"""MoE layer benchmark: our `MoE` against transformers' Mixtral sparse MoE block (each of its
experts implementations) and a dense SwiGLU doing the same FLOPs, forward + backward.

    python -m benchmarks.moe_layer           # CPU: D=512, F=1408, E=8, k=2, T=4096
    python -m benchmarks.moe_layer --docs    # also rewrite its section of docs/benchmarks.md

All modules hold the same weights (initialised N(0, 0.02)); the dense SwiGLU runs T*k tokens
through one expert, the practical ceiling; below it, the nine GEMMs of its forward + backward
alone, writing into memory made once (no activation, no allocation: what no implementation
doing these FLOPs with this BLAS can beat). Reports the median ms of forward + backward,
tokens/s, the memory two steps need at their peak and still hold after them (`memory_mib`),
the ratio to dense and our speedup over each transformers variant.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import run_meta, status_kib, timed_turns, write_section
from moe import MoE, MoEConfig

DENSE = "dense SwiGLU (same FLOPs)"
FLOOR = "its 9 GEMMs alone, no allocation"


def fwd_bwd(module, x):
    x = x.detach().requires_grad_()
    y = module(x)
    if y.requires_grad:  # all but the GEMM floor
        y.backward(torch.ones_like(y))


class Case:
    """One compared method: ``module(x)`` (an nn.Module or a function), the parameters it trains."""

    def __init__(self, module, params) -> None:
        self.module, self.params = module, list(params)

    def step(self, x: torch.Tensor) -> None:
        fwd_bwd(self.module, x)

    def clear_grads(self) -> None:
        for p in self.params:
            p.grad = None


def build(d: int, f: int, e: int, k: int, t: int, dtype, device, only: str | None = None) -> tuple[dict, torch.Tensor]:
    """name -> `Case`, and the input x; ``only`` builds just that method."""
    from transformers.models.mixtral import modeling_mixtral as mm

    from moe.adapters.hf import to_mixtral

    torch.manual_seed(0)
    ours = MoE(MoEConfig(dim=d, hidden_dim=f, num_experts=e, top_k=k)).to(device, dtype)
    x = torch.randn(1, t, d, device=device, dtype=dtype)
    cases = {"ours (moe.MoE)": Case(ours, ours.parameters())}
    if device.type == "cuda":  # the fused permutation changes something only with the triton kernels
        fused = MoE(dataclasses.replace(ours.config, fused=True)).to(device, dtype)
        fused.load_state_dict(ours.state_dict())
        cases["ours (moe.MoE, fused)"] = Case(fused, fused.parameters())
    state = to_mixtral(ours).state_dict()  # the same weights in Mixtral's layout
    for impl in ("eager", "grouped_mm", "batched_mm"):
        name = f"transformers Mixtral ({impl})"
        if only not in (None, name):
            continue
        try:
            mm_cfg = mm.MixtralConfig(hidden_size=d, intermediate_size=f, num_local_experts=e, num_experts_per_tok=k)
            mm_cfg._experts_implementation = impl
            fresh = mm.MixtralSparseMoeBlock(mm_cfg).to(device, dtype)
            fresh.load_state_dict(state)
            if only is None:
                fwd_bwd(fresh, x)  # an implementation this install lacks raises here
            cases[name] = Case(fresh, fresh.parameters())
        except (ValueError, KeyError, RuntimeError, NotImplementedError) as err:
            print(f"skip transformers experts implementation {impl!r}: {err}", file=sys.stderr)
    w1, w3, w2 = (w[0].detach().clone().requires_grad_() for w in (ours.experts.w1, ours.experts.w3, ours.experts.w2))

    def dense(x_):
        x2 = x_.reshape(-1, d).repeat(k, 1)  # T*k tokens through one expert: the same FLOPs
        return (F.silu(x2 @ w1) * (x2 @ w3)) @ w2

    cases[DENSE] = Case(dense, (w1, w3, w2))
    # the floor: the nine GEMMs of forward + backward alone, reading inputs made once (never
    # written, so the values stay the same from call to call) into outputs made once
    m = t * k
    x_md, h_mf, g_md, g_mf = (torch.randn(m, n, device=device, dtype=dtype) / n**0.5 for n in (d, f, d, f))
    out_mf, out_md = torch.empty(m, f, device=device, dtype=dtype), torch.empty(m, d, device=device, dtype=dtype)
    dw_df, dw_fd = torch.empty(d, f, device=device, dtype=dtype), torch.empty(f, d, device=device, dtype=dtype)

    def gemms(_x):
        with torch.no_grad():
            torch.mm(x_md, w1, out=out_mf)  # forward: x @ w1, x @ w3, h @ w2
            torch.mm(x_md, w3, out=out_mf)
            torch.mm(h_mf, w2, out=out_md)
            torch.mm(g_md, w2.T, out=out_mf)  # dgrad through w2, then w1 and w3
            torch.mm(g_mf, w1.T, out=out_md)
            torch.mm(g_mf, w3.T, out=out_md)
            torch.mm(h_mf.T, g_md, out=dw_fd)  # wgrad of w2, w1, w3
            torch.mm(x_md.T, g_mf, out=dw_df)
            torch.mm(x_md.T, g_mf, out=dw_df)
        return out_md

    cases[FLOOR] = Case(gemms, ())
    return {name: case for name, case in cases.items() if only in (None, name)}, x


def run(d: int, f: int, e: int, k: int, t: int, dtype, device, repeats: int, memory: bool = True) -> list[dict]:
    cases, x = build(d, f, e, k, t, dtype, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    fns = {name: (lambda case=case: case.step(x)) for name, case in cases.items()}
    rows = []
    for name, times in timed_turns(fns, repeats, sync).items():  # side by side, taking turns
        sec = statistics.median(times)
        rows.append({"method": name, "ms": sec * 1e3, "tokens_per_s": t / sec})
    dense_ms = next(r["ms"] for r in rows if r["method"] == DENSE)
    ours_ms = rows[0]["ms"]
    for r in rows:
        r["x_dense"] = r["ms"] / dense_ms
        r["ours_speedup"] = r["ms"] / ours_ms
        if memory and r["method"] != FLOOR:
            r["peak_mib"], r["held_mib"] = memory_mib(r["method"], (d, f, e, k, t), dtype, device, cases, x)
    return rows


def memory_mib(name: str, shape: tuple, dtype, device, cases: dict, x: torch.Tensor) -> tuple[float, float]:
    """MiB that two forward + backward steps of one method, from no gradients, add at their peak
    and still hold after them (gradients, kept memory): on CUDA, allocated memory over what was
    allocated before; on CPU (Linux), the resident set over its size before, each method in a
    fresh process (so none reuses memory another one left behind), after a warm-up step on 8
    tokens (so the libraries' code it loads is not counted)."""
    if device.type == "cuda":
        cases[name].clear_grads()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        cases[name].step(x), cases[name].step(x)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20, (torch.cuda.memory_allocated() - base) / 2**20
    cmd = [sys.executable, "-m", "benchmarks.moe_layer", "--peak-of", name, "--dtype", str(dtype).split(".")[1]]
    root = Path(__file__).resolve().parents[1]  # where `benchmarks` imports from
    out = subprocess.run([*cmd, "--shape", *map(str, shape)], capture_output=True, text=True, cwd=root)
    if out.returncode != 0:
        raise RuntimeError(f"measuring the memory of {name!r} failed:\n{out.stderr}")
    peak, held = out.stdout.split()[-2:]
    return float(peak), float(held)


def _memory_here(name: str, shape: tuple, dtype) -> tuple[float, float]:
    cases, x = build(*shape, dtype, torch.device("cpu"), only=name)
    case = cases[name]
    case.step(x[:, :8])
    case.clear_grads()
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident set restarts from here
    base = status_kib("VmRSS")
    case.step(x), case.step(x)
    gc.collect()
    return (status_kib("VmHWM") - base) / 1024, (status_kib("VmRSS") - base) / 1024


def memory_measurable(device: torch.device) -> bool:
    """CUDA's allocator statistics, or Linux's peak resident set (reset through /proc)."""
    return device.type == "cuda" or os.access("/proc/self/clear_refs", os.W_OK)


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"Command: `{meta['command']}` on {meta['machine']} ({meta['threads']} torch threads, torch {meta['torch']}), "
        f"{meta['date']}, {meta['dtype']}, D={meta['d']}, "
        f"F={meta['f']}, E={meta['e']}, k={meta['k']}, T={meta['t']}. Forward + backward, median of {meta['repeats']} "
        "(the methods taking turns within each repeat).",
        "",
        "| method | ms | tokens/s | peak MiB | held after, MiB | time / dense | our speedup over it |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        peak, held = (f"{r[key]:.0f}" if key in r else "-" for key in ("peak_mib", "held_mib"))
        lines.append(
            f"| {r['method']} | {r['ms']:.1f} | {r['tokens_per_s']:.0f} | {peak} | {held} | {r['x_dense']:.2f} "
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
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory columns")
    ap.add_argument("--peak-of", default=None, help=argparse.SUPPRESS)  # one method's memory, CPU
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    d, f, e, k, t = args.shape or ((4096, 14336, 8, 2, 16384) if device.type == "cuda" else (512, 1408, 8, 2, 4096))
    dtype = getattr(torch, args.dtype)
    if args.peak_of:
        print(*_memory_here(args.peak_of, (d, f, e, k, t), dtype))
        return
    memory = not args.no_memory and memory_measurable(device)
    if not memory and not args.no_memory:
        print("peak memory not measured: needs CUDA or Linux's /proc/self/clear_refs", file=sys.stderr)
    rows = run(d, f, e, k, t, dtype, device, args.repeats, memory=memory)
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
