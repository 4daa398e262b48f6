"""`TrainConfig`: everything a run is, as data (written to ``config.json``), and how it builds
the model's `LlamaConfig`.

A resumed run keeps the fields that define what is trained (`RESUME_KEEPS`: model, data,
optimiser, seed, steps) from its ``config.json``; the layout (`LAYOUT_FIELDS`) and the
run-control fields (checkpointing, ``--stop-at``, evaluation cadence) may change from one job to
the next, and keep their saved values unless given again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from ..config import MoEConfig
from ..models.llama import PRESETS, LlamaConfig

__all__ = ["LAYOUT_FIELDS", "RESUME_KEEPS", "TrainConfig", "model_config", "model_config_from_dict"]


@dataclass(kw_only=True)
class TrainConfig:
    # model: a preset and overrides (None keeps the preset's value)
    preset: str = "small"
    experts: int | None = None
    top_k: int | None = None  # None: 1 for BASE, else the preset's
    router: str = "base"
    moe_every: int | None = None
    dense: bool = False  # no MoE layer at all (a dense Llama, e.g. to export as LlamaForCausalLM)
    dim: int | None = None
    n_layers: int | None = None
    aux_loss_coef: float | None = None
    z_loss_coef: float | None = None
    bias_update_rate: float | None = None  # top-k's aux-loss-free balancing bias step
    capacity_factor: float | None = None
    # data
    data: str | None = None  # None: the Python standard library's source, byte-level
    tokenizer: str | None = None
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
    # layout (world size = product; see moe.parallel.parallelize_llama / pipeline_llama)
    nproc: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: bool = False
    dp_shard: int = -1  # -1: whatever the world size leaves
    dp_replicate: int = 1
    pp_schedule: str = "1f1b"
    micro_batches: int | None = None  # None: pp (pipeline) or 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


# the layout: given on a resumed run's command line (any of them), it replaces the saved layout
# as a whole (the fields not given take their defaults), so `--resume --nproc 1` is one process
LAYOUT_FIELDS = ("nproc", "tp", "pp", "ep", "etp", "dp_shard", "dp_replicate", "pp_schedule", "micro_batches")

RESUME_KEEPS = (
    "preset experts top_k router moe_every dense dim n_layers aux_loss_coef z_loss_coef bias_update_rate "
    "capacity_factor data tokenizer batch seq_len val_fraction steps lr min_lr_ratio warmup weight_decay "
    "grad_clip seed"
).split()


def model_config(cfg: TrainConfig, vocab_size: int) -> LlamaConfig:
    """The `LlamaConfig` of a run: the preset with the run's overrides and the tokenizer's vocabulary."""
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
    router_options = dict(template.router_options)
    if cfg.bias_update_rate is not None:
        router_options["bias_update_rate"] = cfg.bias_update_rate
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


def model_config_from_dict(d: dict) -> LlamaConfig:
    """Inverse of ``asdict(LlamaConfig)`` as written in ``config.json``."""
    d = dict(d)
    if d.get("moe") is not None:
        d["moe"] = MoEConfig(**d["moe"])
    return LlamaConfig(**d)
