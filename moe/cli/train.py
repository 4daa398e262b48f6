"""``moe train``: its options (`train_parser`), the ``--nproc`` launcher (torchrun's
elastic agent) and the run under the run folder's lock."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .checks import _check_train, _run_folder
from .common import UsageError, _fmt, _positive

__all__ = ["PP_SCHEDULES", "ROUTERS", "SHUTDOWN_S"]


ROUTERS = ("base", "topk", "sinkhorn", "expert_choice")


# interleaved: 1F1B with 2 stages per rank (also by the name moe plan and pipeline_llama give it)
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "interleaved_1f1b", "dualpipev")


def _train_parser(sub) -> argparse.ArgumentParser:
    from ..train.config import TrainConfig
    from ..train.loggers import LOGGERS

    d = TrainConfig()
    p = sub.add_parser("train", help="train a Llama-2-MoE model", formatter_class=_fmt)
    p.add_argument("--config", default=None, help="a TOML file of these options by section (flags override it)")
    m = p.add_argument_group("model")
    m.add_argument("--preset", default=d.preset, help="model preset (python -m moe.models.llama lists them)")
    m.add_argument("--experts", type=_positive("--experts"), default=None, help="experts per MoE layer (preset's)")
    m.add_argument("--top-k", type=_positive("--top-k"), default=None, help="experts per token (1 for base)")
    m.add_argument("--router", choices=ROUTERS, default=d.router, help="router of the MoE layers")
    m.add_argument("--base-balance", choices=("group", "rank"), default=d.base_balance,
                   help="BASE under --ep: balance the ep group's tokens together (group) or each rank's")  # fmt: skip
    m.add_argument("--moe-every", type=_positive("--moe-every"), default=None, help="every N-th MLP is MoE")
    m.add_argument("--dense", action="store_true", help="no MoE layer: a dense Llama")
    m.add_argument("--dim", type=_positive("--dim"), default=None, help="model width (preset's)")
    m.add_argument("--n-layers", type=_positive("--n-layers"), default=None, help="layers (preset's)")
    m.add_argument("--aux-loss-coef", type=float, default=None, help="load-balancing loss weight (preset's)")
    m.add_argument("--z-loss-coef", type=float, default=None, help="router z-loss weight (preset's)")
    m.add_argument("--bias-update-rate", type=float, default=None, help="top-k aux-loss-free bias step (0: off)")
    m.add_argument("--base-round-bytes", type=float, default=None,
                   help="BASE balanced over the ep group: a round of its collectives priced in the bytes "
                   "the link moves in its latency (`moe plan` states it), to trade bytes for rounds "
                   "(0: bytes alone)")  # fmt: skip
    m.add_argument("--router-groups", type=_positive("--router-groups"), default=None,
                   help="group-limited top-k: the experts in G contiguous groups (preset's); G = --ep / "
                   "--ranks-per-node puts one group on each node of the ep group")  # fmt: skip
    m.add_argument("--topk-groups", type=_positive("--topk-groups"), default=None,
                   help="with --router-groups: each token uses experts of its M best groups; with groups on "
                   "nodes and --dispatch hierarchical a token crosses to at most M nodes (preset's)")  # fmt: skip
    m.add_argument("--capacity-factor", type=float, default=None, help="expert capacity factor (None: dropless)")
    m.add_argument("--from-hf", default=None, help="start from a local transformers Llama or Mixtral folder (its "
                   "shape, weights and tokenizer.json; --preset is not used)")  # fmt: skip
    m.add_argument("--upcycle", type=_positive("--upcycle"), default=None,
                   help="with --from-hf: its MLPs become this many experts (the layers --moe-every picks)")  # fmt: skip
    g = p.add_argument_group("data")
    g.add_argument("--data", default=None, help="text, .jsonl, .parquet, datasets files or folders, or a "
                   "shard folder (moe data tokenize); default: the Python stdlib's source")  # fmt: skip
    g.add_argument("--data-changed-ok", action="store_true",
                   help="--resume on data that differ from the run's (recorded in config.json)")  # fmt: skip
    g.add_argument("--tokenizer", default=None, help="a local tokenizer.json (default: bytes + 4 specials)")
    g.add_argument("--text-key", default=d.text_key, help="the text field of .jsonl / .parquet / datasets rows")
    g.add_argument("--doc-mask", action="store_true", help="attend only within each document (documents are "
                   "packed with the end-of-text token between them; off: causal over the whole sequence)")  # fmt: skip
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
    r.add_argument("--log-every", type=_positive("--log-every"), default=d.log_every,
                   help="steps between plain progress lines when stderr is not a terminal (a log file)")  # fmt: skip
    r.add_argument("--log", choices=LOGGERS, default=d.log,
                   help="also log the metrics to TensorBoard (<out>/tensorboard) or W&B (offline)")  # fmt: skip
    r.add_argument("--profile", type=_positive("--profile"), default=None, metavar="STEPS",
                   help="a torch.profiler trace of STEPS steps after one warm-up step, in <out>/profile")  # fmt: skip
    r.add_argument("--dry-run", action="store_true",
                   help="build the model on meta, print its size, layout and memory estimate, and exit")  # fmt: skip
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
    lay.add_argument("--ac", choices=("none", "full", "selective"), default=d.ac,
                     help="activation checkpointing of every block (selective keeps the matmul outputs)")  # fmt: skip
    lay.add_argument("--compile", action="store_true",
                     help="torch.compile each block (an expert-parallel MoE layer stays eager)")  # fmt: skip
    lay.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default=d.dtype,
                     help="auto: bf16 autocast on a GPU, fp32 on CPU (parameters and optimiser fp32)")  # fmt: skip
    lay.add_argument("--dispatch", choices=("flat", "hierarchical", "auto"), default=d.dispatch,
                     help="expert-parallel dispatch (hierarchical: a token crosses once per node; auto: when ep "
                     "spans nodes)")  # fmt: skip
    lay.add_argument("--ranks-per-node", type=_positive("--ranks-per-node"), default=None,
                     help="ranks per node of the ep group, for --dispatch (default: by LOCAL_WORLD_SIZE)")  # fmt: skip
    lay.add_argument("--reshard", type=int, choices=(0, 1), default=d.reshard,
                     help="0: FSDP2 keeps each block gathered from forward to backward (plan's reshard=0)")  # fmt: skip
    lay.add_argument("--ep-chunks", type=_positive("--ep-chunks"), default=d.ep_chunks,
                     help="with --ep: the expert exchange in this many chunks, each in flight while another's "
                     "experts compute")  # fmt: skip
    lay.add_argument("--grad-accum", type=_positive("--grad-accum"), default=d.grad_accum,
                     help="without --pp: backward passes per step, over slices of each rank's rows")  # fmt: skip
    lay.add_argument("--layout", default=None,
                     help="moe plan's layout string (tp=2,pp=2,ep=2,...) instead of the flags above")  # fmt: skip
    return p


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

    from ..train.ranks import LAUNCHER_ENV, KillStoppedRanks, signal_stop, stop_message
    from ..train.runlock import HELD_ENV

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
    from ..train import runlock
    from ..train.ranks import die_with_launcher

    die_with_launcher()  # in a rank of the --nproc launcher (which has done the checks below)
    _check_train(args, p)
    if args.dry_run:
        from ..train.config import TrainConfig
        from ..train.preflight import describe

        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", args.nproc)))
        print(describe(TrainConfig.from_dict(vars(args)), local))
        return 0
    try:
        return _train_locked(args, argv)
    finally:
        runlock.release()


def _train_locked(args, argv) -> int:
    from ..train import runlock

    if "WORLD_SIZE" not in os.environ:  # one process or the --nproc launcher: hold the run folder
        _run_folder(runlock.acquire, Path(args.out), not args.resume)
    if args.resume and runlock.HELD_ENV not in os.environ:  # (the --nproc launcher has checked)
        from ..train.fingerprint import check_resume_data

        try:
            check_resume_data(Path(args.out), args.data, args.data_changed_ok)
        except ValueError as err:
            raise UsageError(str(err)) from None
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return _launch(args, argv)
    from ..train.config import TrainConfig
    from ..train.loop import train

    cfg = TrainConfig.from_dict(vars(args))
    try:
        return train(cfg, Path(args.out), argv)
    except ValueError as err:  # data or model options found bad once read (they name their option)
        if str(err).startswith("--"):
            raise UsageError(str(err)) from None
        raise
    except runlock.RunFolderError as err:  # under torchrun, from rank 0 (moe.train.distributed.setup)
        raise UsageError(str(err)) from None
