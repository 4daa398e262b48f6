"""What ``moe train`` checks before it reads data or builds a model: the model options as the
model will see them, the layout against the model's shapes, the tokenizer, and whether the
run fits in this machine's memory (`fit_check`).

Each check raises ValueError whose message starts with the option it is about (``--top-k:
...``); the command prints it as its one line and exits 2, on every rank (every rank runs the
same checks on the same arguments before any of them joins the process group).
"""

from __future__ import annotations

import os
import re

from ..models.llama import LlamaConfig
from .config import TrainConfig, default_microbatches, model_config, run_tokenizer, stages_per_rank
from .data import load_tokenizer

__all__ = [
    "available_memory",
    "check_model",
    "describe",
    "fit_check",
    "layout_options",
    "step_bytes",
    "step_split",
]

# the fields of LlamaConfig / MoEConfig a message may name -> the option that sets them
_FLAGS = {
    "top_k": "--top-k", "num_experts": "--experts", "dim": "--dim", "n_layers": "--n-layers",
    "moe_every": "--moe-every", "aux_loss_coef": "--aux-loss-coef", "z_loss_coef": "--z-loss-coef",
    "capacity_factor": "--capacity-factor", "bias_update_rate": "--bias-update-rate", "router": "--router",
    "n_groups": "--router-groups", "topk_groups": "--topk-groups", "base_round_bytes": "--base-round-bytes",
}  # fmt: skip


def _flag_of(message: str) -> str:
    """The option a config's ValueError is about: the first field name it mentions that an option sets."""
    for word in re.findall(r"[a-z_]+", message):
        if word in _FLAGS:
            return _FLAGS[word]
    return "model options"


# what the trainer runs of a planner's layout, and what it does not (yet): key -> the reason
_UNSUPPORTED = {"loss_parallel": "moe train computes the loss on gathered logits"}


def layout_options(text: str, world: int | None) -> tuple[dict, int]:
    """``moe plan``'s layout string (``tp=8,pp=16,ep=8,...``, as it prints it) -> the trainer's
    layout options, and the planner's micro-batch size in sequences (the trainer counts
    micro-batches and gradient accumulation: `step_split`). ``world``: the processes, when
    known (dp_shard is what they leave, as in the planner); else the layout's own product is
    the world."""
    from ..plan.layout import parse_layout

    try:
        lay = parse_layout(text, gpus=world)
    except ValueError as err:
        raise ValueError(f"--layout {text!r}: {err}") from None
    for key, why in _UNSUPPORTED.items():
        if getattr(lay, key):
            raise ValueError(f"--layout {text!r}: {key}=1 is not run by the trainer ({why}); drop it")
    if lay.precision == "fp8":
        raise ValueError(f"--layout {text!r}: precision=fp8 is not run by the trainer (bf16 on a GPU, fp32 on CPU)")
    if lay.vpp > 2:
        raise ValueError(f"--layout {text!r}: vpp={lay.vpp}: the trainer's interleaved schedule runs 2 stages per rank")
    schedule = {"interleaved_1f1b": "interleaved"}.get(lay.schedule, lay.schedule)
    opts = dict(tp=lay.tp, pp=lay.pp, ep=lay.ep, etp=lay.etp, dp_shard=lay.dp_shard, dp_replicate=lay.dp_replicate,
                pp_schedule=schedule, nproc=lay.world, reshard=int(lay.reshard))  # fmt: skip
    if lay.recompute:  # the planner's recompute: every block re-run in backward
        opts["ac"] = "full"
    if lay.dispatch != "flat":
        opts["dispatch"] = lay.dispatch
    if lay.chunks > 1:
        opts["ep_chunks"] = lay.chunks
    return opts, lay.micro_batch


def step_split(text: str, micro_batch: int, rows: int, pp: int) -> tuple[int | None, int]:
    """The trainer's (micro-batch count, gradient accumulation) for the planner's micro-batch
    size (``rows``: the sequences of one data-parallel rank per step): pipeline stages take
    ``rows / micro_batch`` micro-batches; one stage runs that many backward passes
    (``--grad-accum``), so each forward holds the micro-batch the planner counted."""
    if rows % micro_batch:
        raise ValueError(
            f"--layout {text!r}: micro_batch={micro_batch} must divide the {rows} sequences of each data-parallel rank"
        )
    return (None, rows // micro_batch) if pp == 1 else (rows // micro_batch, 1)


def check_model(cfg: TrainConfig, saved_model: dict | None = None) -> LlamaConfig:
    """The run's `LlamaConfig`, built as the trainer will build it, and the layout checked
    against it. ``saved_model``: the model of the run being resumed (its vocabulary must be the
    tokenizer's)."""
    try:
        tokenizer = load_tokenizer(run_tokenizer(cfg))
    except ImportError as err:
        raise ValueError(f"--tokenizer: {err}") from None
    except Exception as err:  # the tokenizers package says why in its own words, over several lines
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"--tokenizer {cfg.tokenizer}: not a readable tokenizer.json ({first})") from None
    vocab = tokenizer.vocab_size
    if saved_model is not None and saved_model.get("vocab_size") not in (None, vocab):
        raise ValueError(
            f"--tokenizer {cfg.tokenizer or 'bytes'} has {vocab} tokens, the run's model was built for "
            f"{saved_model['vocab_size']}: resume with the tokenizer the run was started with"
        )
    try:
        mc = model_config(cfg, vocab)
    except ValueError as err:
        if str(err).startswith("--"):  # already names its option
            raise
        raise ValueError(f"{_flag_of(str(err))}: {err}") from None
    _check_layout(cfg, mc)
    return mc


def _check_layout(cfg: TrainConfig, mc: LlamaConfig) -> None:
    tp = cfg.tp
    if tp > 1:
        if mc.n_heads % tp or mc.n_kv_heads % tp:
            raise ValueError(
                f"--tp {tp} must divide the attention heads (n_heads={mc.n_heads}, n_kv_heads={mc.n_kv_heads} "
                f"for --preset {cfg.preset}): the heads are sharded over the tp ranks"
            )
        if cfg.seq_len % tp:
            raise ValueError(f"--seq-len {cfg.seq_len} must be divisible by --tp {tp} (sequence parallelism)")
        if mc.ffn_hidden_dim % tp:
            raise ValueError(f"--tp {tp} must divide the MLP width {mc.ffn_hidden_dim} of --preset {cfg.preset}")
        if cfg.etp and mc.moe is not None and mc.moe.hidden_dim % tp:
            raise ValueError(f"--etp: --tp {tp} must divide the experts' hidden dim {mc.moe.hidden_dim}")


def train_layout(cfg: TrainConfig, on_gpu: bool):
    """The planner's `Layout` of a `moe train` configuration (bf16 on a GPU, fp32 on CPU)."""
    from ..plan.layout import Layout

    interleaved = cfg.pp_schedule.startswith("interleaved")
    dp = cfg.dp_shard * cfg.dp_replicate
    micro = cfg.micro_batches or (default_microbatches(cfg.pp, cfg.pp_schedule) if cfg.pp > 1 else 1)
    spans = cfg.ranks_per_node is not None and cfg.ep > cfg.ranks_per_node  # "auto": two-level across nodes
    two_level = cfg.ep > 1 and (cfg.dispatch == "hierarchical" or (cfg.dispatch == "auto" and spans))
    return Layout(
        tp=cfg.tp, pp=cfg.pp, vpp=stages_per_rank(cfg.pp_schedule) if cfg.pp > 1 else 1,
        schedule="interleaved_1f1b" if cfg.pp > 1 and interleaved else ("1f1b" if cfg.pp == 1 else cfg.pp_schedule),
        ep=cfg.ep, etp=cfg.etp, dp_shard=cfg.dp_shard, dp_replicate=cfg.dp_replicate, reshard=bool(cfg.reshard),
        precision="bf16" if on_gpu else "fp32", micro_batch=max(1, cfg.batch // dp // micro),
        dispatch="hierarchical" if two_level else "flat", chunks=cfg.ep_chunks if cfg.ep > 1 else 1,
    )  # fmt: skip


def step_bytes(cfg: TrainConfig, mc: LlamaConfig, on_gpu: bool) -> tuple[int, int]:
    """(bytes one process needs at its peak, the planner's training-step peak of the same
    rank). The trainer builds the whole model in fp32 on every rank before sharding it, so the
    peak is at least the whole model's parameters; after that the planner's memory model
    (`moe.plan.memory`, docs/scale.md) gives the step's: parameters, gradients, AdamW state,
    activations and buffers of the most loaded rank."""
    from ..plan.memory import TrainShape, peak_memory

    lay = train_layout(cfg, on_gpu)
    shape = TrainShape(seq_len=cfg.seq_len, global_batch_tokens=cfg.batch * cfg.seq_len)
    _, mem = peak_memory(mc, lay, shape)
    return max(mem["total"], 4 * mc.num_params()), mem["total"]


def available_memory() -> tuple[int, str, bool]:
    """(bytes, what they are, whether a GPU): a CUDA device's total memory, or the host's
    available memory (``MemAvailable``), which the local processes share."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, "GPU memory per device", True
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available host memory", False
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), "available host memory", False


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def estimate(cfg: TrainConfig, mc: LlamaConfig, local_procs: int) -> dict:
    """The memory one process needs (`step_bytes`) against the memory there is: on a GPU each
    process has its own device, on CPU the local processes share the host's."""
    have, what, on_gpu = available_memory()
    need, step = step_bytes(cfg, mc, on_gpu)
    procs = 1 if on_gpu else local_procs
    return dict(need=need, step=step, have=have, what=what, procs=procs, fits=need * procs <= have)


def fit_check(cfg: TrainConfig, mc: LlamaConfig, local_procs: int) -> None:
    """Refuse a run that cannot fit before anything is allocated (``--force`` skips this)."""
    e = estimate(cfg, mc, local_procs)
    if not e["fits"]:
        procs = "" if e["procs"] == 1 else f" x {e['procs']} local processes"
        raise ValueError(
            f"--preset {cfg.preset}: needs about {_gb(e['need'])} per process{procs} (the whole model in fp32 while "
            f"it is built, {_gb(4 * mc.num_params())}; the training step's peak {_gb(e['step'])}), more than the "
            f"{_gb(e['have'])} of {e['what']}: choose a smaller model or a layout over more processes, or pass --force"
        )


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def describe(cfg: TrainConfig, local_procs: int) -> str:
    """``moe train --dry-run``: the model built on the meta device (no memory), its parameter
    counts, the layout and the memory estimate `fit_check` compares."""
    import torch

    from ..models.llama import Llama

    mc = check_model(cfg)
    with torch.device("meta"):
        model = Llama(mc)
    total = sum(p.numel() for p in model.parameters())
    e = estimate(cfg, mc, local_procs)
    moe = mc.moe
    experts = f", MoE in {len(mc.moe_layers)} of {mc.n_layers} layers ({moe.num_experts} experts, top-{moe.top_k}, " \
        f"{moe.router})" if moe is not None else ", dense"  # fmt: skip
    world = cfg.tp * cfg.pp * cfg.dp_shard * cfg.dp_replicate
    micro = cfg.micro_batches or default_microbatches(cfg.pp, cfg.pp_schedule)
    return "\n".join([
        f"model: {cfg.from_hf or cfg.preset}: {_count(total)} parameters, {_count(mc.num_active_params())} active "
        f"per token, {mc.n_layers} layers, dim {mc.dim}{experts}",
        f"layout: {world} processes: tp={cfg.tp} pp={cfg.pp} ep={cfg.ep} etp={int(cfg.etp)} dp_shard={cfg.dp_shard} "
        f"dp_replicate={cfg.dp_replicate}" + (f" schedule={cfg.pp_schedule} micro_batches={micro}"
                                              if cfg.pp > 1 else ""),
        f"memory per process: about {_gb(e['need'])} (the whole model in fp32 while built {_gb(4 * total)}; the "
        f"training step's peak {_gb(e['step'])}); {_gb(e['have'])} of {e['what']}"
        + ("" if e["procs"] == 1 else f" for {e['procs']} local processes")
        + (": fits" if e["fits"] else ": does not fit (moe train refuses it without --force)"),
    ])  # fmt: skip
