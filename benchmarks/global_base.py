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
``--run DIR`` replays a `moe train` run instead: the scores every BASE layer of the model at
each checkpoint (``--replay-steps``: which) routes on ``--steps`` consecutive batches of the
run's data from that step on, W * T tokens each (its E and K are the run's), one layer at a
time, each layer routed by the simulated group's assignment (`ReplayedLayers`).
Cold: every step without previous prices (from the ranks' local start, `price_base`);
warm: each step from the previous step's prices (per layer). ``--cold first`` solves only
the first step (of each checkpoint) cold.

With ``--check`` each objective is compared with the stacked single-process solve's, up to
``--check-max-gb`` of stacked scores (``equal``). Beyond, where that solve's copies would not
fit, the objective is certified instead (``certified``): the returned prices give an upper
bound on every balanced assignment's total (`assignment_bound`, weak duality), and the
solve's total lies within the same tolerance of it. The gathered path's bytes are W x T x E x
4 either way.

    python -m benchmarks.global_base --W 8 64 256 --T 4096 --E 64 256 --K 1 --scores random
    python -m benchmarks.global_base --W 8 --T 4096 --E 64 --K 1 --scores training --steps 8
    python -m benchmarks.global_base --W 8 --T 4096 --run runs/base64 --replay-steps 25 400 --steps 2
    python -m benchmarks.global_base --W 1024 --T 8192 --run runs/base64 --replay-steps 400 --steps 2 --cold first
    python -m benchmarks.global_base --W 1024 --T 8192 --run runs/base256 --replay-steps 400 --steps 2 --cold first \
        --spill /var/tmp
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch

from moe.parallel.price_base import price_balanced_assignment
from moe.parallel.price_margin import GAP_BINS
from moe.parallel.price_prices import PAIR_BINS, chain_values
from moe.parallel.reduction import ShardReduce
from moe.routing.balanced import assignment_bound, assignment_score, balanced_assignment


def random_steps(world: int, tokens: int, experts: int, steps: int, seed: int = 0):
    """``steps`` score matrices (W * T, E), one layer."""
    g = torch.Generator().manual_seed(seed)
    offset = 0.3 * torch.randn(experts, generator=g)
    for _ in range(steps):
        yield [torch.randn(world * tokens, experts, generator=g).add_(offset)]  # in place: one copy


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
    seen = _record_assign(model)
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


def run_steps(run_dir: str, world: int, tokens: int, replay: list[int] | None, batches: int, spill: str | None = None):
    """The scores every BASE layer of a `moe train` run routes, replayed from its checkpoints:
    per checkpoint (those at the steps in ``replay``, or all), its model's router inputs on
    ``batches`` consecutive batches of the run's data from that step on (W * T tokens each, in
    sequences of the run's length, the last one cut short where W * T is not a multiple of it;
    the run's own batches hold fewer). Yields (data step, ``run@<checkpoint step>``, layers):
    `ReplayedLayers`, made one layer at a time as they are read (``spill``: their scores in a
    file under this folder, `ReplayedLayers`)."""
    from pathlib import Path

    from moe.models.llama import Llama
    from moe.train.checkpoint import load_model_weights
    from moe.train.config import TrainConfig, model_config_from_dict, run_tokenizer
    from moe.train.data import load_corpus, load_tokenizer
    from moe.train.manifest import read_run_config

    info = read_run_config(Path(run_dir))
    cfg = TrainConfig.from_dict(info["train"])
    corpus = load_corpus(cfg.data, load_tokenizer(run_tokenizer(cfg)), seq_len=cfg.seq_len,
                         val_fraction=cfg.val_fraction, text_key=cfg.text_key)  # fmt: skip
    found = {int(p.name.split("_")[1]): p for p in Path(run_dir, "checkpoints").glob("step_*")}
    missing = sorted(set(replay or ()) - set(found))
    if missing:
        raise SystemExit(f"--replay-steps: {run_dir} has no checkpoint at steps {missing} (it has {sorted(found)})")
    seqs = -(-world * tokens // cfg.seq_len)
    for step in replay or sorted(found):
        with torch.device("meta"):
            model = Llama(model_config_from_dict(info["model"]))
        model.to_empty(device="cpu")
        model.init_weights()
        load_model_weights(found[step], model)
        model.train()  # the router solves BASE only in training mode; no gradients are taken
        for b in range(batches):
            inputs, _ = corpus.batch(step + b, cfg.seed, seqs, cfg.seq_len)
            yield step + b, f"run@{step}", ReplayedLayers(model, inputs, world * tokens, spill=spill)
        del model


class _Routed(Exception):
    """Raised by a recording router once it has its scores: the rest of the block is not needed."""


class ReplayedLayers:
    """The router scores (N, E) of every BASE layer of ``model`` on the first ``n`` tokens of
    ``inputs`` (B, S), in layer order, each made when it is read: the forward runs one block at
    a time over chunks of ``chunk`` sequences (the blocks are causal and per-sequence, so the
    chunks give the whole batch's values; another MoE layer also runs per chunk, right for
    per-token routers such as top-k, not for those that route over the batch), and only the
    BASE routing sees all N tokens at once.
    Each BASE layer routes by the assignment given to `use` before the next layer is read, or,
    where none is given, by its own single-process solve, as the model would. One batch's
    hidden states (N, D) and one layer's scores are held at a time, never every layer's.
    ``spill``: a folder where each layer's scores and the hidden states are held in files
    (unlinked at once) mapped into memory, so that the kernel can page them out while a solve
    holds its own copy of the scores (at W = 1024, T = 8192, E = 256 the scores take 8.6 GB,
    and so does that copy; the hidden states 2.1 GB at the 256-expert run's D = 64)."""

    def __init__(self, model, inputs: torch.Tensor, n: int, chunk: int = 64, spill: str | None = None) -> None:
        if not 0 < n <= inputs.numel():
            raise ValueError(f"n must be in [1, {inputs.numel()}] (the tokens of inputs), got {n}")
        self.model, self.chosen, self.spill = model, None, spill
        full, rest = divmod(n, inputs.shape[1])
        self.inputs = list(inputs[:full].split(chunk)) + ([inputs[full : full + 1, :rest]] if rest else [])
        self.sizes = [x.numel() for x in self.inputs]  # each chunk's tokens

    def use(self, assignment: torch.Tensor) -> None:
        """The assignment (N, K) the layer last read routes by."""
        self.chosen = assignment

    def __iter__(self):
        model = self.model
        routers = [getattr(b.feed_forward, "router", None) if b.is_moe else None for b in model.layers.values()]
        routers = [r if hasattr(r, "assign") else None for r in routers]  # BASE layers'
        if all(r is None for r in routers):
            return
        last = max(i for i, r in enumerate(routers) if r is not None)  # no blocks after it are run
        with torch.no_grad():  # not around the yields: the reader's code keeps its own grad mode
            h = self._held(model.tok_embeddings(x) for x in self.inputs)
        for i, (block, router) in enumerate(zip(model.layers.values(), routers, strict=True)):
            if router is None:
                with torch.no_grad():
                    h = self._held(block(x, model.rope) for x in h)
                continue
            with torch.no_grad():
                scores, k, options = self._scores(block, router, h)
            self.chosen = None
            yield scores
            if i == last:
                return
            chosen = self.chosen if self.chosen is not None else router.assign(scores, k, **options)
            self.chosen = None
            del scores
            n = sum(self.sizes)
            if tuple(chosen.shape) != (n, k):
                raise ValueError(f"use: the assignment must be (N, K) = ({n}, {k}), got {tuple(chosen.shape)}")
            rows = iter(chosen.split(self.sizes))
            with _assigning(router, lambda s, k, _rows=rows, **_: next(_rows)), torch.no_grad():
                h = self._held(block(x, model.rope) for x in h)

    def _held(self, chunks) -> list[torch.Tensor]:
        """The hidden states of every chunk, as they are made: with ``spill``, each copied into
        its place in one mapped file as it comes (so at most one chunk is held beside them)."""
        if self.spill is None:
            return list(chunks)
        held, buf, at = [], None, 0
        for x in chunks:
            if buf is None:
                buf = mapped_file(self.spill, (sum(self.sizes), x.shape[-1]))
            rows = x.numel() // x.shape[-1]
            held.append(buf[at : at + rows].view(x.shape).copy_(x))
            at += rows
        return held

    def _scores(self, block, router, h):
        """The router's scores of every chunk of ``h``, in one (N, E) tensor, and its K and options."""
        shape = (sum(self.sizes), router.config.num_experts)
        out = torch.empty(shape) if self.spill is None else mapped_file(self.spill, shape)
        rows, seen = iter(out.split(self.sizes)), {}

        def record(s, k, **options):
            next(rows).copy_(s)
            seen.update(k=k, options=options)
            raise _Routed

        with _assigning(router, record):
            for x in h:
                try:
                    block(x, self.model.rope)
                except _Routed:
                    pass
        return out, seen["k"], seen["options"]


def mapped_file(folder: str, shape: tuple[int, int]) -> torch.Tensor:
    """A float32 tensor of ``shape`` whose memory is a new file in ``folder``, mapped shared
    and unlinked at once (the mapping keeps it until the tensor goes): its pages can be
    written back and dropped under memory pressure instead of held."""
    import os
    import tempfile

    fd, path = tempfile.mkstemp(dir=folder, suffix=".scores")
    try:
        os.ftruncate(fd, shape[0] * shape[1] * 4)
        return torch.from_file(path, shared=True, size=shape[0] * shape[1], dtype=torch.float32).view(shape)
    finally:
        os.close(fd)
        os.unlink(path)


@contextlib.contextmanager
def _assigning(router, assign):
    """``router`` solves by ``assign`` within; its own solver (an attribute of the instance) after."""
    solve, router.assign = router.assign, assign
    try:
        yield
    finally:
        router.assign = solve


def run_model_config(run_dir: str):
    """The model config of a `moe train` run folder."""
    from pathlib import Path

    from moe.train.config import model_config_from_dict
    from moe.train.manifest import read_run_config

    return model_config_from_dict(read_run_config(Path(run_dir))["model"])


def _record_assign(model) -> list[torch.Tensor]:
    """Wrap every BASE router's solve to keep a copy of its scores; returns the list it fills."""
    seen: list[torch.Tensor] = []
    for m in model.modules():
        router = getattr(m, "router", None)
        if router is not None and hasattr(router, "assign"):
            solve = router.assign

            def record(scores, k, _solve=solve, **options):
                seen.append(scores.detach().clone())
                return _solve(scores, k, **options)

            router.assign = record
    return seen


def bytes_by_part(
    log: list[tuple[str, int, int]], world: int, experts: int, check_from: int | None = None
) -> dict[str, int]:
    """Where one solve's bytes went, from its collectives (kind, values received, bytes) in the
    order they ran: the header (its maxima), the local start (a cold call's gather; the W x E
    values a warm call's first update carries), the prices (the updates' sums of one or two
    chains' counts, the pair rounds' counts, their agreeing max and the loads that check
    them), the margin's counts and rows (its first counts, E + W + 33 values, alone or riding
    on a pair rounds' check, the sum right after their max; then every band's), the
    certificate's counts and rows (from ``check_from``, where in ``log`` it began
    (`PriceStats.check_from`); without it, from its first count of 2W values, where 2W = E + W +
    33 reading as the margin's). A check whose rows ride with its counts (``round_bytes``)
    counts as rows."""
    out = dict.fromkeys(("header", "start", "prices", "margin_counts", "margin_rows", "check_counts", "check_rows"), 0)
    margin_count = experts + world + GAP_BINS + 1
    chain = chain_values(experts)
    pair = experts * experts * PAIR_BINS + experts
    prices = {("sum", chain), ("sum", 2 * chain), ("sum", pair), ("max", experts + 1)}
    phase, priced, agreed = "header", False, False
    for i, (kind, values, size) in enumerate(log):
        if check_from is not None and i >= check_from:
            phase = "check"
        elif phase == "header" and kind != "max":
            phase = "prices"
        if phase == "prices":
            if kind == "gather" and not priced:  # a cold call's local start
                out["start"] += size
                continue
            priced = True
            checks, agreed = agreed, (kind, values) == ("max", experts + 1)  # a check follows the pair max
            if kind == "sum" and values == chain + world * experts:  # a warm call's, on its first update
                out["start"] += world * experts * size // values
                out["prices"] += chain * size // values
                continue
            if checks and kind == "sum" and values == experts + margin_count:  # the margin's first counts on it
                out["prices"] += experts * size // values
                out["margin_counts"] += margin_count * size // values
                continue
            if (kind, values) not in prices:
                phase = "margin"
        if check_from is None and phase == "margin" and kind == "sum" and values == 2 * world != margin_count:
            phase = "check"
        if phase in ("header", "prices"):
            out[phase] += size
        else:
            out[f"{phase}_{'rows' if kind == 'gather' else 'counts'}"] += size
    return out


def run(
    world: int, tokens: int, experts: int, k: int, scores: str, steps: int, check: bool, *,
    check_max_gb: float = 4.0, run_dir: str | None = None, replay: list[int] | None = None, on_solve=None,
    cold: str = "every", spill: str | None = None, round_bytes: float = 0.0,
) -> list[dict]:  # fmt: skip
    """Every solve's figures. With ``check``, each objective is compared with the stacked
    single-process solve's where the stacked scores take at most ``check_max_gb`` (that solve
    holds several copies of them), and certified by its prices' bound beyond (`verify`).
    ``scores="run"`` replays the checkpoints of the `moe train` run in ``run_dir``
    (``replay``: their steps, or all; ``steps`` batches each), whose model sets E and K.
    ``on_solve``, where given, is called with each solve's figures as it ends. ``cold``:
    ``"every"`` step solved cold too, or only the ``"first"`` (`solve_steps`). ``spill``: a
    replay's scores held in files there (`ReplayedLayers`). ``round_bytes``: the price of a
    round (`price_balanced_assignment`)."""
    k, source = score_source(world, tokens, experts, k, scores, steps, run_dir, replay, spill)

    def solve(x, start):
        parts = list(x.split(tokens))
        t0 = time.perf_counter()
        out, p, st = price_balanced_assignment(parts, k, ShardReduce(world), prices=start, round_bytes=round_bytes)
        seconds = time.perf_counter() - t0
        out = torch.cat(out)
        objective = verify(x, out, p, k, check_max_gb) if check else None
        return p, dict(
            W=world, T=tokens, E=x.shape[1], K=k, rounds=st.rounds, updates=st.price_updates, checks=st.checks,
            bytes=st.bytes, margin_rows=st.margin_rows, gathered_bytes=world * tokens * x.shape[1] * 4,
            seconds=seconds, parts=bytes_by_part(st.log, world, x.shape[1], st.check_from), objective=objective,
        ), out  # fmt: skip

    rows = []
    for row in solve_steps(source, scores == "run", solve, cold):
        rows.append(row)
        if on_solve is not None:
            on_solve(row)
    return rows


def score_source(world: int, tokens: int, experts: int, k: int, scores: str, steps: int,
                 run_dir: str | None = None, replay: list[int] | None = None, spill: str | None = None):  # fmt: skip
    """(K, the scores as (step, label, layers) in order): ``random``, ``training`` or ``run``
    (the checkpoints of the `moe train` run in ``run_dir``, whose model sets E and K)."""
    if scores == "random":
        return k, ((i, scores, x) for i, x in enumerate(random_steps(world, tokens, experts, steps)))
    if scores == "training":
        return k, ((i, scores, x) for i, x in enumerate(training_steps(world, tokens, experts, k, steps)))
    return run_model_config(run_dir).moe.top_k, run_steps(run_dir, world, tokens, replay, steps, spill)


def solve_steps(source, replayed: bool, solve, cold: str = "every"):
    """Every solve of ``source``'s scores in order, its rows (the figures ``solve`` returns, with
    the step, label, layer and start): per layer, cold (no previous prices) and, from the second
    step on, warm (the previous step's prices, per layer; a replay's checkpoints start afresh,
    with no previous step); with ``cold="first"`` the later steps are solved warm only.
    ``solve(x, prices)`` returns (the prices, its figures, its assignment
    (N, K) or None); where ``layers`` has a ``use`` (`ReplayedLayers`), the last solve's
    assignment routes the layer before the next layer's scores are made. The rows keep no
    reference to ``x``, so each step's scores go before the next step's are made."""
    if cold not in ("every", "first"):
        raise ValueError(f"cold must be 'every' or 'first', got {cold!r}")
    prices: dict[int, torch.Tensor | None] = {}
    last: int | None = None
    for step, label, layers in source:
        for layer, x in enumerate(layers):
            first = last is None or (replayed and step != last + 1)  # no previous step to start from
            for mode in ("cold", "warm"):
                if (mode == "warm" and first) or (mode == "cold" and cold == "first" and not first):
                    continue
                p, row, out = solve(x, None if mode == "cold" else prices.get(layer))
                if mode == "warm" or first:
                    prices[layer] = p
                yield dict(scores=label, mode=mode, step=step, layer=layer) | row
            if out is not None and hasattr(layers, "use"):
                layers.use(out)
            del x, out
        last = step
        del layers


def verify(x: torch.Tensor, out: torch.Tensor, prices: torch.Tensor | None, k: int, max_gb: float) -> str:
    """The objective of a solve of the stacked scores ``x`` (N, E), within the solver's bound
    ``(2 N K + E) eps R`` (eps = 1e-6, R the largest per-token range): ``"equal"`` to the
    single-process solve's where ``x`` takes at most ``max_gb``, else ``"certified"``, at most
    that far below the upper bound the solve's own prices give. Raises
    AssertionError when the objective is off."""
    num_tokens, num_experts = x.shape
    scale = float(x.amax(1).sub(x.amin(1)).amax())
    tol = (2 * num_tokens * k + num_experts) * 1e-6 * scale
    got = float(assignment_score(x, out))
    if x.numel() * x.element_size() <= max_gb * 1e9:
        gap = got - float(assignment_score(x, balanced_assignment(x, k)))
        assert abs(gap) <= tol, f"the objective is {gap} off the single-process solve's (tolerance {tol})"
        return "equal"
    upper = float(assignment_bound(x, prices, k)) if prices is not None else got  # None: k = E
    assert upper - got <= tol, f"the objective is up to {upper - got} below the optimum (tolerance {tol})"
    return "certified"


CONFIG = ("W", "T", "E", "K", "scores", "mode")


def by_config(rows: list[dict]):
    """Per configuration (`CONFIG`'s fields), in the order first seen: (its fields as a dict,
    its rows)."""
    for key in dict.fromkeys(tuple(r[f] for f in CONFIG) for r in rows):
        yield dict(zip(CONFIG, key, strict=True)), [r for r in rows if tuple(r[f] for f in CONFIG) == key]


def summary(rows: list[dict]) -> list[dict]:
    out = []
    for config, sel in by_config(rows):
        med = {f: statistics.median(r[f] for r in sel) for f in ("rounds", "bytes", "margin_rows", "seconds")}
        out.append(
            config
            | med
            | dict(n=len(sel), max_rounds=max(r["rounds"] for r in sel), gathered_bytes=sel[0]["gathered_bytes"])
            | dict(objective=_objective([r.get("objective") for r in sel]))
        )
    return out


def _objective(marks: list) -> str | None:
    """One summary's objective check: ``equal`` or ``certified`` (`verify`) when every solve
    says so, else each kind with its count, or None without ``--check``."""
    if all(m is None for m in marks):
        return None
    kinds = list(dict.fromkeys(marks))
    return kinds[0] if len(kinds) == 1 else ", ".join(f"{m} ({marks.count(m)} of {len(marks)})" for m in kinds)


def markdown(table: list[dict]) -> str:
    checked = any(r.get("objective") for r in table)
    lines = [
        "| W | T | E | K | scores | start | rounds (median, max) | bytes per rank | gathered bytes | ratio "
        "| margin rows (share) | solve s |" + (" objective |" if checked else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if checked else ""),
    ]
    for r in table:
        share = r["margin_rows"] / (r["W"] * r["T"])
        lines.append(
            f"| {r['W']} | {r['T']} | {r['E']} | {r['K']} | {r['scores']} | {r['mode']} | {r['rounds']:g}, "
            f"{r['max_rounds']} | {r['bytes'] / 1e6:.3f} MB | {r['gathered_bytes'] / 1e6:.1f} MB | "
            f"{r['bytes'] / r['gathered_bytes']:.2%} | {r['margin_rows']:g} ({share:.2%}) | {r['seconds']:.2f} |"
            + (f" {r.get('objective') or ''} |" if checked else "")
        )
    return "\n".join(lines)


def _large_buffers_from_mmap() -> None:
    """glibc: serve buffers of 128 KiB and more by mmap, so that the W shards' per-solve
    temporaries go back to the system when freed (from the heap, fragmentation kept about one
    more copy of the scores resident at W = 64, E = 256). No-op elsewhere."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def progress(row: dict) -> None:
    """One solve's figures on stderr as it ends (a long replay shows how far it has got)."""
    print(
        f"{row['scores']} step {row['step']} layer {row['layer']} {row['mode']}: {row['rounds']} rounds, "
        f"{row['bytes'] / row['gathered_bytes']:.2%} of the gathered bytes, {row['margin_rows']} margin rows, "
        f"{row['seconds']:.1f} s" + (f", {row['objective']}" if row.get("objective") else ""),
        file=sys.stderr, flush=True,
    )  # fmt: skip


def score_args(ap: argparse.ArgumentParser, steps: int) -> argparse.ArgumentParser:
    """The shapes and scores both global BASE benchmarks take (``steps``: the default)."""
    ap.add_argument("--W", type=int, nargs="+", default=[8])
    ap.add_argument("--T", type=int, nargs="+", default=[4096])
    ap.add_argument("--E", type=int, nargs="+", default=[64])
    ap.add_argument("--K", type=int, nargs="+", default=[1])
    ap.add_argument("--scores", choices=("random", "training"), default="random")
    ap.add_argument("--run", help="replay a `moe train` run folder's checkpoints instead (its model sets E and K)")
    ap.add_argument("--replay-steps", type=int, nargs="+", help="with --run: the checkpoints' steps (default: all)")
    ap.add_argument("--steps", type=int, default=steps, help="steps per configuration (the first is cold only); "
                    "with --run, consecutive batches per checkpoint")  # fmt: skip
    return ap


def parse_score_args(ap: argparse.ArgumentParser, argv) -> tuple[argparse.Namespace, str]:
    """The arguments, and the scores' kind (``run`` with ``--run``, whose model then sets E and K)."""
    args = ap.parse_args(argv)
    if args.run:
        cfg = run_model_config(args.run)
        args.E, args.K = [cfg.moe.num_experts], [cfg.moe.top_k]
    elif args.replay_steps:
        ap.error("--replay-steps needs --run")
    return args, "run" if args.run else args.scores


def main(argv=None) -> None:
    _large_buffers_from_mmap()
    ap = score_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]), steps=4)
    ap.add_argument("--check", action="store_true", help="compare each objective with the single-process solve")
    ap.add_argument("--check-max-gb", type=float, default=4.0,
                    help="compare with the stacked solve only where its scores take at most this many GB "
                    "(that solve holds several copies); beyond, certify by the prices' bound")  # fmt: skip
    ap.add_argument("--json", help="write every solve's figures here")
    ap.add_argument("--cold", choices=("every", "first"), default="every",
                    help="solve every step cold as well as warm, or only the first (of each checkpoint with "
                    "--run): the cold calls of a large group take the longest")  # fmt: skip
    ap.add_argument("--spill", metavar="DIR",
                    help="with --run: hold each layer's scores and the hidden states in files under DIR, mapped "
                    "into memory (pages the kernel can drop while the solve holds its own copy)")  # fmt: skip
    ap.add_argument("--round-bytes", type=float, default=0.0,
                    help="the price of a round of collectives in bytes a rank receives (the router's "
                    "base_round_bytes); 0: bytes alone")  # fmt: skip
    args, scores = parse_score_args(ap, argv)
    if args.spill and not args.run:
        ap.error("--spill needs --run")

    def one(world, tokens, experts, k):
        return run(world, tokens, experts, k, scores, args.steps, args.check, check_max_gb=args.check_max_gb,
                   run_dir=args.run, replay=args.replay_steps, on_solve=progress, cold=args.cold,
                   spill=args.spill, round_bytes=args.round_bytes)  # fmt: skip

    grid(args, one, lambda rows: markdown(summary(rows)))


def grid(args, one, table) -> None:
    """Every (W, T, E, K) of ``args`` through ``one(W, T, E, K)`` (its rows), each one's table
    lines as it ends (``table``: rows to markdown), ``--json``, then the whole table."""
    rows = []
    for world in args.W:
        for tokens in args.T:
            for experts in args.E:
                for k in args.K:
                    got = one(world, tokens, experts, k)
                    rows += got
                    print("\n".join(table(got).splitlines()[2:]), flush=True)  # as each one ends
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
