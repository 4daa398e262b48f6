"""FLOPs, communication bytes and step time of a `Layout` (docs/scale.md, "Time").

Legend: T tokens of one micro-batch, S sequence, D model dim, Dq = H * Dh, Dkv = G * Dh,
F dense width, Fe expert width, Fs shared width, E experts, K top-k, V vocabulary,
M micro-batches, P pipeline ranks, Vs stages per pipeline rank, Tp tensor ranks, a activation bytes.

Attention is the Llama attention of the `LlamaConfig` (grouped-query, head dim D / H) unless
``attention`` describes another (`AttentionShape`: DeepSeek-V3's MLA for its published runs),
whose projections are counted as GEMMs and whose QK^T and AV over Dqk and Dv as attention.

Overlap assumptions (the same for every layout):
- Compute: GEMMs at `Efficiency.gemm` of the bf16 peak (fp8: `Efficiency.gemm_fp8` of the fp8
  peak; both fitted, `moe.plan.calibrate`), attention at
  `Efficiency.attention` of the bf16 peak, elementwise traffic at `Efficiency.hbm` of HBM
  bandwidth; one after the other.
- TP / SP collectives are on the critical path (DTensor redistributes wait on their results);
  the EP exchange too, except what the chunked dispatcher hides behind the experts' GEMMs
  (`dispatch_time`: bytes of the flat and two-level dispatchers, overlap of ``chunks``).
- FSDP all-gathers / reduce-scatters, the HSDP all-reduce and the pipeline's send/recv
  (asynchronous in torch.distributed.pipelining) overlap with compute; only what exceeds the
  step's compute is exposed. The bubble adds (P - 1) / (Vs M) of the busy time (GPipe, 1F1B,
  interleaved 1F1B); under DualPipeV the fraction a list schedule of its own order gives
  (`moe.plan.dualpipev`: forward 1, backward 2, a paired step their sum, nothing of one side's
  all-to-all hidden behind the other's compute).
A collective over n ranks moves (n - 1) / n of its buffer per rank, at the NVLink bandwidth
when its group lies in one node, else at the network's.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.llama import LlamaConfig
from .attention import AttentionShape
from .base_time import global_base_bytes, global_base_s, header_bytes, rerun_s, round_bytes, uses_global_base
from .dispatch_time import chunk_latency_s, ep_layer, ep_ranks_per_node, exchange_s, exposed, fixed_latency_s
from .dualpipev import bubble_fraction
from .hardware import EFFICIENCY, GPU, Efficiency
from .layout import Layout
from .memory import TrainShape, _kinds, _routed_rows
from .shards import stage_summary

__all__ = ["StepTime", "model_flops_per_token", "step_time"]


def model_flops_per_token(cfg: LlamaConfig, seq_len: int, attention: AttentionShape | None = None) -> float:
    """The usual "model FLOPs" (Megatron / NeMo MFU convention): 6 x active parameters +
    12 L S Dq for attention (counted without the causal half), per token of a training step.
    With ``attention`` (an `AttentionShape`): its parameters in place of the Llama attention's,
    and 6 L S H (Dqk + Dv) for attention."""
    if attention is None:
        return 6 * cfg.num_active_params() + 12 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim
    params = cfg.num_active_params() + cfg.n_layers * (attention.params(cfg.dim) - cfg._attention_params())
    return 6 * params + 6 * cfg.n_layers * seq_len * attention.score_value_width


@dataclass
class StepTime:
    step_s: float
    compute_s: float  # per step on the busiest pipeline rank, no bubble
    bubble_s: float
    exposed_s: dict[str, float]  # communication on the critical path, by kind
    overlapped_s: dict[str, float]  # FSDP / DP / PP time (hidden up to compute_s), EP time the chunks hide
    bytes_per_rank: dict[str, float]  # per step, by collective
    executed_flops: float  # per step on the busiest rank
    model_flops: float  # per step, whole cluster
    tokens_per_s_per_gpu: float = 0.0
    tflops_per_gpu: float = 0.0
    mfu: float = 0.0  # model FLOPs against the bf16 dense peak
    base_round_bytes: float = 0.0  # global BASE: a round at the ep group's link, in bytes (0: no solve)


def _layer_flops(
    cfg: LlamaConfig, lay: Layout, i: int, T: int, S: int, attention: AttentionShape | None = None
) -> tuple[float, float, float]:
    """(GEMM FLOPs, attention FLOPs, elementwise bytes) of layer ``i`` for one micro-batch on
    one rank, forward + backward (+ the forward again under recompute); ``attention`` None:
    the Llama attention of ``cfg``."""
    D, t, a = cfg.dim, lay.tp, (4 if lay.precision == "fp32" else 2)
    passes = 4 if lay.recompute else 3  # backward = 2 forwards
    if attention is None:
        dq, dkv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        gemm = 2 * T * (D * (dq + 2 * dkv) + dq * D) / t
        attn = 4 * T * S * dq / t * 0.5  # QK^T and AV, causal: half the pairs
    else:  # its projections; QK^T over Dqk and AV over Dv, causal: half the pairs
        gemm = 2 * T * attention.projection_params(D) / t
        attn = 2 * T * S * attention.score_value_width / t * 0.5
    elem = T * 15 * D * a
    if not cfg.is_moe_layer(i):
        gemm += 2 * T * 3 * D * cfg.ffn_hidden_dim / t
        elem += T * 3 * cfg.ffn_hidden_dim / t * a
    else:
        m = cfg.moe
        rows = _routed_rows(cfg, T)  # without etp every tp rank runs the whole micro-batch
        div = t if lay.etp else 1
        mats = 3 if m.activation == "swiglu" else 2
        fs = m.num_shared_experts * (m.shared_hidden_dim or m.hidden_dim)
        gemm += 2 * T * D * m.num_experts + _expert_flops(cfg, lay, T) + 2 * T * mats * D * fs / div
        elem += (rows * (3 * m.hidden_dim / div + 4 * D) + T * 3 * fs / div) * a
    return gemm * passes, attn * passes, elem * passes


def _expert_flops(cfg: LlamaConfig, lay: Layout, T: int) -> float:
    """FLOPs of one forward of a layer's routed experts for one micro-batch on one rank: the
    compute the chunked exchange can hide behind."""
    m = cfg.moe
    mats = 3 if m.activation == "swiglu" else 2
    return 2 * _routed_rows(cfg, T) * mats * cfg.dim * m.hidden_dim / (lay.tp if lay.etp else 1)


def _group_bw(gpu: GPU, eff: Efficiency, span: int, gpn: int) -> float:
    """Bandwidth of a collective whose group spans ``span`` consecutive ranks."""
    return gpu.nvlink_bw * eff.nvlink if span <= gpn else gpu.net_bw * eff.net


def step_time(
    cfg: LlamaConfig, lay: Layout, shape: TrainShape, gpu: GPU, *, gpus_per_node: int = 8,
    eff: Efficiency = EFFICIENCY, cache: dict | None = None, attention: AttentionShape | None = None,
) -> StepTime:  # fmt: skip
    """The step-time estimate of ``lay`` (one optimizer step of ``shape.global_batch_tokens``);
    ``attention``: the model's attention where it is not ``cfg``'s Llama attention."""
    M, S = shape.microbatches(lay), shape.seq_len
    T = lay.micro_batch * S
    a = 4 if lay.precision == "fp32" else 2
    peak = gpu.fp8_flops * eff.gemm_fp8 if lay.precision == "fp8" else gpu.bf16_flops * eff.gemm
    peak = peak / 2 if lay.precision == "fp32" else peak  # TF32-class GEMMs
    gpn = gpus_per_node
    D = cfg.dim

    flops = {kind: _layer_flops(cfg, lay, i, T, S, attention) for kind, i in _kinds(cfg)}
    n_coll = 12 if lay.recompute else 8  # AG + RS before/after attention and MLP, forward + backward
    tp_layer = n_coll * (lay.tp - 1) / lay.tp * T * D * a if lay.tp > 1 else 0.0
    ep_in_layer = ep_out_layer = ep_layer_s = ep_hidden_layer_s = base_layer_s = base_layer_b = base_round = 0.0
    if cfg.moe is not None and lay.ep > 1:
        intra, inter = ep_layer(cfg, lay, T, _routed_rows(cfg, T), a, gpn)
        n_a2a = 6 if lay.recompute else 4  # dispatch + combine, forward and backward
        ep_in_layer, ep_out_layer = n_a2a * intra, n_a2a * inter
        nodes = lay.ep // ep_ranks_per_node(lay, gpn)  # the ep group's
        one_way = exchange_s(lay, intra, inter, gpu.nvlink_bw * eff.nvlink, gpu.net_bw * eff.net)
        pair_s = 2 * (one_way + chunk_latency_s(lay, nodes))  # dispatch and combine
        experts_s = _expert_flops(cfg, lay, T) / peak  # one forward of the routed experts
        forwards = 2 if lay.recompute else 1
        fixed_s = forwards * fixed_latency_s(lay, nodes)
        ep_layer_s = forwards * exposed(pair_s, experts_s, lay.chunks) + exposed(pair_s, 2 * experts_s, lay.chunks)
        ep_hidden_layer_s = (forwards + 1) * pair_s - ep_layer_s
        ep_layer_s += fixed_s
        if uses_global_base(cfg, lay):  # a solve per forward; a recomputed forward's re-run takes its routes
            bw = _group_bw(gpu, eff, lay.ep * lay.tp, gpn)
            hbm = gpu.hbm_bw * eff.hbm
            base_layer_s = global_base_s(cfg, lay, T, bw, hbm) + (forwards - 1) * rerun_s(cfg, lay, T, bw, hbm)
            base_layer_b = global_base_bytes(cfg, lay, T) + (forwards - 1) * header_bytes(lay.ep)
            base_round = round_bytes(bw)

    # per micro-batch time of each pipeline rank (all its virtual stages); the slowest sets the pace
    c = lay.coords(0)
    per_rank, summaries = [], {}
    for p in range(lay.pp):
        stages = lay.stages_of(p)
        gemm = attn = elem = tp_bytes = ep_in = ep_out = 0.0
        for s in stages:
            sm = summaries[s] = stage_summary(cfg, lay, s, c, cache)
            for kind, n in (("dense", sm.dense_layers), ("moe", sm.moe_layers)):
                if n:
                    g, at, el = flops[kind]
                    gemm, attn, elem = gemm + n * g, attn + n * at, elem + n * el
                    tp_bytes += n * tp_layer
            ep_in, ep_out = ep_in + sm.moe_layers * ep_in_layer, ep_out + sm.moe_layers * ep_out_layer
            if s == lay.num_stages - 1:
                gemm += 3 * 2 * T * D * cfg.vocab_size / lay.tp
        compute = gemm / peak + attn / (gpu.bf16_flops * eff.attention) + elem / (gpu.hbm_bw * eff.hbm)
        tp_s = tp_bytes / _group_bw(gpu, eff, lay.tp, gpn)
        moe_layers = sum(summaries[s].moe_layers for s in stages)
        ep_s, ep_hidden = moe_layers * ep_layer_s, moe_layers * ep_hidden_layer_s
        base_s, base_b = moe_layers * base_layer_s, moe_layers * base_layer_b
        per_rank.append((compute + tp_s + ep_s + base_s, compute, tp_s, ep_s, gemm + attn, tp_bytes, ep_in, ep_out,
                         ep_hidden, base_s, base_b))  # fmt: skip
    slow = max(per_rank, key=lambda r: r[0])
    mb_s, compute_mb, tp_mb, ep_mb, flops_mb, tp_b, ep_in, ep_out, ep_hidden_mb, base_mb, base_b = slow
    busy = M * mb_s
    if lay.pp == 1:
        bubble = 0.0
    elif lay.schedule == "dualpipev":  # from the schedule's own order (moe.plan.dualpipev)
        bubble = bubble_fraction(lay.pp, M) * busy
    else:
        bubble = (lay.pp - 1) / (lay.vpp * M) * busy

    # pipeline send / recv: activations (T / Tp, D) forward, their gradient backward, per stage edge
    pp_bytes = 2 * M * lay.vpp * T * D / lay.tp * a if lay.pp > 1 else 0.0
    pp_s = pp_bytes / _group_bw(gpu, eff, lay.world, gpn)  # stages are dp * tp ranks apart: between nodes

    # FSDP traffic of the busiest rank (coordinate 0 holds the largest shards), pipeline rank 0
    mine = [summaries[s] for s in lay.stages_of(0)]
    local = sum(x.local for x in mine)
    # reshard after forward: gathered again for backward (pipelining keeps them after backward,
    # memory.py); without it, once a step
    gathers = 1 if not lay.reshard else (M + 1) if lay.pp > 1 else 2 * M
    fsdp_ag = gathers * sum(x.fsdp_ag for x in mine) * a
    fsdp_rs = sum(x.fsdp_rs for x in mine) * 4
    dp_ar = 2 * (lay.dp_replicate - 1) / lay.dp_replicate * local * 4 if lay.dp_replicate > 1 else 0.0
    shard_span = lay.dp_shard * lay.tp
    fsdp_s = (fsdp_ag + fsdp_rs) / _group_bw(gpu, eff, shard_span, gpn)
    dp_s = dp_ar / _group_bw(gpu, eff, lay.world // lay.pp, gpn)
    optimizer_s = 28 * local / (gpu.hbm_bw * eff.hbm)  # AdamW reads p, g, m, v and writes p, m, v in fp32
    compute_s = M * compute_mb
    hidden = max(0.0, fsdp_s + dp_s + pp_s - compute_s)
    step = busy + bubble + hidden + optimizer_s
    cache = {} if cache is None else cache
    key = ("model_flops", S, attention)  # an AttentionShape is frozen: hashable, like None
    if key not in cache:
        cache[key] = model_flops_per_token(cfg, S, attention)
    mf = cache[key] * shape.global_batch_tokens
    out = StepTime(
        step_s=step, compute_s=compute_s, bubble_s=bubble,
        exposed_s={"tp": M * tp_mb, "ep_all_to_all": M * ep_mb, "global_base": M * base_mb,
                   "fsdp_dp_pp_excess": hidden, "optimizer": optimizer_s},
        overlapped_s={"fsdp": fsdp_s, "dp_all_reduce": dp_s, "pp_send_recv": pp_s,
                      "ep_all_to_all_hidden": M * ep_hidden_mb},
        bytes_per_rank={"tp_all_gather_reduce_scatter": M * tp_b, "ep_all_to_all_intra_node": M * ep_in,
                        "ep_all_to_all_inter_node": M * ep_out, "global_base": M * base_b, "pp_send_recv": pp_bytes,
                        "fsdp_all_gather": fsdp_ag, "fsdp_reduce_scatter": fsdp_rs, "dp_all_reduce": dp_ar},
        executed_flops=M * flops_mb, model_flops=mf, base_round_bytes=base_round,
    )  # fmt: skip
    out.tokens_per_s_per_gpu = shape.global_batch_tokens / step / lay.world
    out.tflops_per_gpu = mf / step / lay.world / 1e12
    out.mfu = mf / step / lay.world / gpu.bf16_flops
    return out
