"""The planner against published training runs and against a measured run (docs/scale.md,
"Calibration").

``python -m moe.plan.calibrate`` prints the calibration tables (fit and held-out rows apart,
`moe.plan.runs`); ``--fit`` re-fits the efficiencies on the fit rows alone and prints them;
``--from RUN_DIR`` compares a `moe train` run folder's measured throughput (and peak memory,
where its metrics record one) with the plan of that run's layout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

from .hardware import EFFICIENCY, Efficiency, gpu_from_spec
from .memory import TrainShape
from .runs import RUNS, PublishedRun
from .time import step_time

__all__ = ["FITTED", "calibration_rows", "fit", "from_run", "main", "markdown"]

# the efficiencies `fit` adjusts (the others stay at their stated values), each on a grid of
# 0.025 steps within what the hardware allows: dense GEMMs reach 60-85% of the bf16 peak on
# H100 and fp8 ones 40-80% of theirs, flash attention's forward + backward 35-70%, NCCL's bus
# bandwidth between nodes 50-90% of the NICs' line rate
FITTED = {"gemm": (0.6, 0.85), "gemm_fp8": (0.4, 0.8), "attention": (0.35, 0.7), "net": (0.5, 0.9)}


def _row(run: PublishedRun, eff: Efficiency) -> dict:
    cfg = run.config()
    shape = TrainShape(seq_len=run.seq_len, global_batch_tokens=run.global_batch_seqs * run.seq_len)
    t = step_time(cfg, run.layout, shape, gpu_from_spec(run.gpu, run.gpu_spec), eff=eff, attention=run.attention)
    published, ours = run.tokens_per_s_per_gpu, t.tokens_per_s_per_gpu
    if published is None:  # throughput given as model TFLOP/s only: compare those
        published, ours = run.tflops_per_gpu, t.tflops_per_gpu
    return {"run": run, "tokens": t.tokens_per_s_per_gpu, "tflops": t.tflops_per_gpu, "time": t,
            "error": ours / published - 1}  # fmt: skip


def calibration_rows(eff: Efficiency = EFFICIENCY, runs: list[PublishedRun] = RUNS) -> list[dict]:
    return [_row(run, eff) for run in runs]


def _loss(eff: Efficiency, runs: list[PublishedRun]) -> float:
    return sum(math.log1p(r["error"]) ** 2 for r in calibration_rows(eff, runs))


def fit(runs: list[PublishedRun] | None = None, start: Efficiency | None = None, sweeps: int = 3) -> Efficiency:
    """Coordinate descent over `FITTED` on a grid from ``start`` (the prior, `Efficiency()`),
    minimising the squared log errors of the ``split == "fit"`` rows only (the held-out rows
    are never passed in)."""
    runs = [r for r in (RUNS if runs is None else runs) if r.split == "fit"]
    start = Efficiency() if start is None else start
    best, best_loss = start, _loss(start, runs)
    for _ in range(sweeps):
        moved = False
        for name, (lo, hi) in FITTED.items():
            for value in (round(lo + 0.025 * i, 3) for i in range(round((hi - lo) / 0.025) + 1)):
                cand = dataclasses.replace(best, **{name: value})
                loss = _loss(cand, runs)
                if loss < best_loss - 1e-12:
                    best, best_loss, moved = cand, loss, True
        if not moved:
            break
    return best


def _table(rows: list[dict]) -> list[str]:
    out = [
        "| run | layout (ours) | published tokens/s/GPU | ours | published TFLOP/s/GPU | ours | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        run = r["run"]
        pub_tok = f"{run.tokens_per_s_per_gpu:,.0f}" if run.tokens_per_s_per_gpu else "-"
        pub_tf = f"{run.tflops_per_gpu:.0f}" if run.tflops_per_gpu else "-"
        out.append(
            f"| {run.name} | {run.layout.short()} | {pub_tok} | {r['tokens']:,.0f} | {pub_tf} | {r['tflops']:.0f} "
            f"| {r['error']:+.1%} |"
        )
    return out


def markdown(eff: Efficiency = EFFICIENCY) -> str:
    rows = calibration_rows(eff)
    out = []
    for split in ("fit", "held-out"):
        out += [f"**{split}** rows:", "", *_table([r for r in rows if r["run"].split == split]), ""]
    return "\n".join(out).rstrip()


def from_run(run_dir: str, gpu: str = "h100", gpu_spec: str | None = None, skip: int = 2) -> str:
    """The measured throughput of a `moe train` run folder against the plan of its layout:
    tokens/s per process (median of the logged steps after the first ``skip``), and the peak
    memory where metrics.jsonl records ``peak_memory_bytes``."""
    from ..train.config import TrainConfig, model_config_from_dict
    from ..train.metrics import read_metrics
    from ..train.preflight import train_layout
    from .memory import peak_memory

    folder = Path(run_dir)
    try:
        info = json.loads((folder / "config.json").read_text())
        tc, mc = TrainConfig.from_dict(info["train"]), model_config_from_dict(info["model"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--from {run_dir}: cannot read a run's config.json ({type(e).__name__}: {e})") from None
    rows = [r for r in read_metrics(folder) if "tokens_per_s" in r and not r.get("skipped")]
    if len(rows) <= skip:
        raise ValueError(f"--from {run_dir}: metrics.jsonl has {len(rows)} training steps, need more than {skip}")
    rows = rows[skip:]
    dev = gpu_from_spec(gpu, gpu_spec)
    lay = train_layout(tc, on_gpu=True)
    shape = TrainShape(seq_len=tc.seq_len, global_batch_tokens=tc.batch * tc.seq_len)
    plan = step_time(mc, lay, shape, dev)
    measured = statistics.median(r["tokens_per_s"] for r in rows) / lay.world
    lines = [
        f"run {folder}: layout {lay.short()} on {lay.world} x {dev.name}, {len(rows)} steps after the first {skip}",
        "| part | measured | planned | measured / planned |",
        "|---|---|---|---|",
        f"| tokens/s per process | {measured:,.1f} | {plan.tokens_per_s_per_gpu:,.1f} | "
        f"{measured / plan.tokens_per_s_per_gpu:.3f} |",
        f"| step s | {shape.global_batch_tokens / measured / lay.world:.4g} | {plan.step_s:.4g} | "
        f"{plan.tokens_per_s_per_gpu / measured:.3f} |",
    ]
    peaks = [r["peak_memory_bytes"] for r in rows if "peak_memory_bytes" in r]
    _, mem = peak_memory(mc, lay, shape)
    if peaks:
        lines.append(f"| peak memory GiB | {max(peaks) / 2**30:.3f} | {mem['total'] / 2**30:.3f} | "
                     f"{max(peaks) / mem['total']:.3f} |")  # fmt: skip
    else:
        lines.append(f"| peak memory GiB | not recorded | {mem['total'] / 2**30:.3f} | - |")
    lines.append("planned parts (s per step): compute " + f"{plan.compute_s:.4g}, bubble {plan.bubble_s:.4g}, "
                 + ", ".join(f"{k} {v:.4g}" for k, v in plan.exposed_s.items()))  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe.plan.calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--fit", action="store_true", help="re-fit the efficiencies on the fit rows and print them")
    ap.add_argument("--from", dest="run_dir", default=None, help="a moe train run folder to compare with its plan")
    ap.add_argument("--gpu", default="h100", help="the GPU the run used (with --from)")
    ap.add_argument("--gpu-spec", default=None, help="override GPU fields (with --from)")
    args = ap.parse_args(argv)
    try:
        if args.run_dir is not None:
            print(from_run(args.run_dir, args.gpu, args.gpu_spec))
        elif args.fit:
            eff = fit()
            print(eff)
            print(markdown(eff))
        else:
            print(markdown())
    except ValueError as e:
        print(f"moe plan calibrate: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
