"""Check one layout against a model and cluster, evaluate it, and enumerate the layouts that
fit (`search`), ranked by estimated tokens/s per GPU."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ..models.llama import LlamaConfig
from .hardware import GPU
from .layout import Layout
from .memory import COMPONENTS, USABLE_FRACTION, TrainShape, peak_memory
from .time import StepTime, model_flops_per_token, step_time

__all__ = ["Plan", "check_layout", "evaluate", "nearest", "search"]


@dataclass
class Plan:
    layout: Layout
    fits: bool
    reason: str | None = None  # why it does not fit (None when it fits)
    rank: int | None = None  # the rank needing the most memory
    memory: dict[str, int] | None = None  # its bytes by component + "total"
    time: StepTime | None = None

    def to_json(self, cfg: LlamaConfig, gpu: GPU) -> dict:
        out = {
            "layout": self.layout.short(), "fits": self.fits, "reason": self.reason, "busiest_rank": self.rank,
            "bytes_per_rank": self.memory, "hbm_bytes": gpu.hbm_bytes,
            "usable_hbm_bytes": int(gpu.hbm_bytes * USABLE_FRACTION),
            "total_params": cfg.num_params(), "active_params": cfg.num_active_params(),
        }  # fmt: skip
        t = self.time
        if t is not None:
            out |= {
                "tokens_per_s_per_gpu": t.tokens_per_s_per_gpu, "mfu": t.mfu, "tflops_per_gpu": t.tflops_per_gpu,
                "step_s": t.step_s, "compute_s": t.compute_s, "bubble_s": t.bubble_s, "exposed_s": t.exposed_s,
                "overlapped_s": t.overlapped_s, "collective_bytes_per_rank": t.bytes_per_rank,
                "executed_flops_per_rank": t.executed_flops, "model_flops_per_step": t.model_flops,
                "base_round_bytes": t.base_round_bytes,
            }  # fmt: skip
        else:
            out |= {"tokens_per_s_per_gpu": None, "mfu": None}
        return out


def check_layout(cfg: LlamaConfig, lay: Layout, shape: TrainShape, gpus: int, gpus_per_node: int = 8) -> None:
    """Raise ValueError saying what is wrong with ``lay`` for this model, batch and GPU count
    (the checks `parallelize_llama` / `pipeline_llama` would make, before any memory)."""
    if lay.world != gpus:
        raise ValueError(
            f"pp * dp_replicate * dp_shard * tp = {lay.pp}*{lay.dp_replicate}*{lay.dp_shard}*{lay.tp} = "
            f"{lay.world}, not the {gpus} GPUs"
        )
    if cfg.n_heads % lay.tp or cfg.n_kv_heads % lay.tp:
        raise ValueError(f"tp={lay.tp} does not divide n_heads={cfg.n_heads} and n_kv_heads={cfg.n_kv_heads}")
    if shape.seq_len % lay.tp:
        raise ValueError(f"tp={lay.tp} does not divide seq_len={shape.seq_len} (sequence parallelism)")
    if cfg.moe is None and (lay.ep > 1 or lay.etp):
        raise ValueError(f"ep={lay.ep} / etp={lay.etp} need MoE layers; the model is dense")
    if cfg.moe is not None and cfg.moe.num_experts % lay.ep:
        raise ValueError(f"ep={lay.ep} does not divide num_experts={cfg.moe.num_experts}")
    if lay.etp and cfg.moe.hidden_dim % lay.tp:
        raise ValueError(f"etp: tp={lay.tp} does not divide the expert hidden_dim={cfg.moe.hidden_dim}")
    local = max(1, gpus_per_node // lay.tp)  # ep ranks per node (the ep peers are tp ranks apart)
    if lay.dispatch == "hierarchical" and lay.ep > local and lay.ep % local:
        raise ValueError(
            f"dispatch=hierarchical: the {local} ep ranks per node (gpus_per_node / tp) must divide ep={lay.ep}"
        )
    if lay.num_stages > cfg.n_layers:
        raise ValueError(f"pp * vpp = {lay.num_stages} stages exceed the model's {cfg.n_layers} layers")
    if lay.dp == 1 and lay.precision != "fp32":
        raise ValueError(
            f"precision={lay.precision} is FSDP2's mixed precision, which needs data-parallel ranks "
            f"(parallelize_llama rejects mp_policy at dp=1); use precision=fp32 or dp_shard > 1"
        )
    m = shape.microbatches(lay)  # raises if the batch does not split
    if lay.schedule == "interleaved_1f1b" and m % lay.pp:
        raise ValueError(f"interleaved_1f1b needs the {m} micro-batches divisible by pp={lay.pp}")
    if lay.schedule == "dualpipev" and m < 2 * lay.pp:
        raise ValueError(f"dualpipev needs the {m} micro-batches >= its 2 x pp = {2 * lay.pp} stages")


def evaluate(cfg: LlamaConfig, lay: Layout, shape: TrainShape, gpu: GPU, gpus: int, gpus_per_node: int = 8) -> Plan:
    """The plan of one layout: invalid (reason), too large (reason, memory) or fitting (memory, time)."""
    try:
        check_layout(cfg, lay, shape, gpus, gpus_per_node)
    except ValueError as e:
        return Plan(lay, False, str(e))
    cache: dict = {("model_flops", shape.seq_len): _model_flops(cfg, shape.seq_len)}
    rank, mem = peak_memory(cfg, lay, shape, cache)
    usable = gpu.hbm_bytes * USABLE_FRACTION
    t = step_time(cfg, lay, shape, gpu, gpus_per_node=gpus_per_node, cache=cache)
    if mem["total"] > usable:
        worst = max(COMPONENTS, key=lambda k: mem[k])
        reason = (
            f"needs {mem['total'] / 2**30:.1f} GiB on rank {rank}, more than {USABLE_FRACTION:.0%} of "
            f"{gpu.hbm_bytes / 2**30:.1f} GiB HBM (largest: {worst} {mem[worst] / 2**30:.1f} GiB)"
        )
        return Plan(lay, False, reason, rank, mem, t)
    return Plan(lay, True, None, rank, mem, t)


_FLOPS: dict = {}


def _model_flops(cfg: LlamaConfig, seq_len: int) -> float:
    key = (repr(cfg), seq_len)  # counting the parameters walks every layer: once per model
    if key not in _FLOPS:
        _FLOPS[key] = model_flops_per_token(cfg, seq_len)
    return _FLOPS[key]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


CHUNKS = (1, 2, 4)


def _exchanges(ep: int, tp: int, gpus_per_node: int) -> list[tuple[str, int]]:
    """(dispatch, chunks) worth trying: none without ep; the two-level dispatcher only when the
    ep group spans nodes (inside one it is the flat one plus a stage)."""
    if ep == 1:
        return [("flat", 1)]
    local = max(1, gpus_per_node // tp)
    two_level = ep > local and ep % local == 0
    dispatches = ("flat", "hierarchical") if two_level else ("flat",)
    return [(d, c) for d in dispatches for c in CHUNKS]


def candidates(cfg: LlamaConfig, gpus: int, gpus_per_node: int, precision: str, micro_batch: int = 1):
    """Every layout worth trying: tp within a node dividing the heads, any pp up to the layers,
    dp_replicate 1 or 2, ep dividing the experts and dp_shard, etp, interleaving (2 stages per
    rank), recompute and reshard-after-forward on and off, and under ep the flat or (across
    nodes) two-level dispatch with 1, 2 or 4 chunks."""
    heads = math.gcd(cfg.n_heads, cfg.n_kv_heads)
    moe = cfg.moe is not None
    for tp in [d for d in _divisors(min(gpus, gpus_per_node)) if heads % d == 0 and gpus % d == 0]:
        for pp in [d for d in _divisors(gpus // tp) if d <= cfg.n_layers]:
            for rep in (1, 2):
                if (gpus // (tp * pp)) % rep:
                    continue
                shard = gpus // (tp * pp * rep)
                eps = [e for e in _divisors(shard) if moe and cfg.moe.num_experts % e == 0] or [1]
                for ep, etp, vpp, rc, rs in itertools.product(eps, (False, True), (1, 2), (False, True), (True, False)):
                    if (etp and (tp == 1 or not moe)) or (vpp == 2 and (pp == 1 or 2 * pp > cfg.n_layers)):
                        continue
                    for dispatch, chunks in _exchanges(ep, tp, gpus_per_node):
                        yield Layout(
                            tp=tp, pp=pp, vpp=vpp, schedule="interleaved_1f1b" if vpp == 2 else "1f1b", ep=ep,
                            etp=etp, dp_shard=shard, dp_replicate=rep, recompute=rc, precision=precision,
                            micro_batch=micro_batch, reshard=rs, dispatch=dispatch, chunks=chunks,
                        )  # fmt: skip


def search(cfg, shape, gpu, gpus, gpus_per_node=8, precision="bf16", micro_batch=1) -> list[Plan]:
    """Every candidate evaluated: the fitting ones first, fastest first, then the rest."""
    plans = [evaluate(cfg, lay, shape, gpu, gpus, gpus_per_node) for lay in candidates(
        cfg, gpus, gpus_per_node, precision, micro_batch)]  # fmt: skip
    return sorted(plans, key=lambda p: (not p.fits, -(p.time.tokens_per_s_per_gpu if p.fits else 0.0)))


def _distance(a: Layout, b: Layout) -> float:
    d = 0.0
    for f in ("tp", "pp", "vpp", "ep", "dp_shard", "dp_replicate", "micro_batch"):
        d += abs(math.log2(getattr(a, f)) - math.log2(getattr(b, f)))
    d += abs(math.log2(a.chunks) - math.log2(b.chunks))
    for f in ("etp", "recompute", "reshard", "schedule", "precision", "dispatch"):
        d += 0.5 * (getattr(a, f) != getattr(b, f))
    return d


def nearest(lay: Layout, plans: list[Plan], k: int = 3) -> list[Plan]:
    """The ``k`` fitting plans closest to ``lay`` (log-distance over the sizes, 0.5 per flag)."""
    fitting = [p for p in plans if p.fits and p.layout != lay]
    return sorted(fitting, key=lambda p: (_distance(lay, p.layout), -p.time.tokens_per_s_per_gpu))[:k]
