"""A rank's own compute in global BASE by prices: W processes over gloo, one per rank, each
solving its shard as a rank of a cluster would (`GroupReduce`), against the simulated group of
`benchmarks.global_base` (`ShardReduce`, all W ranks' work one after another in one process)
on the same scores.

On a cluster each rank does its own shard's work (its price counts, its picks, its margin rows,
its certificate checks) while the others do theirs, and repeats what every rank does alike (the
residual solve of the gathered rows, its exchange cycles, the price model). The simulated
group's time is the sum of every rank's own work and that shared part once; so a rank's compute
lies between the group's time / W and the group's time. Here the CPU seconds of each rank's
solving thread measure it (``own``), every process and the simulated group on one thread, so a
machine with fewer cores than ranks still gives each rank's compute, though not its wall time;
the waits in the collectives take no CPU time. The process's CPU seconds (``cpu``) add its gloo
transport threads, which NCCL on a cluster replaces. Per solve: the group's time, every rank's
CPU seconds (median and largest), the margin rows, the largest rank's peak resident memory
(``VmHWM``: every rank holds the whole residual problem), and whether every rank's assignment
equals the simulated solve's shard of it.

    python -m benchmarks.global_base_ranks --W 8 64 --T 4096 --E 64 256 --steps 2
    python -m benchmarks.global_base_ranks --W 16 --T 4096 --run runs/base256 --replay-steps 400 --steps 2
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import status_kib
from benchmarks.global_base import by_config, grid, parse_score_args, score_args, score_source, solve_steps
from moe.parallel.price_base import price_balanced_assignment
from moe.parallel.reduction import GroupReduce, ShardReduce


def _problems(folder: str, source) -> list[tuple[int, str, list[str]]]:
    """Each step's layers saved under ``folder``: (step, label, their files), in order."""
    out = []
    for step, label, layers in source:
        paths = []
        for layer, x in enumerate(layers):
            paths.append(os.path.join(folder, f"step{step}_layer{layer}.pt"))
            torch.save(x.contiguous(), paths[-1])
        out.append((step, label, paths))
        del layers
    return out


def _shards(problems, rank: int, tokens: int):
    """The source of one rank: its rows of every saved layer (``rank`` None: every row)."""
    for step, label, paths in problems:
        whole = [torch.load(p, mmap=True) for p in paths]
        rows = slice(None) if rank is None else slice(rank * tokens, (rank + 1) * tokens)
        yield step, label, [x[rows].clone() for x in whole]


def _first(problems, rank: int | None, tokens: int) -> torch.Tensor:
    """The first layer of the first step, as `_shards` gives it: a warm-up solve's scores."""
    return next(_shards(problems[:1], rank, tokens))[2][0]


def peak_mb() -> float | None:
    """This process's peak resident memory in MB (``VmHWM``), or None off Linux. Not
    ``ru_maxrss``: a spawned process starts with its parent's peak there (vfork, then exec)."""
    try:
        return status_kib("VmHWM") / 1024
    except OSError:
        return None


def _rank(rank: int, world: int, folder: str, problems, tokens: int, k: int, replayed: bool, minutes: float) -> None:
    torch.set_num_threads(1)  # the thread's CPU seconds are then the rank's compute
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(minutes=minutes))  # fmt: skip
    red = GroupReduce()

    def solve(x, start):
        dist.barrier()  # every rank starts together: none counts another's lag as its own
        c0, t0 = time.process_time(), time.thread_time()
        out, p, st = price_balanced_assignment([x], k, red, prices=start)
        own = time.thread_time() - t0  # within the process's window
        cpu = time.process_time() - c0
        return p, dict(cpu=cpu, own=own, peak_mb=peak_mb(), rounds=st.rounds, out=out[0]), None

    solve(_first(problems, rank, tokens), None)  # untimed: the first call's one-off costs
    rows = list(solve_steps(_shards(problems, rank, tokens), replayed, solve))
    torch.save(rows, os.path.join(folder, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def run(
    world: int, tokens: int, experts: int, k: int, scores: str, steps: int, *,
    run_dir: str | None = None, replay: list[int] | None = None, timeout_minutes: float = 30,
) -> list[dict]:  # fmt: skip
    """Per solve: the simulated group's seconds on one thread (``group_s``), every rank's CPU
    seconds over gloo (``rank_cpu``: a list in rank order; ``rank_own``: the solving thread's
    alone), the largest rank's peak MB, the rounds of both, the margin rows, and ``equal``:
    every rank's assignment is the simulated solve's rows of it. A rank waits at most
    ``timeout_minutes`` in a collective, then fails."""
    k, source = score_source(world, tokens, experts, k, scores, steps, run_dir, replay)
    with tempfile.TemporaryDirectory() as folder:
        problems = _problems(folder, source)
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:

            def simulated(x, start):
                parts = list(x.split(tokens))
                t0 = time.perf_counter()
                out, p, st = price_balanced_assignment(parts, k, ShardReduce(world), prices=start)
                seconds = time.perf_counter() - t0
                return (
                    p,
                    dict(E=x.shape[1], group_s=seconds, rounds=st.rounds, margin_rows=st.margin_rows, out=out),
                    None,
                )

            simulated(_first(problems, None, tokens), None)  # untimed, as on the ranks
            sim = list(solve_steps(_shards(problems, None, tokens), scores == "run", simulated))
        finally:
            torch.set_num_threads(before)
        mp.spawn(_rank, args=(world, folder, problems, tokens, k, scores == "run", timeout_minutes), nprocs=world)
        ranks = [torch.load(os.path.join(folder, f"rank{r}.pt")) for r in range(world)]
    rows = []
    for i, s in enumerate(sim):
        mine = [r[i] for r in ranks]
        solved = {(m["step"], m["layer"], m["mode"]) for m in mine}
        assert solved == {(s["step"], s["layer"], s["mode"])}, f"solve {i}: the ranks solved {solved}"
        rows.append(
            dict(W=world, T=tokens, E=s["E"], K=k)
            | {key: s[key] for key in ("scores", "mode", "step", "layer", "group_s", "margin_rows")}
            | dict(
                rank_cpu=[m["cpu"] for m in mine], rank_own=[m["own"] for m in mine],
                rank_peak_mb=max(m["peak_mb"] or 0 for m in mine) or None,
                rounds=s["rounds"], rank_rounds=sorted({m["rounds"] for m in mine}),
                equal=all(torch.equal(m["out"], o) for m, o in zip(mine, s["out"], strict=True)),
            )
        )  # fmt: skip
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per (W, T, E, K, scores, start): medians over the solves of the group's seconds, of the
    ranks' median and largest CPU seconds (the solving thread's, ``own``; the process's,
    ``cpu``), and whether every solve was equal."""
    out = []
    for config, sel in by_config(rows):
        figures = {
            f"{name}_{how.__name__}": statistics.median(how(r[f"rank_{name}"]) for r in sel)
            for name in ("own", "cpu")
            for how in (statistics.median, max)
        }
        out.append(
            config
            | dict(n=len(sel), group_s=statistics.median(r["group_s"] for r in sel))
            | dict(peak_mb=max(r.get("rank_peak_mb") or 0 for r in sel))
            | figures
            | dict(equal=all(r["equal"] and r["rank_rounds"] == [r["rounds"]] for r in sel))
        )
    return out


def markdown(table: list[dict]) -> str:
    lines = [
        "| W | T | E | K | scores | start | solves | group s | group s / W | a rank's thread s (median, largest) "
        "| its process s (median, largest) | largest thread / group | a rank's peak MB | equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        peak = f"{r['peak_mb']:.0f}" if r["peak_mb"] else "-"  # not in rows of older runs
        lines.append(
            f"| {r['W']} | {r['T']} | {r['E']} | {r['K']} | {r['scores']} | {r['mode']} | {r['n']} | "
            f"{r['group_s']:.2f} | {r['group_s'] / r['W']:.3f} | {r['own_median']:.3f}, {r['own_max']:.3f} | "
            f"{r['cpu_median']:.3f}, {r['cpu_max']:.3f} | {r['own_max'] / r['group_s']:.1%} | "
            f"{peak} | {'yes' if r['equal'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = score_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]), steps=2)
    ap.add_argument("--json", help="write every solve's figures here")
    args, scores = parse_score_args(ap, argv)

    def one(world, tokens, experts, k):
        return run(world, tokens, experts, k, scores, args.steps, run_dir=args.run, replay=args.replay_steps)

    grid(args, one, lambda rows: markdown(summary(rows)))


if __name__ == "__main__":
    main()
