"""The ``moe`` command: ``moe train | generate | export | data | plan | bench``.

Arguments are checked before anything heavy is imported or read; a bad one ends the command
with exit status 2 and a single line naming the option, what it needs and what it got.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
from pathlib import Path

__all__ = ["main"]

BENCHMARKS = {"routing": "routing", "layer": "moe_layer", "gemm": "grouped_gemm", "a2a": "all_to_all"}
ROUTERS = ("base", "topk", "sinkhorn", "expert_choice")
# interleaved: 1F1B with 2 stages per rank (also by the name moe plan and pipeline_llama give it)
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "interleaved_1f1b")


class UsageError(Exception):
    """A bad argument: the command exits 2 with this one-line message."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message
        raise UsageError(f"{message} (see {self.prog} --help)")


def _fmt(prog):
    return argparse.ArgumentDefaultsHelpFormatter(prog, max_help_position=32, width=100)


def _positive(name):
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {v}")
        return v

    return parse


def _train_parser(sub) -> argparse.ArgumentParser:
    from .train.config import TrainConfig

    d = TrainConfig()
    p = sub.add_parser("train", help="train a Llama-2-MoE model", formatter_class=_fmt)
    p.add_argument("--config", default=None, help="a TOML file of these options by section (flags override it)")
    m = p.add_argument_group("model")
    m.add_argument("--preset", default=d.preset, help="model preset (python -m moe.models.llama lists them)")
    m.add_argument("--experts", type=_positive("--experts"), default=None, help="experts per MoE layer (preset's)")
    m.add_argument("--top-k", type=_positive("--top-k"), default=None, help="experts per token (1 for base)")
    m.add_argument("--router", choices=ROUTERS, default=d.router, help="router of the MoE layers")
    m.add_argument("--moe-every", type=_positive("--moe-every"), default=None, help="every N-th MLP is MoE")
    m.add_argument("--dense", action="store_true", help="no MoE layer: a dense Llama")
    m.add_argument("--dim", type=_positive("--dim"), default=None, help="model width (preset's)")
    m.add_argument("--n-layers", type=_positive("--n-layers"), default=None, help="layers (preset's)")
    m.add_argument("--aux-loss-coef", type=float, default=None, help="load-balancing loss weight (preset's)")
    m.add_argument("--z-loss-coef", type=float, default=None, help="router z-loss weight (preset's)")
    m.add_argument("--bias-update-rate", type=float, default=None, help="top-k aux-loss-free bias step (0: off)")
    m.add_argument("--capacity-factor", type=float, default=None, help="expert capacity factor (None: dropless)")
    m.add_argument("--from-hf", default=None, help="start from a local transformers Llama folder (its shape, weights "
                   "and tokenizer.json; --preset is not used)")  # fmt: skip
    m.add_argument("--upcycle", type=_positive("--upcycle"), default=None,
                   help="with --from-hf: its MLPs become this many experts (the layers --moe-every picks)")  # fmt: skip
    g = p.add_argument_group("data")
    g.add_argument("--data", default=None, help="text, .jsonl, .parquet, datasets files or folders, or a "
                   "shard folder (moe data tokenize); default: the Python stdlib's source")  # fmt: skip
    g.add_argument("--data-changed-ok", action="store_true",
                   help="--resume on data that differ from the run's (recorded in config.json)")  # fmt: skip
    g.add_argument("--tokenizer", default=None, help="a local tokenizer.json (default: bytes + 4 specials)")
    g.add_argument("--text-key", default=d.text_key, help="the text field of .jsonl / .parquet / datasets rows")
    g.add_argument("--batch", type=_positive("--batch"), default=d.batch, help="global batch in sequences")
    g.add_argument("--seq-len", type=_positive("--seq-len"), default=d.seq_len, help="tokens per sequence")
    g.add_argument("--val-fraction", type=float, default=d.val_fraction, help="share of the tokens held out")
    g.add_argument("--eval-every", type=_positive("--eval-every"), default=d.eval_every, help="validation cadence")
    g.add_argument("--eval-batches", type=_positive("--eval-batches"), default=d.eval_batches, help="held-out batches")
    o = p.add_argument_group("optimiser")
    o.add_argument("--steps", type=_positive("--steps"), default=d.steps, help="optimiser steps of the schedule")
    o.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    o.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="final lr / peak lr (cosine)")
    o.add_argument("--warmup", type=int, default=d.warmup, help="linear warm-up steps")
    o.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay")
    o.add_argument("--grad-clip", type=float, default=d.grad_clip, help="max gradient norm")
    o.add_argument("--seed", type=int, default=d.seed, help="seeds the weights and the data order")
    r = p.add_argument_group("run")
    r.add_argument("--out", default=None, help="run folder (default: runs/<timestamp>)")
    r.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    r.add_argument("--checkpoint-every", type=_positive("--checkpoint-every"), default=d.checkpoint_every,
                   help="checkpoint cadence (and always at the end)")  # fmt: skip
    r.add_argument("--keep", type=_positive("--keep"), default=d.keep, help="checkpoints kept")
    r.add_argument("--stop-at", type=_positive("--stop-at"), default=None,
                   help="end after this step (checkpoint, exit 0), keeping the schedule of --steps")  # fmt: skip
    r.add_argument("--collective-timeout", type=_positive("--collective-timeout"), default=d.collective_timeout,
                   help="seconds a rank waits in a collective before the job ends naming the slow ranks")  # fmt: skip
    r.add_argument("--max-bad-steps", type=_positive("--max-bad-steps"), default=d.max_bad_steps,
                   help="NaN/inf losses or grad norms in a row (each step skipped) that end the run")  # fmt: skip
    r.add_argument("--plot-every", type=_positive("--plot-every"), default=None, help="plot cadence (eval's)")
    r.add_argument("--force", action="store_true", help="start even when the memory estimate exceeds this machine's")
    lay = p.add_argument_group("layout (world size = product of the dimensions)")
    lay.add_argument("--nproc", type=_positive("--nproc"), default=d.nproc, help="local processes (torchrun)")
    for name in ("tp", "pp", "ep", "dp-replicate"):
        lay.add_argument(f"--{name}", type=_positive(f"--{name}"), default=1, help=f"{name} size")
    lay.add_argument("--dp-shard", type=int, default=-1, help="FSDP size (-1: what the others leave)")
    lay.add_argument("--etp", action="store_true", help="tp ranks shard each expert's hidden dim")
    lay.add_argument("--pp-schedule", choices=PP_SCHEDULES, default=d.pp_schedule, help="pipeline schedule")
    lay.add_argument("--micro-batches", type=_positive("--micro-batches"), default=None,
                     help="pipeline micro-batches per data-parallel rank and step (None: --pp)")  # fmt: skip
    lay.add_argument("--layout", default=None,
                     help="moe plan's layout string (tp=2,pp=2,ep=2,...) instead of the flags above")  # fmt: skip
    return p


def _check_train(args, p) -> None:
    """Everything that can be checked without reading data or building the model."""
    from .models.llama import PRESETS
    from .train import runlock
    from .train.config import LAYOUT_FIELDS, RESUME_KEEPS

    if args.out is None:
        if args.resume:
            raise UsageError("--resume needs --out DIR, the run folder to continue")
        args.out = str(Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    out = Path(args.out)
    saved_model = None
    micro_batch = _apply_layout(args)
    if args.data is not None:  # a resumed run reads the same files from any directory
        args.data = str(Path(args.data).resolve())
    if args.resume:
        saved_info = _run_config(out, "--resume")
        saved, saved_model = saved_info["train"], saved_info.get("model")
        new_layout = any(key in args._explicit for key in LAYOUT_FIELDS)  # replaces the saved one whole
        for key, value in saved.items():  # the run's own values, unless given again
            if key in ("out", "resume", "stop_at", "data_changed_ok") or not hasattr(args, key):
                continue
            if key in args._explicit and key in RESUME_KEEPS and getattr(args, key) != value:
                flag = "--" + key.replace("_", "-")
                raise UsageError(f"{flag} {getattr(args, key)} differs from the run's {value}: a resumed run keeps it")
            if key not in args._explicit and not (new_layout and key in LAYOUT_FIELDS):
                setattr(args, key, value)
    elif out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file: name a folder for the run")
    else:
        _run_folder(runlock.check_fresh, out)
    if args.preset not in PRESETS:
        raise UsageError(f"--preset: unknown preset {args.preset!r}; choose one of {', '.join(sorted(PRESETS))}")
    if args.data is not None and not Path(args.data).exists():
        raise UsageError(f"--data {args.data}: no such file or folder")
    if args.data is not None and not (Path(args.data).is_file() or Path(args.data).is_dir()):
        raise UsageError(f"--data {args.data}: not a regular file or a folder (a FIFO or device is never read)")
    if args.upcycle is not None and args.from_hf is None:
        raise UsageError("--upcycle turns a checkpoint's MLPs into experts: it needs --from-hf PATH")
    if args.tokenizer is not None and not Path(args.tokenizer).is_file():
        raise UsageError(f"--tokenizer {args.tokenizer}: no such file (a tokenizer.json)")
    if args.stop_at is not None and args.stop_at > args.steps:
        raise UsageError(f"--stop-at {args.stop_at} must be <= --steps {args.steps}")
    if args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
    _check_numbers(args)
    launched = "WORLD_SIZE" in os.environ  # by torchrun (or by --nproc, which starts it)
    world = int(os.environ["WORLD_SIZE"]) if launched else args.nproc
    if launched and "nproc" in args._explicit and args.nproc != world:
        raise UsageError(f"--nproc {args.nproc} differs from torchrun's world size {world}: drop --nproc there")
    if args.etp and args.tp == 1:
        raise UsageError("--etp shards the experts over the tp ranks: it needs --tp > 1")
    fixed = args.tp * args.pp * args.dp_replicate
    dp_shard = args.dp_shard if args.dp_shard != -1 else world // fixed
    if dp_shard < 1 or fixed * dp_shard != world:
        raise UsageError(
            f"layout tp={args.tp} x pp={args.pp} x dp_replicate={args.dp_replicate} x dp_shard={args.dp_shard} "
            f"must multiply to the world size {world} (--nproc or torchrun's)"
        )
    dp = dp_shard * args.dp_replicate
    if args.batch % dp:
        raise UsageError(f"--batch {args.batch} must be divisible by the data-parallel size {dp}")
    if micro_batch is not None:
        from .train.preflight import micro_batches_for

        try:
            args.micro_batches = micro_batches_for(args.layout, micro_batch, args.batch // dp, args.pp)
        except ValueError as err:
            raise UsageError(str(err)) from None
    if dp_shard % args.ep:
        raise UsageError(f"--ep {args.ep} must divide --dp-shard {dp_shard}: the ep ranks are dp_shard ranks")
    n_layers = args.n_layers or PRESETS[args.preset].n_layers
    experts = args.experts or (PRESETS[args.preset].moe.num_experts if PRESETS[args.preset].moe else 8)
    if args.from_hf is not None:
        n_layers, experts = _check_from_hf(args)
    if experts % args.ep:
        raise UsageError(f"--experts {experts} must be divisible by --ep {args.ep}")
    _check_pipeline(args, n_layers, args.batch // dp)
    args.dp_shard = dp_shard
    _check_model(args, saved_model, int(os.environ.get("LOCAL_WORLD_SIZE", world)) if launched else world)
    if not launched:  # (the launcher checked for its ranks, which may have begun writing)
        _check_writable(out)


def _apply_layout(args) -> int | None:
    """``--layout``: the planner's string sets the layout options (and, outside torchrun, the
    number of processes), as if each had been given; returns its micro-batch size (None without
    --layout)."""
    if args.layout is None:
        return None
    from .train.config import LAYOUT_FIELDS
    from .train.preflight import layout_options

    given = sorted(k for k in args._explicit if k in LAYOUT_FIELDS and k != "nproc")
    if given:
        raise UsageError(f"--layout replaces --{given[0].replace('_', '-')}: give one or the other")
    launched = "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if launched else (args.nproc if "nproc" in args._explicit else None)
    try:
        opts, micro_batch = layout_options(args.layout, world)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if launched or "nproc" in args._explicit:
        opts.pop("nproc")  # the world is torchrun's or --nproc's; the layout must multiply to it
    for key, value in opts.items():
        setattr(args, key, value)
    args._explicit |= set(opts) | {"micro_batches"}
    return micro_batch


def _check_from_hf(args) -> tuple[int, int]:
    """--from-hf and --upcycle: a checkpoint folder, and no option that the checkpoint fixes;
    returns its layers and the experts of an MoE layer (1 without --upcycle)."""
    from .train.config import hf_config_dict

    path = Path(args.from_hf)
    if not (path / "config.json").is_file():
        raise UsageError(f"--from-hf {path}: not a transformers model folder (no config.json)")
    fixed = [k for k in ("dim", "n_layers", "experts") if getattr(args, k) is not None]
    if fixed or args.dense:
        what = "--dense (leave out --upcycle for a dense model)" if args.dense else f"--{fixed[0].replace('_', '-')}"
        raise UsageError(f"--from-hf takes the model's shape from the checkpoint: drop {what}")
    try:
        layers = int(hf_config_dict(args.from_hf)["num_hidden_layers"])
    except (KeyError, ValueError, TypeError) as err:
        raise UsageError(f"--from-hf {path}: config.json has no usable num_hidden_layers ({err})") from None
    return layers, args.upcycle or 1


# the float options: (option, allowed when None, test, what it needs); NaN fails every test
_NUMBERS = (
    ("lr", False, lambda v: v > 0, "> 0"),
    ("grad_clip", False, lambda v: v > 0, "> 0"),
    ("weight_decay", False, lambda v: v >= 0, ">= 0"),
    ("val_fraction", False, lambda v: 0 < v < 0.5, "in (0, 0.5)"),
    ("min_lr_ratio", False, lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("aux_loss_coef", True, lambda v: v >= 0, ">= 0"),
    ("z_loss_coef", True, lambda v: v >= 0, ">= 0"),
    ("bias_update_rate", True, lambda v: v >= 0, ">= 0"),
    ("capacity_factor", True, lambda v: v > 0, "> 0 (or left out: dropless)"),
)


def _check_numbers(args) -> None:
    for name, none_ok, ok, need in _NUMBERS:
        value = getattr(args, name)
        if value is None and none_ok:
            continue
        if value is None or not math.isfinite(value) or not ok(value):
            raise UsageError(f"--{name.replace('_', '-')} must be a finite number {need}, got {value}")


def _check_model(args, saved_model: dict | None, local_procs: int) -> None:
    """The model options as the model sees them, the layout against its shapes, the tokenizer,
    and (unless --force) whether the run fits in this machine's memory (moe.train.preflight)."""
    from .train.config import TrainConfig
    from .train.preflight import check_model, fit_check

    cfg = TrainConfig.from_dict(vars(args))
    try:
        model = check_model(cfg, saved_model)
        if not args.force:
            fit_check(cfg, model, local_procs)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _run_folder(check, *args) -> None:
    """``check(*args)``, a run-folder check of `moe.train.runlock`, as a usage error."""
    from .train.runlock import RunFolderError

    try:
        check(*args)
    except RunFolderError as err:
        raise UsageError(str(err)) from None


def _run_config(run: Path, flag: str) -> dict:
    """A run's config.json (or its copy in a checkpoint), checked to have a checkpoint to load."""
    from .train.manifest import CheckpointError, checkpoint_folders, read_run_config

    try:
        info = read_run_config(run)
    except CheckpointError as err:
        raise UsageError(f"{flag}: {err}") from None
    if not checkpoint_folders(run):
        raise UsageError(f"{flag}: {run} has no checkpoint yet (no checkpoints/step_*)")
    return info


def _check_writable(out: Path) -> None:
    """--out can be created and written (a read-only or full disk ends here, before any work)."""
    import tempfile

    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out) as f:
            f.write(b"0")
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise UsageError(f"--out {out}: cannot write there ({err.strerror})") from None


def _check_pipeline(args, n_layers: int, rows: int) -> None:
    """--pp and its options; ``rows``: the sequences of one data-parallel rank per step."""
    if args.pp == 1:
        if "micro_batches" in args._explicit and args.micro_batches not in (None, 1):
            raise UsageError(f"--micro-batches {args.micro_batches} splits pipeline steps: it needs --pp > 1")
        args.micro_batches = None  # a resumed pipeline run's value does not apply to one stage
        return
    if args.etp or args.dp_replicate > 1:
        what = "--etp" if args.etp else f"--dp-replicate {args.dp_replicate}"
        raise UsageError(f"--pp {args.pp} runs with --tp, --ep and --dp-shard, not with {what}; drop one of them")
    interleaved = args.pp_schedule.startswith("interleaved")
    stages = args.pp * (2 if interleaved else 1)
    if n_layers < stages:
        per = " x 2 stages per rank (interleaved)" if stages > args.pp else ""
        raise UsageError(f"--pp {args.pp}{per} needs at least {stages} layers, the model has {n_layers}")
    m = args.micro_batches or args.pp
    if rows % m:
        raise UsageError(
            f"--micro-batches {m} must divide the {rows} sequences of each data-parallel rank (--batch / dp)"
        )
    if interleaved and m % args.pp:
        raise UsageError(f"--pp-schedule {args.pp_schedule} needs --micro-batches ({m}) divisible by --pp {args.pp}")


SHUTDOWN_S = 600  # after SIGINT / SIGTERM, the ranks' time to finish the step and checkpoint


def _launch(args, argv) -> int:
    """Start ``--nproc`` local processes with torchrun's elastic agent (what ``torchrun
    --standalone`` does), each running this same command; exit 1 when a rank failed.

    SIGINT / SIGTERM (Ctrl-C reaches this process alone: the agent starts each rank in its own
    session) make the agent send the same signal to every rank; the ranks finish their step,
    write a checkpoint and exit, and this process exits with 128 + the signal's number, as it
    does when the signal reached one rank only (the ranks stop together). A rank still running
    after `SHUTDOWN_S` seconds is killed. This process holds the run folder's lock for the
    ranks; they die with it (`moe.train.ranks`)."""
    import uuid

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from .train.ranks import LAUNCHER_ENV, KillStoppedRanks, signal_stop, stop_message
    from .train.runlock import HELD_ENV

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=args.nproc, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.5,
        shutdown_timeout=SHUTDOWN_S,
    )  # fmt: skip
    os.environ.update({HELD_ENV: "1", LAUNCHER_ENV: str(os.getpid())})  # read by the ranks
    stopped_ranks = KillStoppedRanks()
    stopped_ranks.start()
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "moe", *argv, "--out", args.out)
    except ChildFailedError as err:
        exits = {rank: f.exitcode for rank, f in err.failures.items()}
        signum = signal_stop(exits)
        if signum is not None:  # a signal that reached some ranks: they stopped together, checkpointed
            if exits.get(0, 0) < 0:  # rank 0 ended by the agent's signal before it could say so
                latest = (Path(args.out) / "checkpoints" / "latest").read_text().strip()
                path = Path(args.out) / "checkpoints" / latest
                print(stop_message(signum, int(latest.rsplit("_", 1)[1]), path, args.out))
            return 128 + signum
        codes = sorted(set(exits.values()))
        print(f"moe train: {len(err.failures)} of {args.nproc} ranks failed (exit {codes})", file=sys.stderr)
        return codes[-1] if len(codes) == 1 and codes[0] > 0 else 1
    except SignalException as err:  # raised by the agent once the ranks have exited
        return 128 + int(err.sigval)
    finally:
        stopped_ranks.stop()
        for key in (HELD_ENV, LAUNCHER_ENV):  # this process is no rank (main may run again in it)
            os.environ.pop(key, None)
    return 0


def _train(args, p, argv) -> int:
    from .train import runlock
    from .train.ranks import die_with_launcher

    die_with_launcher()  # in a rank of the --nproc launcher (which has done the checks below)
    _check_train(args, p)
    try:
        return _train_locked(args, argv)
    finally:
        runlock.release()


def _train_locked(args, argv) -> int:
    from .train import runlock

    if "WORLD_SIZE" not in os.environ:  # one process or the --nproc launcher: hold the run folder
        _run_folder(runlock.acquire, Path(args.out), not args.resume)
    if args.resume and runlock.HELD_ENV not in os.environ:  # (the --nproc launcher has checked)
        from .train.fingerprint import check_resume_data

        try:
            check_resume_data(Path(args.out), args.data, args.data_changed_ok)
        except ValueError as err:
            raise UsageError(str(err)) from None
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return _launch(args, argv)
    from .train.config import TrainConfig
    from .train.loop import train

    cfg = TrainConfig.from_dict(vars(args))
    try:
        return train(cfg, Path(args.out), argv)
    except ValueError as err:  # data or model options found bad once read (they name their option)
        if str(err).startswith("--"):
            raise UsageError(str(err)) from None
        raise
    except runlock.RunFolderError as err:  # under torchrun, from rank 0 (moe.train.distributed.setup)
        raise UsageError(str(err)) from None


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
    from .train.manifest import checkpoint_folders

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
    from .train.generate import generate_from_run
    from .train.manifest import CheckpointError

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
    from .train.export import export_hf

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
    from .train.tokenize import tokenize_corpus

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
    from .plan.cli import main as plan_main

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
        roots = [Path.cwd(), Path(__file__).resolve().parents[1]]
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


def _explicit(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The options the command line gives (a resumed run keeps its own values for the rest)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    quiet = _Parser(add_help=False)
    cmd = sub.choices.get(argv[0]) if argv else None
    if cmd is None:
        return set()
    for action in cmd._actions:
        if action.option_strings and action.dest != "help":
            quiet._add_action(_copy_suppressed(action))
    given, _ = quiet.parse_known_args(argv[1:])
    return set(vars(given))


def _config_file(parser: argparse.ArgumentParser, argv: list[str]) -> dict:
    """``moe train --config FILE``: the file's values become the train parser's defaults (so
    flags override them) and count as given; returns them. Its sections are --help's groups
    (model, data, optimiser, run, layout), its keys the options with underscores."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    path = pre.parse_known_args(argv[1:])[0].config
    if path is None:
        return {}
    from .train.config_file import read_config

    train = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    try:
        values = read_config(path, train)
    except ValueError as err:
        raise UsageError(str(err)) from None
    train.set_defaults(**values)
    return values


def _copy_suppressed(action):
    import copy

    a = copy.copy(action)
    a.default = argparse.SUPPRESS
    a.required = False
    return a


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="moe", description="Mixture-of-Experts models: train, generate, export, data, plan, bench")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for make, run in ((_train_parser, _train), (_generate_parser, _generate), (_export_parser, _export),
                      (_data_parser, _data), (_plan_parser, None), (_bench_parser, _bench)):  # fmt: skip
        make(sub).set_defaults(_run=run)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:
        return _plan(argv[1:])
    parser = build_parser()
    try:
        from_file = _config_file(parser, argv) if argv[:1] == ["train"] else {}
        args = parser.parse_args(argv)
        args._explicit = _explicit(parser, argv) | set(from_file)
        return args._run(args, parser, argv)
    except UsageError as err:
        print(f"moe {argv[0] if argv else ''}: error: {err}".replace("  ", " "), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
