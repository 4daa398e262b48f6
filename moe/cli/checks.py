"""``moe train``'s checks of its arguments, made before anything heavy is imported or read
(and again on every rank under torchrun, before any joins the process group): the layout
against the world size and the model, the numbers, the model options as the model sees them,
the run folder, ``--layout``, ``--from-hf``, and whether the run fits in memory."""

from __future__ import annotations

import datetime
import importlib.util
import math
import os
from pathlib import Path

from .common import UsageError

__all__ = ["_check_train", "_check_writable", "_run_config", "_run_folder"]


def _check_train(args, p) -> None:
    """Everything that can be checked without reading data or building the model."""
    from ..models.llama import PRESETS
    from ..train import runlock
    from ..train.config import LAYOUT_FIELDS, RESUME_KEEPS

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
            if key in ("out", "resume", "stop_at", "data_changed_ok", "profile") or not hasattr(args, key):
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
    if args.log != "none" and importlib.util.find_spec(args.log) is None:
        raise UsageError(f"--log {args.log}: the {args.log} package is not installed (pip install 'moe[log]')")
    _check_numbers(args)
    launched = "WORLD_SIZE" in os.environ  # by torchrun (or by --nproc, which starts it)
    world = int(os.environ["WORLD_SIZE"]) if launched else args.nproc
    if launched and "nproc" in args._explicit and args.nproc != world:
        raise UsageError(f"--nproc {args.nproc} differs from torchrun's world size {world}: drop --nproc there")
    if (args.router_groups is not None or args.topk_groups is not None) and args.router != "topk":
        raise UsageError(
            f"--router-groups / --topk-groups limit top-k routing: they need --router topk, not {args.router}"
        )
    if args.base_round_bytes is not None and args.router != "base":
        raise UsageError(f"--base-round-bytes prices global BASE's rounds: it needs --router base, not {args.router}")
    if args.ep_chunks > 1 and args.ep == 1:
        raise UsageError(f"--ep-chunks {args.ep_chunks} chunks the expert-parallel exchange: it needs --ep > 1")
    if args.ranks_per_node is not None and args.ep % args.ranks_per_node:
        raise UsageError(f"--ranks-per-node {args.ranks_per_node} must divide --ep {args.ep} (the ep group's nodes)")
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
        from ..train.preflight import step_split

        try:
            args.micro_batches, accum = step_split(args.layout, micro_batch, args.batch // dp, args.pp)
        except ValueError as err:
            raise UsageError(str(err)) from None
        if "grad_accum" in args._explicit and args.grad_accum != accum:
            raise UsageError(
                f"--grad-accum {args.grad_accum}: --layout {args.layout!r} runs micro_batch={micro_batch} "
                f"sequences a pass, {accum} passes a step: drop --grad-accum"
            )
        args.grad_accum = accum
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
    if not launched and not args.dry_run:  # (the launcher checked for its ranks, which may have begun writing)
        _check_writable(out)


def _apply_layout(args) -> int | None:
    """``--layout``: the planner's string sets the layout options (and, outside torchrun, the
    number of processes), as if each had been given; returns its micro-batch size (None without
    --layout)."""
    if args.layout is None:
        return None
    from ..train.config import LAYOUT_FIELDS
    from ..train.preflight import layout_options

    given = sorted(k for k in args._explicit if k in (*LAYOUT_FIELDS, "ac") and k != "nproc")
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
    from ..train.config import hf_config_dict

    path = Path(args.from_hf)
    if not (path / "config.json").is_file():
        raise UsageError(f"--from-hf {path}: not a transformers model folder (no config.json)")
    fixed = [k for k in ("dim", "n_layers", "experts") if getattr(args, k) is not None]
    if fixed or args.dense:
        what = "--dense (leave out --upcycle for a dense model)" if args.dense else f"--{fixed[0].replace('_', '-')}"
        raise UsageError(f"--from-hf takes the model's shape from the checkpoint: drop {what}")
    try:
        hf = hf_config_dict(args.from_hf)
        layers = int(hf["num_hidden_layers"])
        experts = int(hf["num_local_experts"]) if hf.get("model_type") == "mixtral" else args.upcycle or 1
    except (KeyError, ValueError, TypeError) as err:
        raise UsageError(f"--from-hf {path}: config.json has no usable {err} ({type(err).__name__})") from None
    if hf.get("model_type") == "mixtral":
        given = [k for k in ("upcycle", "router", "top_k", "moe_every") if k in args._explicit]
        if given:
            raise UsageError(f"--from-hf {path} is a Mixtral: its experts and routing are the checkpoint's, drop "
                             f"--{given[0].replace('_', '-')}")  # fmt: skip
    return layers, experts


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
    ("base_round_bytes", True, lambda v: v >= 0, ">= 0"),
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
    from ..train.config import TrainConfig
    from ..train.preflight import check_model, fit_check

    cfg = TrainConfig.from_dict(vars(args))
    try:
        model = check_model(cfg, saved_model)
        if not args.force and not args.dry_run:  # (a dry run prints the estimate instead)
            fit_check(cfg, model, local_procs)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _run_folder(check, *args) -> None:
    """``check(*args)``, a run-folder check of `moe.train.runlock`, as a usage error."""
    from ..train.runlock import RunFolderError

    try:
        check(*args)
    except RunFolderError as err:
        raise UsageError(str(err)) from None


def _run_config(run: Path, flag: str) -> dict:
    """A run's config.json (or its copy in a checkpoint), checked to have a checkpoint to load."""
    from ..train.manifest import CheckpointError, checkpoint_folders, read_run_config

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
    from ..train.config import default_microbatches, stages_per_rank

    if args.pp > 1 and args.grad_accum > 1:
        raise UsageError(f"--grad-accum {args.grad_accum}: pipeline stages split a step with --micro-batches")
    if rows % args.grad_accum:
        raise UsageError(f"--grad-accum {args.grad_accum} must divide the {rows} sequences of each data-parallel rank")
    if args.pp == 1:
        if "micro_batches" in args._explicit and args.micro_batches not in (None, 1):
            raise UsageError(
                f"--micro-batches {args.micro_batches} splits pipeline steps: it needs --pp > 1 "
                "(without stages: --grad-accum)"
            )
        args.micro_batches = None  # a resumed pipeline run's value does not apply to one stage
        return
    if args.dp_replicate > 1:
        raise UsageError(f"--pp {args.pp} runs with --tp, --ep, --etp and --dp-shard, not with --dp-replicate "
                         f"{args.dp_replicate}; drop one of them")  # fmt: skip
    interleaved = args.pp_schedule.startswith("interleaved")
    stages = args.pp * stages_per_rank(args.pp_schedule)
    if n_layers < stages:
        per = f" x 2 stages per rank ({args.pp_schedule})" if stages > args.pp else ""
        raise UsageError(f"--pp {args.pp}{per} needs at least {stages} layers, the model has {n_layers}")
    m = args.micro_batches or default_microbatches(args.pp, args.pp_schedule)
    if rows % m:
        raise UsageError(
            f"--micro-batches {m} must divide the {rows} sequences of each data-parallel rank (--batch / dp)"
        )
    if interleaved and m % args.pp:
        raise UsageError(f"--pp-schedule {args.pp_schedule} needs --micro-batches ({m}) divisible by --pp {args.pp}")
    if args.pp_schedule == "dualpipev" and m < 2 * args.pp:
        raise UsageError(f"--pp-schedule dualpipev needs --micro-batches ({m}) >= 2 x --pp = {2 * args.pp}")
