"""`TrainConfig`: everything a run is, as data (written to ``config.json``), and how it builds
the model's `LlamaConfig`.

A resumed run keeps the fields that define what is trained (`RESUME_KEEPS`: model, data,
optimiser, seed, steps) from its ``config.json``; the layout (`LAYOUT_FIELDS`) and the
run-control fields (checkpointing, ``--stop-at``, evaluation cadence) may change from one job to
the next, and keep their saved values unless given again.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from ..config import MoEConfig
from ..models.llama import PRESETS, LlamaConfig

__all__ = [
    "LAYOUT_FIELDS", "RESUME_KEEPS", "TrainConfig", "default_microbatches", "load_hf_model", "model_config",
    "model_config_from_dict", "run_tokenizer", "stages_per_rank", "upcycle_template",
]  # fmt: skip


def stages_per_rank(pp_schedule: str) -> int:
    """Pipeline stages on each pipeline rank: 2 for the interleaved schedule and DualPipeV's V."""
    return 2 if pp_schedule.startswith("interleaved") or pp_schedule == "dualpipev" else 1


def default_microbatches(pp: int, pp_schedule: str) -> int:
    """Micro-batches per step when --micro-batches is not given: pp, or 2 pp for DualPipeV
    (which needs one per stage at least)."""
    return 2 * pp if pp_schedule == "dualpipev" else pp


@dataclass(kw_only=True)
class TrainConfig:
    # model: a preset and overrides (None keeps the preset's value)
    preset: str = "small"
    experts: int | None = None
    top_k: int | None = None  # None: 1 for BASE, else the preset's
    router: str = "base"
    base_balance: str = "group"  # BASE under ep: over the ep group's tokens (group) or each rank's (rank)
    moe_every: int | None = None
    dense: bool = False  # no MoE layer at all (a dense Llama, e.g. to export as LlamaForCausalLM)
    dim: int | None = None
    n_layers: int | None = None
    aux_loss_coef: float | None = None
    z_loss_coef: float | None = None
    bias_update_rate: float | None = None  # top-k's aux-loss-free balancing bias step
    base_round_bytes: float | None = None  # global BASE: a round of its collectives in bytes (`moe plan` states it)
    router_groups: int | None = None  # group-limited top-k: the experts in this many contiguous groups
    topk_groups: int | None = None  # ... each token using its best this many (a node limit when groups = nodes)
    capacity_factor: float | None = None
    from_hf: str | None = None  # a local transformers Llama or Mixtral folder: its shape and weights
    upcycle: int | None = None  # experts each of its MLPs becomes (the layers --moe-every picks); None: dense
    # data
    data: str | None = None  # None: the Python standard library's source, byte-level
    tokenizer: str | None = None
    text_key: str = "text"  # the text field of .jsonl / .parquet / datasets inputs
    doc_mask: bool = False  # attention only within each document (the end-of-text token separates them)
    batch: int = 8  # global batch, in sequences, the same for every layout
    seq_len: int = 128
    val_fraction: float = 0.01
    eval_every: int = 20
    eval_batches: int = 4
    # optimiser
    steps: int = 120
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    # run control
    out: str | None = None
    checkpoint_every: int = 100
    keep: int | None = 2
    stop_at: int | None = None
    max_bad_steps: int = 3  # consecutive steps with a non-finite loss or gradient norm that end the run
    resume: bool = False
    plot_every: int | None = None  # None: at every evaluation
    log_every: int = 10  # a plain progress line every N steps when stderr is not a terminal
    collective_timeout: int = 600  # seconds in one collective before the job ends (init_process_group)
    log: str = "none"  # also log the metrics to: none, tensorboard, wandb (moe.train.loggers)
    profile: int | None = None  # a torch.profiler trace of this many steps (after one warm-up step)
    data_changed_ok: bool = False  # this --resume may read data that differ from the run's
    # layout (world size = product; see moe.parallel.parallelize_llama / pipeline_llama)
    nproc: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: bool = False
    dp_shard: int = -1  # -1: whatever the world size leaves
    dp_replicate: int = 1
    pp_schedule: str = "1f1b"
    micro_batches: int | None = None  # None: pp (pipeline; 2 pp under dualpipev) or 1
    ac: str = "none"  # activation checkpointing of every block: none, full, selective (keeps matmul outputs)
    compile: bool = False  # torch.compile each block (inductor; an expert-parallel MoE layer stays eager)
    dtype: str = "auto"  # auto: bf16 autocast on a GPU, fp32 on CPU; bf16 / fp32 force it
    dispatch: str = "flat"  # expert-parallel dispatch: flat, hierarchical (two-level over nodes) or auto
    ranks_per_node: int | None = None  # the ep group's ranks per node (None: from LOCAL_WORLD_SIZE)
    reshard: int = 1  # FSDP2 reshard_after_forward; 0 (plan's reshard=0) keeps each block gathered until backward
    ep_chunks: int = 1  # the expert-parallel exchange in this many chunks, overlapping the experts' compute
    grad_accum: int = 1  # without pipeline stages: backward passes per step over slices of each rank's rows

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


# the layout: given on a resumed run's command line (any of them), it replaces the saved layout
# as a whole (the fields not given take their defaults), so `--resume --nproc 1` is one process
LAYOUT_FIELDS = (
    "nproc", "tp", "pp", "ep", "etp", "dp_shard", "dp_replicate", "pp_schedule", "micro_batches", "dispatch",
    "ranks_per_node", "reshard", "ep_chunks",
)  # fmt: skip

RESUME_KEEPS = (
    "preset experts top_k router base_balance moe_every dense dim n_layers aux_loss_coef z_loss_coef bias_update_rate "
    "router_groups topk_groups "
    "capacity_factor from_hf upcycle data tokenizer text_key doc_mask batch seq_len val_fraction steps lr min_lr_ratio "
    "warmup weight_decay grad_clip seed"
).split()


def model_config(cfg: TrainConfig, vocab_size: int) -> LlamaConfig:
    """The `LlamaConfig` of a run: the preset with the run's overrides and the tokenizer's
    vocabulary, or with ``from_hf`` the checkpoint's shape (upcycled when ``upcycle`` is set)."""
    if cfg.from_hf is not None:
        return _hf_model_config(cfg, vocab_size)
    if cfg.preset not in PRESETS:
        raise ValueError(f"--preset: unknown preset {cfg.preset!r}; known: {', '.join(sorted(PRESETS))}")
    base = PRESETS[cfg.preset]
    over: dict = {"vocab_size": vocab_size, "max_seq_len": max(base.max_seq_len, cfg.seq_len)}
    for name in ("dim", "n_layers", "moe_every"):
        if getattr(cfg, name) is not None:
            over[name] = getattr(cfg, name)
    dim = over.get("dim", base.dim)
    if cfg.dense:
        over["moe"] = None
        return LlamaConfig.from_name(cfg.preset, **over)
    template = base.moe or MoEConfig(dim=dim, hidden_dim=base.ffn_hidden_dim, num_experts=8, aux_loss_coef=0.01)
    top_k = cfg.top_k if cfg.top_k is not None else (1 if cfg.router == "base" else template.top_k)
    router_options = {**template.router_options, **_router_options(cfg)}
    moe = replace(
        template,
        dim=dim,
        num_experts=cfg.experts if cfg.experts is not None else template.num_experts,
        top_k=top_k,
        router=cfg.router,
        combine="sigmoid_residual" if cfg.router == "base" and top_k == 1 else "weighted",
        router_options=router_options,
        aux_loss_coef=cfg.aux_loss_coef if cfg.aux_loss_coef is not None else template.aux_loss_coef,
        z_loss_coef=cfg.z_loss_coef if cfg.z_loss_coef is not None else template.z_loss_coef,
        capacity_factor=cfg.capacity_factor if cfg.capacity_factor is not None else template.capacity_factor,
    )
    over["moe"] = moe
    return LlamaConfig.from_name(cfg.preset, **over)


def _router_options(cfg: TrainConfig) -> dict:
    """The router options the command line sets (the others stay the preset's)."""
    names = (
        ("bias_update_rate", "bias_update_rate"),
        ("router_groups", "n_groups"),
        ("topk_groups", "topk_groups"),
        ("base_round_bytes", "base_round_bytes"),
    )
    return {option: getattr(cfg, field) for field, option in names if getattr(cfg, field) is not None}


def upcycle_template(cfg: TrainConfig, dim: int, hidden: int) -> MoEConfig | None:
    """The MoE layer a checkpoint's MLPs are upcycled into (its experts are copies of the MLP,
    as wide), from the run's model options; None without ``upcycle``."""
    if cfg.upcycle is None:
        return None
    top_k = cfg.top_k if cfg.top_k is not None else (1 if cfg.router == "base" else 2)
    options = _router_options(cfg)
    return MoEConfig(
        dim=dim, hidden_dim=hidden, num_experts=cfg.upcycle, top_k=top_k, router=cfg.router,
        combine="sigmoid_residual" if cfg.router == "base" and top_k == 1 else "weighted", router_options=options,
        aux_loss_coef=0.01 if cfg.aux_loss_coef is None else cfg.aux_loss_coef,
        z_loss_coef=0.0 if cfg.z_loss_coef is None else cfg.z_loss_coef, capacity_factor=cfg.capacity_factor,
    )  # fmt: skip


def hf_config_dict(path: str) -> dict:
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"--from-hf {path}: no readable config.json ({err})") from None


def _hf_model_config(cfg: TrainConfig, vocab_size: int) -> LlamaConfig:
    from ..models.llama.hf import config_from_hf

    hf = hf_config_dict(cfg.from_hf)
    try:
        base = config_from_hf(hf)
        if base.vocab_size != vocab_size:
            raise ValueError(
                f"the checkpoint's vocabulary has {base.vocab_size} tokens, the tokenizer {vocab_size}: "
                f"pass the checkpoint's tokenizer.json as --tokenizer"
            )
        over = {"max_seq_len": max(base.max_seq_len, cfg.seq_len)}
        if base.moe is not None:  # a Mixtral: its routing is the checkpoint's, its losses may be set
            losses = {k: getattr(cfg, k) for k in ("aux_loss_coef", "z_loss_coef", "capacity_factor")}
            over["moe"] = replace(base.moe, **{k: v for k, v in losses.items() if v is not None})
        if cfg.upcycle is not None:
            over["moe"] = upcycle_template(cfg, base.dim, base.ffn_hidden_dim)
            over["moe_every"] = cfg.moe_every or 1
        return config_from_hf(hf, **over)
    except (KeyError, ValueError) as err:
        raise ValueError(f"--from-hf {cfg.from_hf}: {err}") from None


def run_tokenizer(cfg: TrainConfig) -> str | None:
    """The tokenizer a run reads: ``--tokenizer``, else the ``--from-hf`` folder's tokenizer.json."""
    if cfg.tokenizer is None and cfg.from_hf is not None:
        path = Path(cfg.from_hf) / "tokenizer.json"
        if path.is_file():
            return str(path)
    return cfg.tokenizer


def load_hf_model(cfg: TrainConfig, config: LlamaConfig, device):
    """The ``--from-hf`` checkpoint's weights in a `Llama` of ``config`` (fp32, on ``device``),
    its MLPs upcycled into the experts of ``--upcycle`` (exact copies, new routers from the seed)."""
    from ..models.llama import Llama
    from ..models.llama.hf import from_hf

    over = {"max_seq_len": config.max_seq_len}
    if config.moe is not None:
        over["moe_every"] = config.moe_every
    model = from_hf(cfg.from_hf, model_cls=Llama, moe=config.moe, seed=cfg.seed, dtype=torch.float32, **over)
    if model.config != config:
        raise ValueError(f"--from-hf {cfg.from_hf}: the loaded model's config differs from the run's")
    return model.to(device)


def model_config_from_dict(d: dict) -> LlamaConfig:
    """Inverse of ``asdict(LlamaConfig)`` as written in ``config.json``."""
    d = dict(d)
    if d.get("moe") is not None:
        d["moe"] = MoEConfig(**d["moe"])
    return LlamaConfig(**d)
