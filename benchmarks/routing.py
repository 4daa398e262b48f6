"""Routing benchmark: speed, balance and objective of every router on synthetic score matrices.

    python -m benchmarks.routing --quick            # small grid: about 10 s of CPU on 2 cores
    python -m benchmarks.routing                    # the full grid
    python -m benchmarks.routing --docs             # also rewrite the table in docs/benchmarks.md

Legend: T tokens, E experts, K experts per token. Each case draws a (T, E) score matrix, runs
every method on it, and reports the median time over repeats, max_load / mean_load, dropped
fraction at capacity factors 1.0 and 1.25, and the objective (sum of the chosen scores): its gap
to the exact balanced optimum (scipy, when small enough) and its *quality* against the
unconstrained top-k bound, (obj - random) / (bound - random), where random is the expected
objective of a uniformly random choice (1 = as good as unconstrained top-k, 0 = no better than
chance; unlike obj / bound it means the same whatever the sign of the scores). Writes JSON, a
markdown table and a PNG under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import run_meta, timed, timed_turns, write_section
from moe.routing import assignment_score, balanced_assignment, balanced_assignment_approx, expert_capacities, sinkhorn

GRID = {"T": [1024, 4096, 16384, 65536], "E": [8, 64, 256], "K": [1, 2, 8]}
# T <= 1024 keeps --quick to about 10 s of CPU (9.1 s user with one torch thread, 2-core machine);
# with T=4096 it took a minute, most of it scipy's exact solver on the expanded 4096 x 4096 matrix
QUICK = {"T": [256, 1024], "E": [8, 64], "K": [1, 2]}
DISTS = ("gaussian", "skewed", "zipf")  # the default grid's; "rank2" on request (--dists)
EXTRA_DISTS = ("rank2",)
SCIPY_MAX_SLOTS = 4096  # expanded (T*K) x (T*K) Hungarian; beyond this it takes minutes


def scores_for(dist: str, t: int, e: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dist == "rank2":  # scores of rank 2: experts ordered around a circle, neighbours compete
        return torch.randn(t, 2, generator=g) @ torch.randn(2, e, generator=g)
    x = torch.randn(t, e, generator=g)
    if dist == "skewed":  # an eighth of the experts are favoured by most tokens
        x[:, : max(1, e // 8)] += 2.0
    elif dist == "zipf":  # expert popularity ~ 1 / rank, as a log-prior on the scores
        x += torch.log(1.0 / torch.arange(1, e + 1, dtype=torch.float32))
    return x


def load_metrics(idx: torch.Tensor, num_experts: int, num_slots: int) -> dict:
    """Balance and capacity drops of a selection of ``num_slots`` = T*K slots (-1 entries ignored)."""
    kept = idx[idx >= 0]
    counts = torch.bincount(kept, minlength=num_experts).double()
    mean = num_slots / num_experts
    row = {"max_load": float(counts.max() / mean)}
    for cf in (1.0, 1.25):
        cap = math.ceil(cf * mean)
        row[f"drop@{cf}"] = float((counts - cap).clamp(min=0).sum() / max(1, num_slots))
    return row


def exact_solver(scores: torch.Tensor, k: int):
    """scipy's Hungarian on the expanded matrix (k = 1 only, None beyond SCIPY_MAX_SLOTS; when
    E does not divide T, with an optional slot per expert, docs/routing.md): a
    function that solves it and returns the optimal objective. The expansion is built outside
    the function, so only the solve is timed."""
    if k != 1 or scores.shape[0] > SCIPY_MAX_SLOTS:
        return None
    from scipy.optimize import linear_sum_assignment

    t, e = scores.shape
    base, spare = divmod(t, e)
    s = scores.double().numpy()
    if spare:  # balanced_assignment's default extras="best": b slots per expert and one optional
        cols = np.concatenate([np.repeat(np.arange(e), base), np.arange(e)])
        dummy = np.full((e - spare, cols.size), -1e9)  # E - r rows that can only leave an optional slot unused
        dummy[:, base * e :] = 0.0
        m = np.vstack([s[:, cols], dummy])
    else:
        m = s[:, np.repeat(np.arange(e), expert_capacities(t, e, 1).numpy())]

    def solve() -> float:
        r, c = linear_sum_assignment(m, maximize=True)
        return float(m[r, c].sum())

    return solve


def methods(k: int, sinkhorn_iters: int):
    def topk(s):
        return s.topk(k, dim=1).indices

    def sink(s):
        return sinkhorn(s, sinkhorn_iters, 1.0).topk(k, dim=1).indices

    def expert_choice(s):  # each expert takes its top C tokens; (T, E) slots, -1 where not taken
        t, e = s.shape
        c = min(t, math.ceil(t * k / e))
        take = s.softmax(dim=1).topk(c, dim=0).indices
        idx = torch.full((t, e), -1, dtype=torch.int64)
        idx.scatter_(0, take, torch.arange(e).expand(c, e))
        return idx

    return {
        "base": lambda s: balanced_assignment(s, k),
        "base_approx": lambda s: balanced_assignment_approx(s, k),  # the sync-free solver
        "topk": topk,
        "sinkhorn": sink,
        "expert_choice": expert_choice,
    }


def run_case(t: int, e: int, k: int, dist: str, repeats: int, sinkhorn_iters: int) -> list[dict]:
    scores = scores_for(dist, t, e)
    bound = float(scores.topk(k, dim=1).values.double().sum())
    chance = float(scores.double().mean(dim=1).sum()) * k  # expected objective of a random choice
    exact = exact_solver(scores, k)
    last = {}  # each timed function's last result: what the rows score

    def keep(name, fn):
        return lambda: last.__setitem__(name, fn())

    fns = {name: (lambda fn=fn: fn(scores)) for name, fn in methods(k, sinkhorn_iters).items()}
    turns = {}
    if exact is not None:  # BASE and scipy take turns, so drift in the machine's speed hits them alike
        timed_fns = {"scipy": exact, **{n: f for n, f in fns.items() if n.startswith("base")}}
        turns = timed_turns({n: keep(n, f) for n, f in timed_fns.items()}, repeats)
        optimum = last["scipy"]
    rows = []
    for name, fn in fns.items():
        if name in turns:
            sec, idx = statistics.median(turns[name]), last[name]
        else:
            sec, idx = timed(fn, repeats)
        obj = float(assignment_score(scores, idx))
        row = {"T": t, "E": e, "K": k, "dist": dist, "method": name, "ms": sec * 1e3}
        row.update(load_metrics(idx, e, t * k))
        slots = float((idx >= 0).sum()) / t  # mean slots per token (expert choice varies)
        row["quality"] = (obj - chance * slots / k) / (bound - chance) if bound != chance else float("nan")
        if name.startswith("base"):
            loads = torch.bincount(idx.flatten(), minlength=e).sort(descending=True).values
            row["exact_balance"] = bool(torch.equal(loads, expert_capacities(t, e, k)))  # any r experts at b + 1
            if exact is not None:
                scipy_sec = statistics.median(turns["scipy"])
                row["gap_vs_exact"] = (optimum - obj) / abs(optimum)
                row["scipy_ms"] = scipy_sec * 1e3
                row["speedup_vs_scipy"] = scipy_sec / sec
        rows.append(row)
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"Command: `{meta['command']}` on {meta['machine']} ({meta['threads']} torch threads, torch {meta['torch']}),"
        f" {meta['date']}. Median of {meta['repeats']} repeats.",
        "",
    ]
    base = [r for r in rows if "speedup_vs_scipy" in r]
    if base:
        lines += [
            "BASE balanced assignment against scipy's exact solver (`linear_sum_assignment` on the expanded matrix;"
            " the solvers take turns within each repeat, both medians of the same repeats):",
            "",
        ]
        lines += [
            "| T | E | K | dist | method | ours ms | scipy ms | speedup | gap vs exact |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in base:
            lines.append(
                f"| {r['T']} | {r['E']} | {r['K']} | {r['dist']} | {r['method']} | {r['ms']:.2f} | "
                f"{r['scipy_ms']:.1f} | {r['speedup_vs_scipy']:.0f}x | {r['gap_vs_exact']:.2e} |"
            )
        lines.append("")
    lines += [
        "All routers side by side (max_load = max/mean tokens per expert; drop@cf = slots over a capacity of"
        " cf x mean; quality = (obj - random) / (top-k bound - random), 1 = as good as unconstrained top-k):",
        "",
        "| T | E | K | dist | method | ms | max_load | drop@1.0 | drop@1.25 | quality |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['T']} | {r['E']} | {r['K']} | {r['dist']} | {r['method']} | {r['ms']:.2f} | {r['max_load']:.3f} | "
            f"{r['drop@1.0']:.3f} | {r['drop@1.25']:.3f} | {r['quality']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(11, 4))
    styles = {8: ":", 64: "--", 256: "-"}
    for i, name in enumerate(("base", "base_approx", "topk", "sinkhorn", "expert_choice")):
        color = f"C{i}"
        sel = sorted(
            (r for r in rows if r["method"] == name and r["dist"] == "gaussian" and r["K"] == 1), key=lambda r: r["T"]
        )
        for e in sorted({r["E"] for r in sel}):
            pts = [r for r in sel if r["E"] == e]
            ax_t.plot(
                [r["T"] for r in pts],
                [r["ms"] for r in pts],
                styles.get(e, "-"),
                marker="o",
                color=color,
                label=f"{name} E={e}",
            )
        sel = [r for r in rows if r["method"] == name]
        ax_l.scatter(
            [r["T"] * r["K"] / r["E"] for r in sel], [r["max_load"] for r in sel], label=name, s=12, color=color
        )
    ax_t.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="median ms", title="routing time (gaussian, K=1)")
    ax_l.set(xscale="log", yscale="log", xlabel="tokens per expert T*K/E", ylabel="max_load / mean", title="balance")
    ax_t.legend(fontsize=6)
    ax_l.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small grid (T <= 1024): about 10 s of CPU")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per case (median reported)")
    ap.add_argument("--dists", nargs="+", default=None, choices=DISTS + EXTRA_DISTS)
    for dim in ("T", "E", "K"):
        ap.add_argument(f"--{dim}", type=int, nargs="+", default=None, help=f"the {dim} values (default: the grid's)")
    ap.add_argument("--sinkhorn-iters", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("runs/routing"))
    ap.add_argument("--docs", action="store_true", help="rewrite the routing section of docs/benchmarks.md")
    args = ap.parse_args(argv)
    grid = {dim: getattr(args, dim) or values for dim, values in (QUICK if args.quick else GRID).items()}
    dists = args.dists or (("gaussian", "skewed") if args.quick else DISTS)
    repeats = args.repeats or (3 if args.quick else 5)
    cases = [(t, e, k, d) for t in grid["T"] for e in grid["E"] for k in grid["K"] if k <= e for d in dists]
    try:
        from tqdm import tqdm
    except ImportError:  # progress bars are optional

        def tqdm(x, **_):
            return x

    rows = []
    for t, e, k, d in tqdm(cases, desc="routing cases"):
        rows.extend(run_case(t, e, k, d, repeats, args.sinkhorn_iters))
    meta = {**run_meta("benchmarks.routing", argv), "repeats": repeats}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "routing.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = markdown(rows, meta)
    (args.out / "routing.md").write_text(md)
    png = args.out / "routing.png"
    try:
        plot(rows, png)
    except ImportError:
        print("matplotlib missing: no plot (pip install 'moe[bench]')")
    print(md)
    if args.docs:
        img = Path("docs/img/routing.png")
        img.parent.mkdir(parents=True, exist_ok=True)
        img.write_bytes(png.read_bytes())
        write_section("routing", f"{md}\n![routing benchmark](img/routing.png)", "## Routing")


if __name__ == "__main__":
    main()
