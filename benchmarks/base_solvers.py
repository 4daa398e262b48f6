"""BASE's exact solver against fairseq's C++ auction (the BASE layers' own solver), and the
solver's thread count on a quiet and on a busy machine. CPU.

    python -m benchmarks.base_solvers --fairseq-cpp PATH/balanced_assignment.cpp
    python -m benchmarks.base_solvers --threads            # 1 thread, 2 threads, a busy core

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

import torch

from benchmarks.common import once, run_meta, timed_turns
from benchmarks.routing import scores_for
from moe.routing import assignment_score, balanced_assignment
from moe.routing.balanced.threads import adaptive_threads

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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fairseq-cpp", type=Path, help="fairseq's balanced_assignment.cpp (a copy outside the repo)")
    ap.add_argument("--build-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "fairseq_libbase")
    ap.add_argument("--threads", action="store_true", help="the thread-count table instead")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args(argv)
    meta = run_meta("benchmarks.base_solvers", argv)
    print(f"{meta['command']} | {meta['machine']} | torch {meta['torch']} | {meta['date']} | load {os.getloadavg()}")
    if args.threads:
        lines = thread_table(args.repeats)
    elif args.fairseq_cpp is None:
        ap.error("--fairseq-cpp PATH is needed (or --threads)")
    else:
        lines = vs_fairseq(load_fairseq(args.fairseq_cpp, args.build_dir), args.repeats)
    print("\n".join(lines))
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
