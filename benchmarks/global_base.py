"""Global BASE by prices at cluster scale, W ranks simulated in one process (`ShardReduce`).

Per (W, T, E, K, scores, cold or warm): the collectives (rounds), the values each rank receives
(bytes, fp32 scores), the rows gathered at the margin, and the solve time, next to the bytes
each rank receives on the gathered path (every rank's (T, E) fp32 scores). Rounds, bytes and
margin rows are deterministic; the time is only meaningful on a quiet machine. ``--json``
also writes, per solve, where its bytes went (``parts``: header, price updates, the margin's
counts and rows, the certificate's), told apart by the collectives' sizes.

Scores: ``random`` (Gaussian with a fixed per-expert offset, a fresh draw per step) or
``training`` (the router inputs of a tiny Llama-2-MoE with BASE layers, trained in-process for
``--steps`` steps on W * T tokens per step; every layer's scores of every step are replayed).
Cold: every step from zero prices; warm: each step from the previous step's prices (per layer).

    python -m benchmarks.global_base --W 8 64 256 --T 4096 --E 64 256 --K 1 --scores random
    python -m benchmarks.global_base --W 8 --T 4096 --E 64 --K 1 --scores training --steps 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from moe.parallel.price_base import GAP_BINS, price_balanced_assignment
from moe.parallel.price_prices import BINS
from moe.parallel.reduction import ShardReduce
from moe.routing.balanced import assignment_score, balanced_assignment


def random_steps(world: int, tokens: int, experts: int, steps: int, seed: int = 0):
    """``steps`` score matrices (W * T, E), one layer."""
    g = torch.Generator().manual_seed(seed)
    offset = 0.3 * torch.randn(experts, generator=g)
    for _ in range(steps):
        yield [torch.randn(world * tokens, experts, generator=g) + offset]


def training_steps(world: int, tokens: int, experts: int, k: int, steps: int, seed: int = 0):
    """The scores every BASE layer of a tiny Llama-2-MoE routes, per training step (a list of
    (W * T, E) per step, one per layer), trained on zipf-distributed tokens."""
    from moe import MoEConfig
    from moe.models.llama import Llama, LlamaConfig

    seq = 256
    batch = max(1, world * tokens // seq)
    moe = MoEConfig(dim=32, hidden_dim=48, num_experts=experts, router="base", top_k=k)
    cfg = LlamaConfig(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden_dim=64, max_seq_len=seq, moe=moe,
        moe_every=1,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Llama(cfg)
    seen: list[torch.Tensor] = []
    for m in model.modules():
        router = getattr(m, "router", None)
        if router is not None and hasattr(router, "assign"):
            solve = router.assign

            def record(scores, k, _solve=solve, **options):
                seen.append(scores.detach().clone())
                return _solve(scores, k, **options)

            router.assign = record
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    weights = 1.0 / torch.arange(1, cfg.vocab_size + 1).double()
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        seen.clear()
        data = torch.multinomial(weights, batch * (seq + 1), replacement=True, generator=g).view(batch, seq + 1)
        logits = model(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        yield [s[: world * tokens] for s in seen]


def bytes_by_part(log: list[tuple[str, int]], world: int, experts: int) -> dict[str, int]:
    """Where one solve's bytes went, from its collectives (kind, values received): the header
    (float64), the price updates (int32 histograms), the margin's counts and rows, the
    certificate's counts and rows (int64)."""
    out = dict.fromkeys(("header", "prices", "margin_counts", "margin_rows", "check_counts", "check_rows"), 0)
    for kind, values in log:
        if kind == "max":
            out["header"] += 8 * values
        elif kind == "sum" and values == experts * (BINS + 2):
            out["prices"] += 4 * values
        elif kind == "sum":
            out["margin_counts" if values == experts + world + GAP_BINS + 1 else "check_counts"] += 8 * values
        else:
            out["check_rows" if out["margin_rows"] or out["check_counts"] else "margin_rows"] += 8 * values
    return out


def run(world: int, tokens: int, experts: int, k: int, scores: str, steps: int, check: bool) -> list[dict]:
    rows = []
    source = (
        random_steps(world, tokens, experts, steps)
        if scores == "random"
        else training_steps(world, tokens, experts, k, steps)
    )
    prices: dict[int, torch.Tensor | None] = {}
    for step, layers in enumerate(source):
        for layer, x in enumerate(layers):
            parts = list(x.split(tokens))
            for mode in ("cold", "warm"):
                start = None if mode == "cold" else prices.get(layer)
                if mode == "warm" and step == 0:
                    continue
                t0 = time.perf_counter()
                out, p, st = price_balanced_assignment(parts, k, ShardReduce(world), prices=start)
                seconds = time.perf_counter() - t0
                if mode == "warm" or step == 0:
                    prices[layer] = p
                if check:
                    ref = balanced_assignment(x, k)
                    gap = float(assignment_score(x, torch.cat(out)) - assignment_score(x, ref))
                    assert abs(gap) <= (2 * x.shape[0] * k + experts) * 1e-6 * float(x.amax(1).sub(x.amin(1)).amax())
                rows.append(
                    dict(
                        W=world, T=tokens, E=experts, K=k, scores=scores, mode=mode, step=step, layer=layer,
                        rounds=st.rounds, updates=st.price_updates, checks=st.checks, bytes=st.bytes,
                        margin_rows=st.margin_rows, gathered_bytes=world * tokens * experts * 4, seconds=seconds,
                        parts=bytes_by_part(st.log, world, experts),
                    )
                )  # fmt: skip
        del layers
    return rows


def summary(rows: list[dict]) -> list[dict]:
    out = []
    keys = sorted({(r["W"], r["T"], r["E"], r["K"], r["scores"], r["mode"]) for r in rows})
    for key in keys:
        sel = [r for r in rows if (r["W"], r["T"], r["E"], r["K"], r["scores"], r["mode"]) == key]
        med = {f: statistics.median(r[f] for r in sel) for f in ("rounds", "bytes", "margin_rows", "seconds")}
        out.append(
            dict(zip(("W", "T", "E", "K", "scores", "mode"), key, strict=True))
            | med
            | dict(n=len(sel), max_rounds=max(r["rounds"] for r in sel), gathered_bytes=sel[0]["gathered_bytes"])
        )
    return out


def markdown(table: list[dict]) -> str:
    lines = [
        "| W | T | E | K | scores | start | rounds (median, max) | bytes per rank | gathered bytes | ratio "
        "| margin rows (share) | solve s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        share = r["margin_rows"] / (r["W"] * r["T"])
        lines.append(
            f"| {r['W']} | {r['T']} | {r['E']} | {r['K']} | {r['scores']} | {r['mode']} | {r['rounds']:g}, "
            f"{r['max_rounds']} | {r['bytes'] / 1e6:.3f} MB | {r['gathered_bytes'] / 1e6:.1f} MB | "
            f"{r['bytes'] / r['gathered_bytes']:.2%} | {r['margin_rows']:g} ({share:.2%}) | {r['seconds']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--W", type=int, nargs="+", default=[8])
    ap.add_argument("--T", type=int, nargs="+", default=[4096])
    ap.add_argument("--E", type=int, nargs="+", default=[64])
    ap.add_argument("--K", type=int, nargs="+", default=[1])
    ap.add_argument("--scores", choices=("random", "training"), default="random")
    ap.add_argument("--steps", type=int, default=4, help="steps per configuration (the first is cold only)")
    ap.add_argument("--check", action="store_true", help="compare each objective with the single-process solve")
    ap.add_argument("--json", help="write every solve's figures here")
    args = ap.parse_args(argv)
    rows = []
    for world in args.W:
        for tokens in args.T:
            for experts in args.E:
                for k in args.K:
                    rows += run(world, tokens, experts, k, args.scores, args.steps, args.check)
                    print(markdown(summary(rows[-1:])).splitlines()[-1], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(markdown(summary(rows)))


if __name__ == "__main__":
    main()
