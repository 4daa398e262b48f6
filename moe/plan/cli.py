"""``moe plan`` / ``python -m moe.plan``: which layouts of a model fit a cluster and how fast
a training step would be (docs/scale.md). `main(argv)` returns the exit status: 0, or 2 for
bad input or a layout that does not fit (with the reason and the nearest layouts that do)."""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

from ..config import MoEConfig
from ..models.llama import PRESETS, LlamaConfig
from . import base_time
from .hardware import GPUS, gpu_from_spec
from .layout import PRECISIONS, parse_layout
from .memory import COMPONENTS, USABLE_FRACTION, TrainShape
from .search import evaluate, nearest, search

__all__ = ["build_parser", "load_model", "main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line (exit 2) instead of the usage and the message
        print(f"moe plan: {message} (see moe plan --help)", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="moe plan", description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--model", required=True, help=f"a preset ({', '.join(PRESETS)}) or a LlamaConfig JSON file")
    ap.add_argument("--gpu", default="h100", help=f"GPU preset: {', '.join(GPUS)}")
    ap.add_argument("--gpu-spec", default=None, help="override GPU fields, e.g. hbm_bytes=96e9,net_bw=25e9")
    ap.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--global-batch-tokens", type=int, required=True, help="tokens per optimizer step")
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (--search)")
    ap.add_argument("--precision", default="bf16", choices=PRECISIONS, help="for --search")
    ap.add_argument("--layout", default=None, help="e.g. tp=8,pp=8,ep=8,dp_shard=64,recompute=1")
    ap.add_argument("--search", action="store_true", help="rank every layout that fits by tokens/s")
    ap.add_argument("--top", type=int, default=10, help="rows of the --search table")
    ap.add_argument("--json", action="store_true", help="JSON: one object per layout")
    ap.add_argument("--png", default=None, help="write a PNG of memory by component for the top layouts")
    ap.add_argument(
        "--check-memory", action="store_true",
        help="with --layout: run one tracked training step of the busiest rank on a fake process group "
        "(PyTorch's memory tracker, no memory allocated; minutes for a deep model) and print it beside the plan",
    )  # fmt: skip
    return ap


def load_model(name: str) -> LlamaConfig:
    """A preset name, or a JSON file of LlamaConfig fields (``moe``: MoEConfig fields)."""
    if name in PRESETS:
        return LlamaConfig.from_name(name)
    if not name.endswith(".json"):
        raise ValueError(f"--model {name!r} is neither a preset ({sorted(PRESETS)}) nor a .json config file")
    try:
        with open(name) as f:
            fields = json.load(f)
    except OSError as e:
        raise ValueError(f"--model: cannot read {name!r}: {e}") from None
    if isinstance(fields.get("moe"), dict):
        fields["moe"] = MoEConfig(**fields["moe"])
    try:
        return LlamaConfig(**fields)
    except TypeError as e:
        raise ValueError(f"--model {name!r}: {e}") from None


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def _describe(plan, gpu, cfg) -> str:
    lines = [f"layout {plan.layout.short()}: {'fits' if plan.fits else 'DOES NOT FIT: ' + str(plan.reason)}"]
    if plan.memory is None:
        return "\n".join(lines)
    usable = gpu.hbm_bytes * USABLE_FRACTION
    lines.append(f"memory of the busiest rank ({plan.rank}, pipeline rank {plan.layout.coords(plan.rank)['pp']}), GiB:")
    for k in COMPONENTS:
        lines.append(f"  {k:<14}{_gib(plan.memory[k]):>9}")
    lines.append(
        f"  {'total':<14}{_gib(plan.memory['total']):>9}  of {_gib(usable)} usable ({_gib(gpu.hbm_bytes)} HBM)"
    )
    t = plan.time
    lines.append(
        f"step {t.step_s:.3g} s: compute {t.compute_s:.3g} s, bubble {t.bubble_s:.3g} s, exposed "
        + ", ".join(f"{k} {v:.3g} s" for k, v in t.exposed_s.items())
    )
    lines.append("overlapped with compute: " + ", ".join(f"{k} {v:.3g} s" for k, v in t.overlapped_s.items()))
    lines.append("bytes per rank and step: " + ", ".join(f"{k} {_gib(v)} GiB" for k, v in t.bytes_per_rank.items()))
    if t.base_round_bytes:
        now = cfg.moe.router_config().base_round_bytes
        lines.append(
            f"global BASE: a round of its collectives costs what the ep group's link moves in "
            f"{base_time.ROUND_LATENCY_S * 1e6:.0f} us, {t.base_round_bytes:.3g} bytes: set the router option "
            f"base_round_bytes to it to weigh its rounds against its bytes (now {now:.3g})"
        )
    lines.append(
        f"{t.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, {t.tflops_per_gpu:.0f} model TFLOP/s/GPU, "
        f"MFU {t.mfu:.1%} (of the bf16 dense peak); {t.model_flops:.3g} model FLOPs per step"
    )
    return "\n".join(lines)


def _table(plans) -> str:
    rows = ["| # | layout | GiB/rank | tokens/s/GPU | MFU | step s |", "|---|---|---|---|---|---|"]
    for i, p in enumerate(plans, 1):
        t = p.time
        rows.append(
            f"| {i} | {p.layout.short()} | {_gib(p.memory['total'])} | {t.tokens_per_s_per_gpu:,.0f} | "
            f"{t.mfu:.1%} | {t.step_s:.3g} |"
        )
    return "\n".join(rows)


def _header(cfg, gpu, args) -> str:
    return (
        f"{args.model}: {cfg.num_params() / 1e9:,.1f}B parameters, {cfg.num_active_params() / 1e9:,.1f}B active; "
        f"{args.gpus} x {gpu.name} ({args.gpus_per_node} per node, {_gib(gpu.hbm_bytes)} GiB HBM); "
        f"seq {args.seq_len}, {args.global_batch_tokens:,} tokens per step"
    )


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad option (2, its one line printed)
        return e.code if isinstance(e.code, int) else 0
    try:
        cfg = load_model(args.model)
        gpu = gpu_from_spec(args.gpu, args.gpu_spec)
        if args.gpus < 1 or args.gpus_per_node < 1:
            raise ValueError(f"--gpus and --gpus-per-node must be >= 1, got {args.gpus}, {args.gpus_per_node}")
        if args.micro_batch < 1 or args.top < 1:
            raise ValueError(f"--micro-batch and --top must be >= 1, got {args.micro_batch}, {args.top}")
        if args.png is not None:
            _check_writable(args.png)
        shape = TrainShape(seq_len=args.seq_len, global_batch_tokens=args.global_batch_tokens)
        if not args.search and args.layout is None:
            raise ValueError("give --layout or --search")
        if args.check_memory and args.layout is None:
            raise ValueError("--check-memory measures the --layout given; give --layout")
    except ValueError as e:
        print(f"moe plan: {e}", file=sys.stderr)
        return 2
    try:
        lay = parse_layout(args.layout, gpus=args.gpus) if args.layout is not None else None
    except ValueError as e:  # not a layout at all: the fastest that fit stand in for the nearest
        print(f"moe plan: --layout {args.layout!r}: {e}", file=sys.stderr)
        fitting = [p for p in search(cfg, shape, gpu, args.gpus, args.gpus_per_node, args.precision) if p.fits]
        print("layouts that fit:\n" + _table(fitting[:3]) if fitting else "no layout fits", file=sys.stderr)
        return 2
    status = 0
    plans = None
    if args.search:
        plans = search(cfg, shape, gpu, args.gpus, args.gpus_per_node, args.precision, args.micro_batch)
    if lay is not None:
        plan = evaluate(cfg, lay, shape, gpu, args.gpus, args.gpus_per_node)
        if not plan.fits and plans is None:  # the search only when the nearest fitting layouts are needed
            plans = search(cfg, shape, gpu, args.gpus, args.gpus_per_node, lay.precision, lay.micro_batch)
        near = [] if plan.fits else nearest(lay, plans)
        if args.json:
            print(json.dumps(plan.to_json(cfg, gpu) | {"nearest_fitting": [p.layout.short() for p in near]}, indent=1))
        else:
            print(_header(cfg, gpu, args))
            print(_describe(plan, gpu, cfg))
        if args.check_memory and plan.memory is not None:
            from .memcheck import check_memory_report

            try:
                usable = gpu.hbm_bytes * USABLE_FRACTION
                print(check_memory_report(cfg, lay, shape, plan.rank, usable, args.gpus_per_node))
            except ValueError as e:
                print(f"moe plan: --check-memory: {e}", file=sys.stderr)
                return 2
        if not plan.fits:
            print(f"moe plan: layout {lay.short()} does not fit: {plan.reason}", file=sys.stderr)
            if near:
                print("nearest layouts that fit:\n" + _table(near), file=sys.stderr)
            else:
                print("no layout fits these GPUs for this model and batch", file=sys.stderr)
            status = 2
        shown = [plan] if plan.memory is not None else []
    if args.search:
        fitting = [p for p in plans if p.fits]
        if args.json:
            print(json.dumps([p.to_json(cfg, gpu) for p in plans], indent=1))
        else:
            print(_header(cfg, gpu, args))
            print(f"{len(fitting)} of {len(plans)} layouts fit; the fastest {min(args.top, len(fitting))}:")
            print(_table(fitting[: args.top]))
            reasons = collections.Counter(_kind(p.reason) for p in plans if not p.fits)
            print("skipped: " + "; ".join(f"{n} {r}" for r, n in reasons.most_common()))
        shown = fitting[: min(args.top, 8)]
    if args.png and shown:
        from .plot import plot_memory

        plot_memory(shown, gpu.hbm_bytes, args.png, title=_header(cfg, gpu, args))
    return status


def _check_writable(path: str) -> None:
    """--png names a file whose folder exists and can be written (checked before any work)."""
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        raise ValueError(f"--png {path}: the folder {folder} does not exist")
    if Path(path).is_dir():
        raise ValueError(f"--png {path} is a folder; name a .png file")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--png {path}: the folder {folder} is not writable")


def _kind(reason: str) -> str:
    """A skipped layout's reason without its numbers, to count alike reasons together."""
    if "(largest: " in reason:
        return "too large for HBM (largest: " + reason.split("(largest: ")[1].split()[0] + ")"
    words = [w for w in reason.replace(",", " ").split() if not any(ch.isdigit() for ch in w)]
    return " ".join(words[:8])
