"""The other subcommands: ``moe generate | export | data | plan | bench``."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from .common import UsageError, _fmt, _Parser, _positive

__all__ = ["BENCHMARKS"]


BENCHMARKS = {"routing": "routing", "layer": "moe_layer", "gemm": "grouped_gemm", "a2a": "all_to_all"}


def _generate_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="generate text from a run's latest checkpoint", formatter_class=_fmt)
    p.add_argument("--run", required=True, help="run folder written by moe train")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max-new-tokens", type=_positive("--max-new-tokens"), default=64, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole prefix at every token")
    p.add_argument("--print-ids", action="store_true", help="also print the generated token ids")
    return p


def _check_run(run: str) -> Path:
    path = Path(run)
    if not (path / "config.json").exists():
        raise UsageError(f"--run {run}: not a run folder (no config.json)")
    from ..train.manifest import checkpoint_folders

    if not checkpoint_folders(path):
        raise UsageError(f"--run {run}: the run has no checkpoint yet")
    return path


def _generate(args, p, argv) -> int:
    if not (args.temperature >= 0 and math.isfinite(args.temperature)) or not 0 < args.top_p <= 1:
        raise UsageError(f"need a finite --temperature >= 0 and 0 < --top-p <= 1, got {args.temperature}, {args.top_p}")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as err:  # bytes the shell passed that are not UTF-8 (kept as surrogates)
        raise UsageError(f"--prompt is not valid UTF-8 (byte {err.start} of the argument)") from None
    run = _check_run(args.run)
    from ..train.generate import generate_from_run
    from ..train.manifest import CheckpointError

    try:
        return generate_from_run(run, args)
    except CheckpointError as err:  # no intact checkpoint or config left: the message says which and why
        raise UsageError(f"--run {args.run}: {err}") from None


def _export_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("export", help="write a run's model in another format", formatter_class=_fmt)
    p.add_argument("--run", required=True, help="run folder written by moe train")
    p.add_argument("--to", choices=["hf"], default="hf", help="format: hf = transformers (safetensors + config)")
    p.add_argument("dest", help="output folder")
    return p


def _export(args, p, argv) -> int:
    run = _check_run(args.run)
    dest = Path(args.dest)
    if dest.exists() and any(dest.iterdir()):
        raise UsageError(f"{dest} exists and is not empty: choose another output folder")
    from ..train.export import export_hf

    try:
        kind = export_hf(run, dest)
    except ValueError as err:  # the model has no counterpart there: the message says why
        raise UsageError(str(err)) from None
    print(f"wrote {kind} to {dest}")
    return 0


def _data_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("data", help="prepare training data (moe data tokenize)", formatter_class=_fmt)
    dsub = p.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    t = dsub.add_parser("tokenize", help="text, .jsonl, .parquet or datasets folders -> token shards",
                        formatter_class=_fmt)  # fmt: skip
    t.add_argument("--in", dest="inputs", required=True, help="a file or folder of documents")
    t.add_argument("--out", required=True, help="the shard folder to write (moe train --data takes it)")
    t.add_argument("--tokenizer", default=None, help="a local tokenizer.json (default: bytes + 4 specials)")
    t.add_argument("--text-key", default="text", help="the text field of .jsonl / .parquet / datasets rows")
    t.add_argument("--workers", type=_positive("--workers"), default=max(1, min(8, os.cpu_count() or 1)),
                   help="tokenizing processes")  # fmt: skip
    t.add_argument("--shard-tokens", type=_positive("--shard-tokens"), default=1 << 28, help="tokens per shard")
    return p


def _data(args, p, argv) -> int:
    if not Path(args.inputs).exists():
        raise UsageError(f"--in {args.inputs}: no such file or folder")
    if args.tokenizer is not None and not Path(args.tokenizer).is_file():
        raise UsageError(f"--tokenizer {args.tokenizer}: no such file (a tokenizer.json)")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {out} exists: choose a new folder for the shards")
    from ..train.tokenize import tokenize_corpus

    try:
        index = tokenize_corpus(
            args.inputs, args.out, tokenizer=args.tokenizer, text_key=args.text_key, workers=args.workers,
            shard_tokens=args.shard_tokens, progress=sys.stderr.isatty(),
        )  # fmt: skip
    except ValueError as err:
        raise UsageError(str(err)) from None
    tokens = sum(s["tokens"] for s in index["shards"])
    docs = sum(s["documents"] for s in index["shards"])
    print(f"wrote {tokens} tokens of {docs} documents in {len(index['shards'])} shard(s) ({index['dtype']}) to {out}")
    return 0


def _plan_parser(sub) -> argparse.ArgumentParser:
    # listed in `moe --help`; `main` hands everything after "plan" to the planner's own parser
    # (`moe plan --help` lists its options), since argparse cannot pass on leading options
    p = sub.add_parser("plan", help="memory and step time of a layout (moe.plan)", add_help=False)
    p.add_argument("options", nargs=argparse.REMAINDER, help="the planner's options (moe plan --help)")
    return p


def _plan(argv: list[str]) -> int:
    from ..plan.cli import main as plan_main

    try:
        return plan_main(argv)
    except SystemExit as e:  # the planner's parser: --help (0) or a bad option (2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


def _bench_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="run a benchmark (python -m benchmarks.<name>)", formatter_class=_fmt)
    p.add_argument("name", choices=sorted(BENCHMARKS), help="routing, layer, gemm or a2a")
    p.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options (--help lists them)")
    return p


def _bench(args, p, argv) -> int:
    import importlib.util
    import runpy

    module = f"benchmarks.{BENCHMARKS[args.name]}"
    if importlib.util.find_spec("benchmarks") is None:
        # the `moe` script's sys.path starts at its own folder, not the current one: look in the
        # current folder, then beside the package (a source checkout installed in place)
        roots = [Path.cwd(), Path(__file__).resolve().parents[2]]
        root = next((r for r in roots if (r / "benchmarks" / "__init__.py").is_file()), None)
        if root is None:
            raise UsageError(f"{module} is not importable: run moe bench from the repository's root")
        sys.path.insert(0, str(root))
    sys.argv = [module, *args.options]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0
