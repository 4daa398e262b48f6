"""`Layout`: one way of laying a `Llama` out over a cluster, as `parallelize_llama` and
`pipeline_llama` would (the planner's input; data only).

Legend: P pipeline ranks (``pp``), V stages per pipeline rank (``vpp``), R ``dp_replicate``,
Sh ``dp_shard`` (it includes the expert-parallel ranks: ``ep`` divides it, as in
`moe.parallel.layout`), Ep ``ep``, Shm = Sh / Ep, Tp ``tp``, Dp = R * Sh data-parallel ranks.

Global rank order is the mesh's row-major order (pp, dp_replicate, dp_shard_mod_ep, ep, tp):
tp is innermost, so a tp group is ``tp`` consecutive ranks and an ep group spans ep * tp
consecutive ranks with stride tp.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["DISPATCHES", "PRECISIONS", "SCHEDULES", "Layout", "parse_layout"]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "dualpipev")
MULTI_STAGE = ("interleaved_1f1b", "dualpipev")  # the schedules with vpp >= 2 stages per pipeline rank
PRECISIONS = ("bf16", "fp8", "fp32")
DISPATCHES = ("flat", "hierarchical")  # parallelize_moe's dispatch= ("auto" resolves to one of these)
_INTS = ("tp", "pp", "vpp", "ep", "dp_shard", "dp_replicate", "micro_batch", "chunks")
_BOOLS = ("etp", "recompute", "loss_parallel", "reshard")
_STRS = ("schedule", "precision", "dispatch")


@dataclass(frozen=True, kw_only=True)
class Layout:
    tp: int = 1  # tensor parallel with sequence parallelism (always on under tp > 1)
    pp: int = 1
    vpp: int = 1  # stages per pipeline rank (>= 2 with interleaved_1f1b, 2 with dualpipev)
    schedule: str = "1f1b"
    ep: int = 1
    etp: bool = False  # experts' hidden dim sharded over tp instead of the layer replicated there
    dp_shard: int = 1
    dp_replicate: int = 1
    recompute: bool = False  # activation checkpointing of every block
    precision: str = "bf16"  # bf16: FSDP2 mixed precision (fp32 master shards), fp8: bf16 + fp8 GEMMs
    micro_batch: int = 1  # sequences per micro-batch
    loss_parallel: bool = False
    reshard: bool = True  # parallelize_llama's reshard_after_forward (False: ZeRO-2-like, one gather a step)
    dispatch: str = "flat"  # expert-parallel dispatcher: "flat" (a copy per (token, expert)) or "hierarchical"
    chunks: int = 1  # rows split in C chunks, one chunk's all-to-all in flight behind another's experts

    def __post_init__(self) -> None:
        for name in _INTS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"layout {name} must be a positive int, got {value!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"layout schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.dispatch not in DISPATCHES:
            raise ValueError(f"layout dispatch must be one of {DISPATCHES}, got {self.dispatch!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"layout precision must be one of {PRECISIONS}, got {self.precision!r}")
        if (self.vpp >= 2) != (self.schedule in MULTI_STAGE) or (self.schedule == "dualpipev" and self.vpp != 2):
            raise ValueError(
                f"vpp={self.vpp}: interleaved_1f1b needs vpp >= 2, dualpipev takes vpp=2, gpipe and 1f1b take vpp=1"
            )
        if self.dp_shard % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide dp_shard={self.dp_shard}: expert parallelism is folded onto the "
                f"dp_shard ranks (dp_shard counts them)"
            )
        if (self.dispatch != "flat" or self.chunks > 1) and self.ep == 1:
            raise ValueError(
                f"dispatch={self.dispatch} and chunks={self.chunks} shape the expert-parallel exchange, but ep=1"
            )
        if (self.etp or self.loss_parallel) and self.tp == 1:
            raise ValueError(f"etp and loss_parallel shard over tp, but tp=1 (etp={self.etp})")
        if self.loss_parallel and self.pp > 1:
            raise ValueError("loss_parallel is not supported with pipeline stages (pipeline_llama rejects it)")

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_mod_ep(self) -> int:
        return self.dp_shard // self.ep

    @property
    def edp(self) -> int:
        """Ranks holding the same experts: dp_replicate x dp_shard_mod_ep."""
        return self.dp_replicate * self.dp_shard_mod_ep

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    def stages_of(self, p: int) -> list[int]:
        """The stages pipeline rank ``p`` holds: p, p + P, ... (interleaved); p and 2P - 1 - p
        (dualpipev's V)."""
        if self.schedule == "dualpipev":
            return [p, 2 * self.pp - 1 - p]
        return list(range(p, self.num_stages, self.pp))

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank: pp, dp_replicate, dp_shard_mod_ep, ep, tp."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank must be in [0, {self.world}), got {rank}")
        out = {}
        for name, size in reversed(self._dims()):
            rank, out[name] = divmod(rank, size)
        return out

    def rank(self, **coords: int) -> int:
        """The global rank at these coordinates (missing ones: 0)."""
        r = 0
        for name, size in self._dims():
            r = r * size + coords.get(name, 0)
        return r

    def _dims(self) -> list[tuple[str, int]]:
        return [
            ("pp", self.pp), ("dp_replicate", self.dp_replicate), ("dp_shard_mod_ep", self.dp_shard_mod_ep),
            ("ep", self.ep), ("tp", self.tp),
        ]  # fmt: skip

    def short(self) -> str:
        """``tp=8,pp=4,ep=8,...``: the non-default fields, as `parse_layout` reads them."""
        default = Layout()
        parts = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("tp", "pp", "ep", "dp_shard") or v != getattr(default, f.name):
                parts.append(f"{f.name}={int(v) if isinstance(v, bool) else v}")
        return ",".join(parts)


def parse_layout(text: str, gpus: int | None = None) -> Layout:
    """``"tp=8,pp=8,ep=8,dp_shard=16,recompute=1"`` -> Layout. Without ``dp_shard``, it is
    what ``gpus`` leaves after the other dimensions (``gpus / (tp * pp * dp_replicate)``)."""
    fields: dict = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"layout item {item!r} must be key=value")
        if key in _INTS:
            try:
                fields[key] = int(value)
            except ValueError:
                raise ValueError(f"layout {key} must be an int, got {value!r}") from None
            if fields[key] < 1:  # before dp_shard is derived from it (a 0 would divide by zero there)
                raise ValueError(f"layout {key} must be a positive int, got {fields[key]}")
        elif key in _BOOLS:
            if value.lower() not in ("0", "1", "true", "false", "on", "off"):
                raise ValueError(f"layout {key} must be 0/1/true/false/on/off, got {value!r}")
            fields[key] = value.lower() in ("1", "true", "on")
        elif key in _STRS:
            fields[key] = value
        else:
            raise ValueError(f"unknown layout key {key!r}; known: {sorted(_INTS + _BOOLS + _STRS)}")
    if fields.get("vpp", 1) >= 2 and "schedule" not in fields:
        fields["schedule"] = "interleaved_1f1b"
    if fields.get("schedule") in MULTI_STAGE and "vpp" not in fields:
        fields["vpp"] = 2
    if "dp_shard" not in fields and gpus is not None:
        rest = fields.get("tp", 1) * fields.get("pp", 1) * fields.get("dp_replicate", 1)
        if gpus % rest:
            raise ValueError(f"tp * pp * dp_replicate = {rest} does not divide the {gpus} GPUs")
        fields["dp_shard"] = gpus // rest
    return Layout(**fields)
