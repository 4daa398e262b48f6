"""Exact local parameter shards of a `Llama` under a `Layout`, rank by rank, following the
rules of `moe.parallel.parallelize_llama` and `pipeline_llama` (and tested against them with
the real model on a fake process group, tests/plan/test_exact.py).

Legend: D model dim, F dense width, Fe expert width, Fs shared-expert width, E experts,
V vocabulary, Dq = H * Dh, Dkv = G * Dh.

The rules, in the order they are applied:
1. Pipeline: stage s of N = P * V takes the s-th contiguous run of layers (`stage_layers`);
   rank p holds stages p, p + P, ...; the embedding is in stage 0, norm and output in N - 1.
2. Tensor parallel (tp > 1): wq, wk, wv, dense w1, w3 and the output projection are colwise
   (dim 0 of the (out, in) weight is chunked over tp), wo and dense w2 rowwise (dim 1), the
   embedding rowwise (dim 0: vocabulary rows); norms, routers and (without etp) the whole MoE
   layer are replicated over tp.
3. Experts (ep > 1 or etp): w1, w3 (E, D, Fe) and w2 (E, Fe, D) chunked on dim 0 over ep;
   under etp also on Fe (dim 2 of w1/w3, dim 1 of w2) over tp.
4. FSDP2 chunks dim 0 of each (already local) tensor over its group with torch.chunk's rule:
   chunk c = ceil(n / k), rank i holds max(0, min(c, n - i c)) rows, so trailing ranks may
   hold fewer or none. Groups: the expert weights of a parallelised MoE layer over ``edp``
   (index r * Shm + m; a group of one when edp = 1), the router and shared experts under etp over
   ``dp_tp`` (index ((r * Shm + m) * Ep + e) * Tp + t), everything else over
   (dp_replicate, dp_shard) HSDP: index m * Ep + e of Sh (replicated over R). No FSDP when Dp = 1.
Every DTensor shard follows torch.chunk's rule too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..models.llama import LlamaConfig
from .layout import Layout

__all__ = [
    "ParamSpec", "StageSummary", "Unit", "chunk", "fsdp_group_size", "gathered_numel", "local_numel", "rank_params",
    "stage_layers", "stage_specs", "stage_summary",
]  # fmt: skip


def chunk(n: int, k: int, i: int) -> int:
    """Length of piece ``i`` of ``torch.chunk`` of ``n`` rows into ``k`` (empty pieces allowed)."""
    c = -(-n // k)
    return max(0, min(c, n - i * c))


def stage_layers(n_layers: int, num_stages: int) -> list[range]:
    """Contiguous runs of layers, balanced by count, the first ``L mod N`` one longer (as
    `moe.parallel.pipeline.stage_layers`)."""
    if num_stages > n_layers:
        raise ValueError(f"the model has {n_layers} layers, fewer than the {num_stages} pipeline stages (pp x vpp)")
    size, extra = divmod(n_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        end = start + size + (s < extra)
        out.append(range(start, end))
        start = end
    return out


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None = None  # dim chunked over tp
    ep_dim: int | None = None  # dim chunked over ep (expert weights of a parallelised MoE)
    group: str = "dp"  # FSDP group: "dp" (HSDP over R x Sh), "edp", "dp_tp"
    layer: int | None = None  # None: embedding, final norm, output
    expert: bool = False  # routed-expert weight (for the report's split)
    d_dim: int | None = None  # expert weights: the model dim, FSDP's when the experts do not split evenly and D does


def _layer_specs(cfg: LlamaConfig, lay: Layout, i: int) -> list[ParamSpec]:
    D, Dh = cfg.dim, cfg.head_dim
    dq, dkv = cfg.n_heads * Dh, cfg.n_kv_heads * Dh
    tp_on = lay.tp > 1
    col, row = (0 if tp_on else None), (1 if tp_on else None)
    p = f"layers.{i}."
    out = [
        ParamSpec(p + "attention_norm.weight", (D,), layer=i),
        ParamSpec(p + "attention.wq.weight", (dq, D), col, layer=i),
        ParamSpec(p + "attention.wk.weight", (dkv, D), col, layer=i),
        ParamSpec(p + "attention.wv.weight", (dkv, D), col, layer=i),
        ParamSpec(p + "attention.wo.weight", (D, dq), row, layer=i),
        ParamSpec(p + "ffn_norm.weight", (D,), layer=i),
    ]
    if not cfg.is_moe_layer(i):
        F = cfg.ffn_hidden_dim
        return out + [
            ParamSpec(p + "feed_forward.w1.weight", (F, D), col, layer=i),
            ParamSpec(p + "feed_forward.w3.weight", (F, D), col, layer=i),
            ParamSpec(p + "feed_forward.w2.weight", (D, F), row, layer=i),
        ]
    m = cfg.moe
    E, Fe = m.num_experts, m.hidden_dim
    parallel = lay.ep > 1 or lay.etp
    side = "dp_tp" if lay.etp else "dp"
    out.append(ParamSpec(p + "feed_forward.router.weight", (E, D), group=side, layer=i))
    ex = dict(ep_dim=0 if parallel else None, group="edp" if parallel else "dp", layer=i, expert=True)
    et = lay.etp
    out += [ParamSpec(p + "feed_forward.experts.w1", (E, D, Fe), 2 if et else None, d_dim=1, **ex)]
    if m.activation == "swiglu":
        out += [ParamSpec(p + "feed_forward.experts.w3", (E, D, Fe), 2 if et else None, d_dim=1, **ex)]
    out += [ParamSpec(p + "feed_forward.experts.w2", (E, Fe, D), 1 if et else None, d_dim=2, **ex)]
    if m.num_shared_experts:
        # one MLP of num_shared * Fs columns (moe.experts.SharedExperts), replicated over tp
        fs = m.num_shared_experts * (m.shared_hidden_dim or Fe)
        names = ("w1", "w3", "w2") if m.activation == "swiglu" else ("w1", "w2")
        for w in names:
            shape = (D, fs) if w == "w2" else (fs, D)
            out.append(ParamSpec(p + f"feed_forward.shared.{w}.weight", shape, group=side, layer=i))
    return out


def stage_specs(cfg: LlamaConfig, lay: Layout, stage: int) -> list[ParamSpec]:
    """The parameters of pipeline stage ``stage`` (0 .. N-1), unsharded shapes and rules."""
    runs = stage_layers(cfg.n_layers, lay.num_stages)
    specs = []
    for i in runs[stage]:
        specs += _layer_specs(cfg, lay, i)
    return specs + stage_specs_ends(cfg, lay, stage)


def _tp_ep_shape(spec: ParamSpec, lay: Layout, c: dict[str, int]) -> list[int]:
    shape = list(spec.shape)
    if spec.ep_dim is not None:
        shape[spec.ep_dim] = chunk(shape[spec.ep_dim], lay.ep, c["ep"])
    if spec.tp_dim is not None:
        shape[spec.tp_dim] = chunk(shape[spec.tp_dim], lay.tp, c["tp"])
    return shape


def local_numel(spec: ParamSpec, lay: Layout, c: dict[str, int]) -> int:
    """Elements of ``spec`` held by the rank at mesh coordinates ``c`` (`Layout.coords`)."""
    shape = _tp_ep_shape(spec, lay, c)
    r, m, e, t = c["dp_replicate"], c["dp_shard_mod_ep"], c["ep"], c["tp"]
    if spec.group == "edp":
        k, i = lay.edp, r * lay.dp_shard_mod_ep + m
    elif spec.group == "dp_tp":
        k, i = lay.dp * lay.tp, ((r * lay.dp_shard_mod_ep + m) * lay.ep + e) * lay.tp + t
    else:
        k, i = (lay.dp_shard, m * lay.ep + e) if lay.dp > 1 else (1, 0)
    if k > 1:
        dim = _fsdp_dim(spec, shape, k)
        shape[dim] = chunk(shape[dim], k, i)
    return math.prod(shape)


def _fsdp_dim(spec: ParamSpec, shape: list[int], k: int) -> int:
    """The dim FSDP2 shards over ``k`` ranks: 0, or D for experts that do not split evenly
    (`parallelize_llama`)."""
    return spec.d_dim if spec.d_dim is not None and shape[0] % k and shape[spec.d_dim] % k == 0 else 0


def gathered_numel(spec: ParamSpec, lay: Layout, c: dict[str, int]) -> int:
    """Elements of FSDP2's all-gather output for ``spec``: the local tensor with its sharded dim
    padded to k pieces of the first piece's length (torch.chunk's), which the unsharded
    parameter keeps as its storage and the reduce-scatter input has too."""
    shape, k = _tp_ep_shape(spec, lay, c), fsdp_group_size(spec, lay)
    if k > 1:
        dim = _fsdp_dim(spec, shape, k)
        shape[dim] = -(-shape[dim] // k) * k
    return math.prod(shape)


def rank_params(cfg: LlamaConfig, lay: Layout, rank: int) -> dict[str, int]:
    """{parameter name: local elements} of every parameter the global ``rank`` holds."""
    c = lay.coords(rank)
    out = {}
    for stage in lay.stages_of(c["pp"]):
        for spec in stage_specs(cfg, lay, stage):
            out[spec.name] = local_numel(spec, lay, c)
    return out


@dataclass(frozen=True)
class StageSummary:
    """Totals of one stage on one rank (what the memory and time models need), computed from
    one representative layer of each kind (all dense layers shard alike, all MoE layers too)."""

    local: int  # elements held (sum of local_numel)
    gathered: int  # elements after FSDP's all-gathers, over the specs FSDP gathers
    block_max: int  # the largest block (or the embedding / output group) once gathered
    fsdp_ag: int  # sum over gathered specs of local * (group size - 1): elements received per gather
    fsdp_rs: int  # the same for the gradient reduce-scatter
    dense_layers: int
    moe_layers: int
    units: tuple = ()  # per kind of block present: (kind, count, its FSDP units in forward order),
    # a unit as `Unit`; an expert-parallel MoE block has two: the rest (outer, over dp) and its
    # experts (over edp); on one rank's experts (ep=1 without etp) the block is one unit


@dataclass(frozen=True)
class Unit:
    """One FSDP unit of a block once gathered: its elements (padded as FSDP2 gathers them), those
    of its parameters FSDP2 shards on a dim other than 0 (experts sharded on D), and the largest of
    those (`memory.fsdp_backward_peak` says what each costs)."""

    numel: int
    d_numel: int = 0
    d_max: int = 0


def _spec_numbers(specs, lay: Layout, c: dict[str, int]) -> tuple[int, int, int]:
    local = gathered = ag = 0
    for s in specs:
        n = local_numel(s, lay, c)
        local += n
        k = fsdp_group_size(s, lay)
        if k > 1 or lay.dp > 1:  # under FSDP (even over one rank) a gathered compute-dtype copy exists
            gathered += gathered_numel(s, lay, c)
            ag += n * (k - 1)
    return local, gathered, ag


def _unit(specs, lay: Layout, c: dict[str, int]) -> Unit:
    sizes = [(gathered_numel(s, lay, c), s) for s in specs]
    k = {s.name: fsdp_group_size(s, lay) for s in specs}
    on_d = [n for n, s in sizes if k[s.name] > 1 and _fsdp_dim(s, _tp_ep_shape(s, lay, c), k[s.name])]
    return Unit(sum(n for n, _ in sizes), sum(on_d), max(on_d, default=0))


def fsdp_group_size(spec: ParamSpec, lay: Layout) -> int:
    """Ranks FSDP shards ``spec`` over (1: not sharded by FSDP)."""
    if lay.dp == 1 and spec.group == "dp":
        return 1
    return {"edp": lay.edp, "dp_tp": lay.dp * lay.tp}.get(spec.group, lay.dp_shard if lay.dp > 1 else 1)


def stage_summary(cfg: LlamaConfig, lay: Layout, stage: int, c: dict[str, int], cache: dict | None = None):
    """`StageSummary` of ``stage`` on the rank at ``c``. ``cache``: a dict reused across calls
    for the same ``cfg`` and ``lay`` (the per-kind numbers do not depend on the stage)."""
    cache = {} if cache is None else cache
    key = (c["dp_replicate"], c["dp_shard_mod_ep"], c["ep"], c["tp"])  # the pp coordinate does not matter
    if ("kinds",) not in cache:  # per stage: dense and MoE layer counts and a layer of each kind
        kinds = []
        for run in stage_layers(cfg.n_layers, lay.num_stages):
            moe = [i for i in run if cfg.is_moe_layer(i)]
            dense = [i for i in run if not cfg.is_moe_layer(i)]
            kinds.append((("dense", len(dense), dense[:1]), ("moe", len(moe), moe[:1])))
        cache[("kinds",)] = kinds
    local = gathered = ag = block_max = 0
    counts, units = {}, []
    for kind, n, rep in cache[("kinds",)][stage]:
        counts[kind] = n
        if not n:
            continue
        if (kind, *key) not in cache:
            specs = _layer_specs(cfg, lay, rep[0])
            ex, rest = [x for x in specs if x.expert], [x for x in specs if not x.expert]
            # in forward order; the experts are a unit of their own under expert parallelism
            # (ep > 1 or etp), else in the block's (`parallelize_llama`)
            own = ex and (lay.ep > 1 or lay.etp)
            us = (_unit(rest, lay, c), _unit(ex, lay, c)) if own else (_unit(specs, lay, c),)
            cache[(kind, *key)] = (*_spec_numbers(specs, lay, c), us)
        lo, ga, a, us = cache[(kind, *key)]
        local, gathered, ag = local + lo * n, gathered + ga * n, ag + a * n
        block_max = max(block_max, ga)
        units.append((kind, n, us))
    ends = (stage == 0, stage == lay.num_stages - 1)
    if ends != (False, False):
        if ("ends", ends, *key) not in cache:
            cache[("ends", ends, *key)] = _spec_numbers(stage_specs_ends(cfg, lay, stage), lay, c)
        lo, ga, a = cache[("ends", ends, *key)]
        local, gathered, ag, block_max = local + lo, gathered + ga, ag + a, max(block_max, ga)
    return StageSummary(local, gathered, block_max, ag, ag, counts["dense"], counts["moe"], tuple(units))


def stage_specs_ends(cfg: LlamaConfig, lay: Layout, stage: int) -> list[ParamSpec]:
    """The parameters of ``stage`` outside its blocks (embedding; final norm and output)."""
    specs = []
    if stage == 0:
        specs.append(ParamSpec("tok_embeddings.weight", (cfg.vocab_size, cfg.dim), 0 if lay.tp > 1 else None))
    if stage == lay.num_stages - 1:
        specs.append(ParamSpec("norm.weight", (cfg.dim,)))
        specs.append(ParamSpec("output.weight", (cfg.vocab_size, cfg.dim), 0 if lay.tp > 1 else None))
    return specs
