"""The training loop behind ``moe train``: it only composes the pieces (data, model, optimiser,
checkpoints, metrics), nanoGPT-small on purpose.

Loss of a step: ``lm_loss`` (mean next-token cross entropy over the global batch) plus
``aux_loss`` (the MoE layers' aux and z losses, already weighted by their coefficients).
fp32 on CPU; bf16 autocast on a GPU (the parameters and the optimiser stay fp32), pipeline
stages included: the residual stream between stages stays fp32 (fp32 embeddings plus bf16
matmul outputs), the logits of the last stage are bf16 and the loss takes them as fp32.

With pipeline stages (``--pp``) the schedule runs the forward and backward of the step in
micro-batches (`moe.parallel.LlamaPipeline.step`); ``self.model`` is then a `StageView` of this
rank's stages, which the optimiser, the checkpoints and the balance stats use as they use the
whole model in one process.
"""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from ..layer import MoE, aux_loss
from ..models.llama import Llama, document_ids
from ..parallel import checkpoint_and_compile, loss_context, router_loss
from .checkpoint import NonFiniteError, all_finite, load_checkpoint, load_newest, save_checkpoint
from .config import TrainConfig, load_hf_model, model_config, run_tokenizer
from .data import load_corpus, load_tokenizer
from .distributed import clip_grad_norm, parallelize, setup
from .fingerprint import data_changes
from .loggers import open_logger
from .manifest import DiskFullError, disk_full_message, read_run_config, warn
from .metrics import LoadCounter, MetricsLog, moe_layer_keys, plot_run
from .profiling import StepProfiler
from .ranks import LAUNCHER_ENV, collective_failure, stop_message

__all__ = ["Trainer", "lr_lambda", "train"]

# a step skipped for a non-finite loss still advances the schedule (the lr is a function of the
# step); torch warns when that happens before the first optimiser step
warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()` before", category=UserWarning)


def lr_lambda(cfg: TrainConfig):
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_lr_ratio`` at ``steps``."""

    def f(step: int) -> float:  # step: optimiser steps taken so far
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


class _Stop:
    """SIGINT / SIGTERM set a flag; the loop finishes its step, checkpoints and exits."""

    def __init__(self) -> None:
        self.signum: int | None = None
        # under the --nproc launcher a later signal is its agent's, sent once another rank has
        # ended: this rank still finishes the step, the checkpoint and its exit status
        self._keep = os.environ.get(LAUNCHER_ENV) is not None
        self._old = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signum = self.signum or signum
        if not self._keep:
            signal.signal(signum, self._old[signum])  # a second signal acts as usual

    def restore(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, signal.SIG_IGN if self._keep else handler)


class Trainer:
    def __init__(self, cfg: TrainConfig, run_dir: Path, argv: list[str] | None = None) -> None:
        self.cfg, self.run_dir, self.argv = cfg, run_dir, argv or []
        self.device, self.layout = setup(cfg)
        self.tokenizer = load_tokenizer(run_tokenizer(cfg))
        self.corpus = load_corpus(
            cfg.data, self.tokenizer, seq_len=cfg.seq_len, val_fraction=cfg.val_fraction, text_key=cfg.text_key
        )
        if cfg.doc_mask and self.corpus.eos_id is None:
            raise ValueError(
                f"--doc-mask: the documents of --data {cfg.data} are not separated: the tokenizer "
                f"{self.tokenizer.name} has no end-of-text token"
            )
        self.model_config = model_config(cfg, self.tokenizer.vocab_size)
        torch.manual_seed(cfg.seed)
        if cfg.from_hf is not None and not cfg.resume:  # a resumed run's weights come from its checkpoint
            self.model = load_hf_model(cfg, self.model_config, self.device)
        else:
            with torch.device(self.device):
                self.model = Llama(self.model_config)
        keys = moe_layer_keys(self.model)  # of the whole model, before a pipeline cuts it
        if self.layout is None:  # launched by torchrun: the same model on every rank, then sharded
            self.model, self.layout = parallelize(self.model, cfg, self.device)
        elif cfg.ac != "none" or cfg.compile:  # one process: what parallelize_llama does per block
            checkpoint_and_compile(self.model, activation_checkpoint=False if cfg.ac == "none" else cfg.ac,
                                   compile=cfg.compile)  # fmt: skip
        self.pipe = self.layout.pipe
        moe = self.model_config.moe
        self.loads = LoadCounter(self.model, keys, moe.num_experts if moe else 0, self.device,
                                 preferred=moe is not None and moe.router == "base")  # fmt: skip
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(0.9, 0.95),
            eps=1e-8,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.step = 0
        self.skipped = 0  # steps skipped for a non-finite loss or gradient norm, in all
        self.bad_in_a_row = 0  # ... the last of them consecutive
        self._saved: tuple[int, Path] | None = None  # (step, checkpoint) last written or loaded
        self._plot_failed = False

    # -- pieces ----------------------------------------------------------------------------------

    def _autocast(self):
        """--dtype: bf16 autocast (the parameters and optimiser stay fp32), by default on a GPU only."""
        bf16 = self.cfg.dtype == "bf16" or (self.cfg.dtype == "auto" and self.device.type == "cuda")
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16)

    def _documents(self, inputs_BS) -> dict:
        """The model's ``documents`` keyword under --doc-mask (each position's document, from
        the end-of-text tokens of the inputs), else nothing."""
        return {"documents": document_ids(inputs_BS, self.corpus.eos_id)} if self.cfg.doc_mask else {}

    def _cross_entropy(self, inputs_BS, targets_BS):
        """This rank's mean cross entropy over its rows of the global batch."""
        inputs_BS = inputs_BS.to(self.device)
        with self._autocast():
            logits = self.model(inputs_BS, **self._documents(inputs_BS))
        return F.cross_entropy(logits.float().flatten(0, 1), targets_BS.to(self.device).flatten())

    def _accumulate(self, inputs_BS, targets_BS, n: int):
        """The backward of this rank's rows in ``n`` equal slices, each loss weighted 1/n, so the
        gradients are those of the rows' mean loss (as one pass; the router sees a slice at a
        time, as pipeline micro-batches); returns the means of the cross entropy and router loss."""
        lm = aux = 0.0
        for x, y in zip(inputs_BS.chunk(n), targets_BS.chunk(n), strict=True):
            with loss_context(self.model):  # the trainer contract of moe.parallel (docs/training.md)
                ce = self._cross_entropy(x, y)
                ra = router_loss(self.model).float()
                ((ce + ra) / n).backward()
            lm, aux = lm + ce.detach() / n, aux + ra.detach() / n
        return lm, aux

    def _modules(self) -> list[torch.nn.Module]:
        return self.pipe.models if self.pipe is not None else [self.model]

    @torch.no_grad()
    def evaluate(self) -> float:
        for m in self._modules():
            m.eval()
        total, n = 0.0, 0
        cfg = self.cfg
        for inputs, targets in self.corpus.val_batches(
            cfg.eval_batches, cfg.batch, cfg.seq_len, self.layout.rows(cfg.batch)
        ):
            if self.pipe is not None:
                with self._autocast():
                    inputs = inputs.to(self.device)
                    total += float(self.pipe.evaluate(inputs, targets.to(self.device), **self._documents(inputs)))
            else:
                total += float(self.layout.mean_over_dp(self._cross_entropy(inputs, targets)))
            n += 1
        for m in self._modules():
            aux_loss(m)  # discard what the eval forwards left pending
            m.train()
        return total / n

    def train_step(self) -> dict:
        cfg = self.cfg
        # this rank's rows of the step's global batch (each data-parallel rank reads only its own)
        rows = self.layout.rows(cfg.batch)
        inputs, targets = self.corpus.batch(self.step, cfg.seed, cfg.batch, cfg.seq_len, rows)
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        self.loads.reset()
        if self.pipe is not None:  # forward and backward of every micro-batch, losses meaned over dp
            with self._autocast():  # the schedule runs every micro-batch's forward and backward
                self.pipe.step(inputs, targets, **self._documents(inputs))
            lm, aux = self.pipe.lm_loss, self.pipe.aux_loss
        else:  # --grad-accum N: N forward+backward passes over slices of this rank's rows, each 1/N
            lm, aux = self._accumulate(inputs, targets, cfg.grad_accum)
            lm, aux = self.layout.mean_over_dp(lm), self.layout.mean_over_dp(aux)
        if self.layout.mesh is None:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        else:  # gradients on several meshes (and stages): torch's clip would stack norms of different meshes
            grad_norm = clip_grad_norm(list(self.model.parameters()), cfg.grad_clip, self.layout.pp_group)
        loss = lm + aux
        lr = self.scheduler.get_last_lr()[0]
        bad = self._agree(not (math.isfinite(float(loss)) and math.isfinite(float(grad_norm))))
        if bad:  # no update from it: the step is skipped, its batch consumed
            self.skipped += 1
            self.bad_in_a_row += 1
        else:
            self.optimizer.step()
            self.bad_in_a_row = 0
        self.scheduler.step()
        self.step += 1
        if not bad and self._agree(not all_finite(self.model.parameters())):  # finite gradients, too large a step
            raise NonFiniteError(f"the weights are not finite after the update of step {self.step}")
        dt = time.perf_counter() - t0
        return {
            "step": self.step,
            "skipped_steps": self.skipped,
            **({"skipped": True} if bad else {}),
            "loss": float(loss.detach()),
            "lm_loss": float(lm.detach()),
            "aux_loss": float(aux.detach()),
            "tokens_per_s": cfg.batch * cfg.seq_len / dt,
            "lr": lr,
            "grad_norm": float(grad_norm),
            "moe": self.loads.stats(self.layout.sum_counts),
        }

    def save(self) -> Path:
        if self._saved is not None and self._saved[0] == self.step:  # nothing new since (a no-op --resume)
            return self._saved[1]
        extra = {"step": self.step, "scheduler": self.scheduler.state_dict(), "data_position": self.step,
                 "skipped": self.skipped, "bad_in_a_row": self.bad_in_a_row}  # fmt: skip
        path = save_checkpoint(self.run_dir, self.step, self.model, self.optimizer, extra, self.cfg.keep)
        self._saved = (self.step, path)
        return path

    def load(self, path: Path) -> None:
        extra = load_checkpoint(path, self.model, self.optimizer)
        self.scheduler.load_state_dict(extra["scheduler"])
        self.step = int(extra["step"])
        self.skipped, self.bad_in_a_row = int(extra.get("skipped", 0)), int(extra.get("bad_in_a_row", 0))
        self._saved = (self.step, path)

    def _agree(self, flag: bool) -> bool:
        """``flag`` of any rank, on every rank (the loss and grad norm are global already; this
        keeps the ranks on one branch even if a rank's float rounding differed)."""
        if self.layout.mesh is None:
            return flag
        import torch.distributed as dist

        t = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def _plot(self) -> None:
        """Redraw the plots; a plot that cannot be written (a full disk, a broken matplotlib)
        is said once and never stops the run."""
        try:
            plot_run(self.run_dir)
        except Exception as err:  # noqa: BLE001 - the plots are a view of metrics.jsonl, which is kept
            for tmp in self.run_dir.glob("*.png.tmp.png"):  # what a failed write left
                tmp.unlink(missing_ok=True)
            if not self._plot_failed:
                self._plot_failed = True
                warn(f"the plots in {self.run_dir} cannot be drawn ({type(err).__name__}: {err}); training goes on")

    def write_config(self) -> None:
        c = self.corpus
        saved = read_run_config(self.run_dir) if self.cfg.resume else {}  # (a damaged one: its checkpoint copy)
        info = {
            "train": self.cfg.to_dict(),
            "model": asdict(self.model_config),
            "tokenizer": getattr(self.tokenizer, "name", "bytes"),
            "data": {
                "source": c.source,
                "files": c.num_files,
                "train_tokens": len(c.train),
                "val_tokens": len(c.val),
                "fingerprint": c.fingerprint,
            },
            "data_changes": data_changes(saved, c, self.step, self.argv),  # resumes on other data
            "params": self.model_config.num_params(),
            "active_params": self.model_config.num_active_params(),
            # how the MoE layers reach their experts on rank 0 (local, flat or two-level expert-parallel)
            "moe_dispatch": sorted({type(m.dispatcher).__name__ for m in self.model.modules() if isinstance(m, MoE)}),
            # rank 0's part of an MoE layer's w1 (E, D, F): ep splits E, etp F, FSDP2 the first dim
            "expert_shard": next(
                (list(_local_shape(m.experts.w1)) for m in self.model.modules() if isinstance(m, MoE)), None
            ),  # fmt: skip
            "command": self.argv,
        }
        tmp = self.run_dir / ".config.json.tmp"  # a kill while writing leaves the previous config.json
        tmp.write_text(json.dumps(info, indent=2) + "\n")
        tmp.replace(self.run_dir / "config.json")

    # -- the run ---------------------------------------------------------------------------------

    def run(self) -> int:
        cfg, main = self.cfg, self.layout.is_main
        if main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        resumed_from = None
        if cfg.resume:  # the newest checkpoint that verifies, damaged ones passed over with a warning
            resumed_from = load_newest(self.run_dir, self.load, repoint=True, flag="--resume")
        if main:  # rank 0 alone writes the config, the metrics and the plots, and shows the bar
            self.write_config()
        log = None
        if main:
            resume_step = self.step if cfg.resume else None
            mirror = open_logger(cfg.log, self.run_dir, cfg.to_dict(), resume_step)
            log = MetricsLog(self.run_dir, resume_step=resume_step, mirror=mirror)
        self.layout.barrier()
        last = cfg.steps if cfg.stop_at is None else min(cfg.steps, cfg.stop_at)
        from tqdm.auto import tqdm

        # a terminal gets the redrawn bar; a log file (not a TTY) one plain line every --log-every steps
        tty = sys.stderr.isatty()
        bar = tqdm(total=cfg.steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                   file=sys.stderr, disable=not (main and tty))  # fmt: skip
        if resumed_from is not None and main:
            bar.write(f"resumed from {resumed_from} at step {self.step}")
        stop = _Stop()
        profiler = StepProfiler(cfg.profile, self.run_dir, self.layout.rank, self.device) if cfg.profile else None
        plot_every = cfg.plot_every or cfg.eval_every
        failure = None  # why the run diverged (it then ends with exit 1, nothing written from it)
        try:
            if self.step == 0:  # the starting point of the validation curve
                val = self.evaluate()
                if main:
                    log.write({"step": 0, "val_loss": val})
            while self.step < last:
                record = self.train_step()
                if profiler is not None:
                    profiler.step()
                if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                    record["val_loss"] = self.evaluate()
                if main:
                    log.write(record)
                    max_load = max((v["max_load"] for v in record["moe"].values()), default=float("nan"))
                    bar.set_postfix(
                        loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}", max_load=f"{max_load:.2f}"
                    )
                    bar.update(1)
                    if not tty and (self.step % cfg.log_every == 0 or self.step == last):
                        print(_log_line(record, cfg.steps, max_load), file=sys.stderr, flush=True)
                    if self.step % plot_every == 0:
                        self._plot()
                if self.bad_in_a_row >= cfg.max_bad_steps:
                    failure = self._diverged(record)
                    break
                if self._stopping(stop):
                    break
                if self.step % cfg.checkpoint_every == 0 and self.step < last:
                    self.save()
            if failure is None:
                path = self.save()
                if main:
                    self._plot()
        except NonFiniteError as err:
            failure = str(err)
        finally:
            if profiler is not None:
                profiler.close()
            bar.close()
            if log is not None:
                log.close()
            stop.restore()
        if failure is not None:
            if main:
                kept = str(self._saved[1]) if self._saved else "none"
                print(f"moe train: {failure}; newest checkpoint: {kept}", file=sys.stderr, flush=True)
            return 1
        if not main:
            return 128 + stop.signum if stop.signum is not None else 0
        resume_hint = f"moe train --out {self.run_dir} --resume"
        if stop.signum is not None:
            print(stop_message(stop.signum, self.step, path, self.run_dir))
            return 128 + stop.signum
        if self.step < cfg.steps:
            print(f"stopped at step {self.step} of {cfg.steps} (--stop-at), checkpoint {path}")
            print(f"resume with: {resume_hint}")
        else:
            print(f"done: {self.step} steps, run folder {self.run_dir}")
        return 0

    def _diverged(self, record: dict) -> str:
        """Why a run whose loss or gradients stay non-finite ends."""
        what = "loss" if not math.isfinite(record["loss"]) else "gradient norm"
        value = record["loss"] if what == "loss" else record["grad_norm"]
        return f"{what} is {value} at step {self.step} ({self.bad_in_a_row} steps in a row: --max-bad-steps)"

    def _stopping(self, stop: _Stop) -> bool:
        """A signal on any rank stops every rank after the same step (they must all checkpoint)."""
        if self.layout.mesh is None:
            return stop.signum is not None
        import torch.distributed as dist

        flag = torch.tensor([stop.signum or 0], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and stop.signum is None:
            stop.signum = int(flag.item())
        return bool(flag.item())


def _local_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.to_local().shape if hasattr(t, "to_local") else t.shape)


def _log_line(record: dict, steps: int, max_load: float) -> str:
    """One step as a plain line, for a log file."""
    val = f" val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
    return (
        f"step {record['step']}/{steps} loss {record['loss']:.4f}{val} lr {record['lr']:.3g} "
        f"grad_norm {record['grad_norm']:.3f} tokens/s {record['tokens_per_s']:.0f} max_load {max_load:.2f}"
    )


def train(cfg: TrainConfig, run_dir: Path, argv: list[str] | None = None) -> int:
    """Run ``cfg``; a full disk ends it with exit 1 and one line naming the device and the path,
    and so does a collective that timed out or whose peer ended."""
    import torch.distributed as dist

    try:
        return Trainer(cfg, run_dir, argv).run()
    except (DiskFullError, OSError) as err:
        if isinstance(err, OSError) and not isinstance(err, DiskFullError):
            if err.errno != errno.ENOSPC:
                raise
            err = disk_full_message(err.filename or run_dir)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"moe train: {err}", file=sys.stderr, flush=True)
        return 1
    except RuntimeError as err:  # a collective that timed out, or whose peer ended: one line, exit 1
        line = collective_failure(err, cfg.collective_timeout) if dist.is_initialized() else None
        if line is None:
            raise
        print(f"moe train: {line}", file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
