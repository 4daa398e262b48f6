"""BASE's exact solver against fairseq's C++ auction (the BASE layers' own solver), and the
solver's thread count on a quiet and on a busy machine. CPU.

    python -m benchmarks.base_solvers --fairseq-cpp PATH/balanced_assignment.cpp
    python -m benchmarks.base_solvers --threads            # 1 thread, 2 threads, a busy core
    python -m benchmarks.base_solvers --small              # the numpy path of small problems
    python -m benchmarks.base_solvers --run runs/base64 --step 400 --tokens 262144   # a trained router's scores

fairseq's `fairseq/clib/libbase/balanced_assignment.cpp` is built from a copy outside this
repository (torch.utils.cpp_extension, into --build-dir) and imported only here. It solves top-1
with T divisible by E, stopping at an epsilon of range/50 (not exact): the table gives both
solvers' time, their ratio, and fairseq's objective gap to ours (ours is exact, so >= 0). The
two take turns within each repeat (after `WARMUP` untimed solves each); medians and the min-max
spread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path
from unittest import mock

import torch

from benchmarks.common import once, run_meta, timed_turns
from benchmarks.routing import scores_for
from moe.routing import assignment_score, balanced_assignment
from moe.routing.balanced import exact as exact_module
from moe.routing.balanced.threads import adaptive_threads
from moe.routing.exchange import _Graph

CASES = [(1024, 8), (4096, 64), (16384, 64), (16384, 256), (65536, 64)]
# untimed solves of each contender per shape first: our solver's first solves of a size allocate
# its buffers and try both thread counts (2 solves each, moe/routing/balanced/threads.py), which
# one warm-up left inside the timed repeats
WARMUP = 8
DISTS = ("gaussian", "skewed")


def load_fairseq(cpp: Path, build_dir: Path):
    from torch.utils.cpp_extension import load

    build_dir.mkdir(parents=True, exist_ok=True)
    return load("fairseq_libbase", [str(cpp)], build_directory=str(build_dir), extra_cflags=["-O3"])


def fairseq_experts(lib, s_TE: torch.Tensor) -> torch.Tensor:
    """fairseq returns, expert after expert, the T/E tokens each takes: turn it into (T, 1)."""
    t, e = s_TE.shape
    tokens = lib.balanced_assignment(s_TE)
    idx = torch.empty(t, dtype=torch.long)
    idx[tokens] = torch.arange(e).repeat_interleave(t // e)
    return idx[:, None]


def spread(xs: list[float]) -> str:
    return f"{min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f}"


def vs_fairseq(lib, repeats: int) -> list[str]:
    lines = [
        "| T x E | scores | ours ms (min-max) | fairseq ms (min-max) | fairseq / ours | fairseq's gap to the optimum |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for t, e in CASES:
        for dist in DISTS:
            s = scores_for(dist, t, e)
            fns = {"ours": lambda s=s: balanced_assignment(s), "fairseq": lambda s=s: fairseq_experts(lib, s)}
            times = timed_turns(fns, repeats, warmup=WARMUP)
            ours, theirs = (statistics.median(times[n]) for n in ("ours", "fairseq"))
            best, got = assignment_score(s, balanced_assignment(s)), assignment_score(s, fairseq_experts(lib, s))
            loads = torch.bincount(fairseq_experts(lib, s).flatten(), minlength=e)
            assert int(loads.max()) == int(loads.min()) == t // e, "fairseq's assignment is not balanced"
            gap = (float(best) - float(got)) / abs(float(best))
            lines.append(
                f"| {t} x {e} | {dist} | {ours * 1e3:.2f} ({spread(times['ours'])}) | {theirs * 1e3:.2f} "
                f"({spread(times['fairseq'])}) | {theirs / ours:.2f}x | {gap:.2%} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    return lines


def _solve_times(s: torch.Tensor, threads: int, adaptive: bool, repeats: int) -> list[float]:
    torch.set_num_threads(threads)
    with adaptive_threads(adaptive):
        for _ in range(4):  # warm-up: buffers, and the thread choice's first solves
            balanced_assignment(s)
        return [once(lambda: balanced_assignment(s)) for _ in range(repeats)]


def thread_table(repeats: int, t: int = 4096, e: int = 64) -> list[str]:
    """1 thread, 2 threads as torch runs them, and 2 threads with the solver's choice, each on a
    quiet machine and with a busy-loop process holding a core."""
    s = scores_for("gaussian", t, e)
    settings = {"1 thread": (1, False), "2 threads, fixed": (2, False), "2 threads, chosen": (2, True)}
    lines = [
        f"T={t}, E={e}, K=1, gaussian: median ms of {repeats} solves (min-max)",
        "",
        "| threads | quiet | one core busy |",
        "|---|---:|---:|",
    ]
    rows = {name: [] for name in settings}
    for busy in (False, True):
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            for name, (threads, adaptive) in settings.items():
                ts = _solve_times(s, threads, adaptive, repeats)
                rows[name].append(f"{statistics.median(ts) * 1e3:.1f} ({spread(ts)})")
        finally:
            if hog:
                hog.kill()
                hog.wait()
    for name, cells in rows.items():
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    return lines


SMALL_CASES = [(512, 8), (1024, 8), (2048, 4), (256, 32), (2048, 8), (1024, 16), (4096, 8), (1024, 32), (512, 64)]


def on_torch_ops(s: torch.Tensor) -> torch.Tensor:
    """Our solve with small K = 1 problems on the torch ops too, not on the numpy path."""
    with mock.patch.object(exact_module, "SMALL", 0):
        return balanced_assignment(s)


def small_table(repeats: int, seeds: int = 12) -> list[str]:
    """The numpy path of small K = 1 problems (`moe.routing.balanced.small`) against the same
    solve on the torch ops, at sizes on both sides of its limit: per size, `seeds` score draws
    (Gaussian, every other one skewed: an eighth of the experts +2), the two taking turns;
    per draw the ratio of the medians, then the median and the range of those ratios."""
    lines = [
        f"numpy path / torch path, {seeds} draws per size, median of {repeats} solves each (T*E <= "
        f"{exact_module.SMALL} takes the numpy path by default)",
        "",
        "| T x E | T*E | numpy ms (median of draws) | torch ms | numpy / torch: median (min-max) |",
        "|---|---:|---:|---:|---:|",
    ]
    for t, e in SMALL_CASES:
        ratios, ours, theirs = [], [], []
        for seed in range(seeds):
            g = torch.Generator().manual_seed(seed)
            s = torch.randn(t, e, generator=g)
            if seed % 2:
                s[:, : max(1, e // 8)] += 2.0
            with mock.patch.object(exact_module, "SMALL", t * e):
                fns = {"numpy": lambda s=s: balanced_assignment(s), "torch": lambda s=s: on_torch_ops(s)}
                times = timed_turns(fns, repeats, warmup=WARMUP)
                a, b = assignment_score(s, fns["numpy"]()), assignment_score(s, fns["torch"]())
            assert abs(float(a) - float(b)) <= 1e-5 * t, "the two paths' totals differ beyond the tolerance"
            med = {name: statistics.median(v) for name, v in times.items()}
            ours.append(med["numpy"])
            theirs.append(med["torch"])
            ratios.append(med["numpy"] / med["torch"])
        lines.append(
            f"| {t} x {e} | {t * e} | {statistics.median(ours) * 1e3:.2f} | {statistics.median(theirs) * 1e3:.2f} | "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )
        print(lines[-1], file=sys.stderr, flush=True)
    return lines


def _every_edge_rescanned(s: torch.Tensor, k: int = 1, **options) -> torch.Tensor:
    """Our solve with the exchange cycles rescanning every edge out of each expert a move
    touches (`exchange._Graph._refresh` with ``full``), instead of only the edges whose largest
    gain left."""
    refresh = _Graph._refresh
    with mock.patch.object(_Graph, "_refresh", lambda g, slot, nodes, full=False: refresh(g, slot, nodes, True)):
        return balanced_assignment(s, k, **options)


def run_table(run_dir: str, step: int, tokens: int, repeats: int) -> list[str]:
    """Our solve on the scores every BASE layer of a `moe train` run's checkpoint routes
    (``tokens`` of its data from ``step`` on, `benchmarks.global_base.run_steps`), against the
    same solve rescanning every edge of the exchange cycles; the two take turns."""
    from benchmarks.global_base import run_model_config, run_steps

    router = run_model_config(run_dir).moe.router_config()  # the router's own K and options
    k, options = router.top_k, {"extras": router.base_extras}
    if router.base_max_iters is not None:
        options["max_iters"] = router.base_max_iters
    lines = [
        f"{run_dir}, checkpoint {step}, {tokens} tokens, K = {k}, {options}: median s of {repeats} solves (min-max)",
        "",
        "| layer | T x E | ours s | every edge rescanned s | ours / rescanned |",
        "|---|---|---:|---:|---:|",
    ]
    (_, _, layers), *_ = run_steps(run_dir, 1, tokens, [step], 1)
    for layer, x in enumerate(layers):
        fns = {
            "ours": lambda x=x: balanced_assignment(x, k, **options),
            "rescanned": lambda x=x: _every_edge_rescanned(x, k, **options),
        }
        times = timed_turns(fns, repeats, warmup=1)
        assert torch.equal(fns["ours"](), fns["rescanned"]()), "the two ways of keeping the edges disagree"
        ours, full = (statistics.median(times[n]) for n in ("ours", "rescanned"))
        lines.append(
            f"| {layer} | {x.shape[0]} x {x.shape[1]} | {ours:.2f} ({min(times['ours']):.2f}-{max(times['ours']):.2f})"
            f" | {full:.2f} ({min(times['rescanned']):.2f}-{max(times['rescanned']):.2f}) | {ours / full:.2f} |"
        )
        print(lines[-1], file=sys.stderr, flush=True)
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fairseq-cpp", type=Path, help="fairseq's balanced_assignment.cpp (a copy outside the repo)")
    ap.add_argument("--build-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "fairseq_libbase")
    ap.add_argument("--threads", action="store_true", help="the thread-count table instead")
    ap.add_argument("--small", action="store_true", help="the numpy path of small problems against the torch ops")
    ap.add_argument("--run", help="time the solve on a `moe train` run's router scores instead (--step, --tokens)")
    ap.add_argument("--step", type=int, help="with --run: the checkpoint's step")
    ap.add_argument("--tokens", type=int, default=262144, help="with --run: tokens per solve")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args(argv)
    meta = run_meta("benchmarks.base_solvers", argv)
    print(f"{meta['command']} | {meta['machine']} | torch {meta['torch']} | {meta['date']} | load {os.getloadavg()}")
    if args.run:
        if args.step is None:
            ap.error("--run needs --step (the checkpoint)")
        lines = run_table(args.run, args.step, args.tokens, args.repeats)
    elif args.threads:
        lines = thread_table(args.repeats)
    elif args.small:
        lines = small_table(args.repeats)
    elif args.fairseq_cpp is None:
        ap.error("--fairseq-cpp PATH is needed (or --threads, --small)")
    else:
        lines = vs_fairseq(load_fairseq(args.fairseq_cpp, args.build_dir), args.repeats)
    print("\n".join(lines))
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
