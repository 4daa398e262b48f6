"""The balanced solver of another commit against this checkout's, side by side in one process.

    python -m benchmarks.solver_ab --old 66314bc --T 4096 4000 --E 64 --K 1 --repeats 40 --threads 1 --clock cpu

Legend: T tokens, E experts, K experts per token. ``--old`` names a git commit: its
``moe/routing`` is unpacked (``git archive``) into a temporary package and imported next to
this checkout's, so both run in the same interpreter on the same scores. For every (T, E, K,
dist) case the two solvers take turns, ``--repeats`` times after a warm-up each, and the table
gives the median of each and their ratio, with both objectives (this checkout's default
``extras`` against the old code, which gives the extra slots to the lowest experts). Noise on
a shared machine moves single runs by far more than the differences measured here; the turns
make drift hit both alike, and ``--clock cpu`` (with ``--threads 1``) counts the CPU time the
process spent instead of the wall time, which waiting for a core shared with other work
inflates.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import run_meta
from benchmarks.routing import DISTS, scores_for
from moe.routing import assignment_score, balanced_assignment


def load_old(commit: str, into: Path):
    """``moe/routing`` of ``commit`` as the package ``old_routing`` (imports nothing else of moe)."""
    archive = subprocess.run(["git", "archive", commit, "moe/routing"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "moe" / "routing").rename(into / "old_routing")
    sys.path.insert(0, str(into))
    return importlib.import_module("old_routing")


def turns(fns: dict, repeats: int, clock) -> dict[str, list[float]]:
    """Seconds (by ``clock``) of every run of each function, taking turns, after a warm-up each."""
    for fn in fns.values():
        fn()
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            samples[name].append(clock() - t0)
    return samples


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="git commit whose balanced_assignment is compared")
    ap.add_argument("--T", type=int, nargs="+", default=[4096, 4000])
    ap.add_argument("--E", type=int, nargs="+", default=[64])
    ap.add_argument("--K", type=int, nargs="+", default=[1])
    ap.add_argument("--dists", nargs="+", default=list(DISTS))
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--extras", choices=("best", "lowest"), default="best", help="this checkout's rule")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: the process's CPU time")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    meta = run_meta("benchmarks.solver_ab", argv)
    with tempfile.TemporaryDirectory() as tmp:
        old = load_old(args.old, Path(tmp))
        print(f"Command: `{meta['command']}` on {meta['machine']} ({meta['threads']} torch threads, ", end="")
        print(f"torch {meta['torch']}), {meta['date']}. Median of {args.repeats} turns each, {args.clock} time.\n")
        print("| T | E | K | dist | old (ms) | new (ms) | new / old | old objective | new objective |")
        print("|---|---|---|---|---|---|---|---|---|")
        for t in args.T:
            for e in args.E:
                for k in args.K:
                    for dist in args.dists:
                        s = scores_for(dist, t, e)
                        fns = {
                            "old": lambda s=s, k=k: old.balanced_assignment(s, k),
                            "new": lambda s=s, k=k: balanced_assignment(s, k, extras=args.extras),
                        }
                        runs = turns(fns, args.repeats, clock)
                        med = {name: statistics.median(v) * 1e3 for name, v in runs.items()}
                        obj = {name: float(assignment_score(s, fn())) for name, fn in fns.items()}
                        print(
                            f"| {t} | {e} | {k} | {dist} | {med['old']:.2f} | {med['new']:.2f} | "
                            f"{med['new'] / med['old']:.3f} | {obj['old']:.4f} | {obj['new']:.4f} |",
                            flush=True,
                        )


if __name__ == "__main__":
    main()
