"""Bytes per rank by component for a `Layout` (docs/scale.md, "Memory").

Legend: T tokens of one micro-batch (micro_batch * S), S sequence, D model dim, F dense width,
Fe expert width, K experts per token, V vocabulary, a bytes of an activation element
(2 under bf16 and fp8, 4 under fp32), M micro-batches per step, P pipeline ranks, Tp tensor ranks.

Assumptions (stated once, the same for every layout):
- Parameters: the FSDP2 shards are fp32 (the master weights under mixed precision: FSDP2
  all-gathers them in bf16 for compute); gradients are sharded fp32 (fp32 reduce dtype);
  AdamW keeps fp32 m and v: 4 + 4 + 8 = 16 bytes per local element.
- FSDP buffers: without pipelining, the largest moment of FSDP2's backward (`fsdp_backward_peak`:
  a unit's gather, the start of its post-backward, its reduce-scatter copy-in), sizes padded as
  FSDP2 pads them (`gathered_numel`), with the root's parameters (embedding, final norm, output)
  gathered throughout and the output projection's gradient (compute dtype) from its backward
  on; an expert-parallel MoE block's experts are a unit of their own, inside the rest of the
  block (without ep or etp the block is one unit, its experts with the rest). For uniform
  dense blocks: three blocks in compute dtype (the one running, its gradient, the one
  prefetched) and one in fp32 (the last reduce-scatter input, in flight). Under pipelining,
  torch.distributed.pipelining keeps gradients unsharded (no sync) and parameters unsharded
  after backward, and reduces after the stage's backward: the stage's whole unsharded parameters
  (compute dtype) and gradients (fp32: FSDP2 accumulates them in its reduce dtype), and one unit
  more (`_no_sync_extra`). With ``reshard=False`` (no reshard after forward) every block stays
  gathered between its forward and backward.
- Activations: the tensors an ideal block keeps for backward: norm inputs (sequence shard),
  the gathered inputs of the column-parallel projections (DTensor keeps them whole), q, k, v
  and the attention output (flash attention: no S x S matrix), and in the MLPs both
  projections, the activation and its product (4 F-wide tensors per token); an MoE layer keeps
  its K routed copies of each token on input and output and 4 Fe-wide tensors per copy, its
  routing assumed balanced (dropless) or capped by the capacity factor. Without etp the MoE
  layer runs the whole sequence on every tp rank. With recompute a block keeps only its input
  and one block's activations are live again in backward. Live micro-batches by schedule:
  GPipe M, 1F1B min(M, P - p) on pipeline rank p, interleaved 1F1B (V - 1) P + 2 (P - 1 - p) + 1
  virtual-stage chunks (torch.distributed.pipelining's warm-up), DualPipeV 2P + 1 stage chunks on
  every rank (counted from its order, `moe.plan.dualpipev`), one micro-batch without pipelining.
  The real block keeps more than the ideal one, in fp32 whatever the compute dtype (measured
  by PyTorch's memory tracker, tests/plan/test_memcheck.py): each RMSNorm's fp32 input copy and
  its reciprocal norm, and attention's log-sum-exp per head (`fp32_kept_bytes`).
- Logits: the last stage keeps T x V (V / Tp under loss_parallel) logits in compute dtype plus
  an fp32 copy, log-softmax's fp32 output (kept for backward) and its fp32 gradient, for one
  micro-batch.
- Embedding gradient: under tp > 1 the backward of the vocabulary-sharded embedding makes the
  whole (V, D) gradient in compute dtype and an fp32 copy on every tp rank before keeping its
  shard (DTensor's rule for the embedding's backward; seen by PyTorch's memory tracker). It
  counts with the activations, or on a rank that holds the logits too as the logits' figure
  when larger (the loss's backward is over before the embedding's begins).
- MoE dispatch: under ep > 1, the send and receive buffers of one layer's all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.llama import LlamaConfig
from . import dualpipev
from .layout import Layout
from .shards import Unit, gathered_numel, local_numel, stage_specs, stage_specs_ends, stage_summary

__all__ = ["COMPONENTS", "USABLE_FRACTION", "TrainShape", "memory", "param_bytes", "peak_memory"]

COMPONENTS = ("params", "grads", "optimizer", "fsdp_buffers", "activations", "logits", "moe_dispatch")
USABLE_FRACTION = 0.9  # of HBM: the rest for the CUDA context, NCCL buffers, allocator fragmentation
_PARAM_BYTES, _GRAD_BYTES, _OPT_BYTES = 4, 4, 8


@dataclass(frozen=True, kw_only=True)
class TrainShape:
    seq_len: int  # S
    global_batch_tokens: int  # tokens per optimizer step, all data-parallel ranks together

    def __post_init__(self) -> None:
        for name in ("seq_len", "global_batch_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.global_batch_tokens % self.seq_len:
            raise ValueError(
                f"global_batch_tokens={self.global_batch_tokens} must be a multiple of seq_len={self.seq_len}"
            )

    def microbatches(self, lay: Layout) -> int:
        """M: micro-batches per data-parallel rank and step; raises if the batch does not split."""
        seqs = self.global_batch_tokens // self.seq_len
        per_mb = lay.dp * lay.micro_batch
        if seqs % per_mb:
            raise ValueError(
                f"the global batch of {seqs} sequences does not split into micro-batches of "
                f"{lay.micro_batch} over dp={lay.dp} ranks"
            )
        return seqs // per_mb


def _act_bytes(lay: Layout) -> int:
    return 4 if lay.precision == "fp32" else 2


def layer_activation_elems(cfg: LlamaConfig, lay: Layout, i: int, tokens: int) -> int:
    """Elements layer ``i`` keeps for backward for one micro-batch of ``tokens`` (per tp rank)."""
    D, t = cfg.dim, lay.tp
    dkv = cfg.n_kv_heads * cfg.head_dim
    attn = tokens * (D // t + D + (D + 2 * dkv) // t + D // t)
    if not cfg.is_moe_layer(i):
        return attn + tokens * (D // t + D + 4 * cfg.ffn_hidden_dim // t)
    m = cfg.moe
    rows = _routed_rows(cfg, tokens)
    fe = m.hidden_dim // t if lay.etp else m.hidden_dim
    shared = m.num_shared_experts * (m.shared_hidden_dim or m.hidden_dim)
    return attn + tokens * (D // t + D + 4 * shared) + rows * (2 * D + 4 * fe)


def fp32_kept_bytes(cfg: LlamaConfig, lay: Layout, tokens: int) -> int:
    """Bytes a real block keeps beyond the ideal one of `layer_activation_elems`, per tp rank:
    the fp32 input copy and reciprocal norm of its two RMSNorms (on the sequence shard) and the
    attention's fp32 log-sum-exp of each local head."""
    return tokens * (2 * (4 * cfg.dim // lay.tp + 4) + 4 * cfg.n_heads // lay.tp)


def _routed_rows(cfg: LlamaConfig, tokens: int) -> int:
    """Expert rows of one MoE layer on one rank: K copies of each token it routes (balanced),
    times the capacity factor when one caps the experts."""
    m = cfg.moe
    rows = tokens * m.top_k
    return int(rows * m.capacity_factor) if m.capacity_factor else rows


def live_chunks(lay: Layout, p: int, m: int) -> int:
    """Micro-batch x stage chunks whose activations pipeline rank ``p`` holds at its peak."""
    P, V = lay.pp, lay.vpp
    if P == 1:
        return 1
    if lay.schedule == "gpipe":
        return m
    if lay.schedule == "1f1b":
        return min(m, P - p)
    if lay.schedule == "dualpipev":  # 2P + 1 on every rank, from the schedule's own order
        return dualpipev.live_chunks(P, m, p)
    return min(m * V, (V - 1) * P + 2 * (P - 1 - p) + 1)


def param_bytes(cfg: LlamaConfig, lay: Layout, rank: int) -> int:
    """Bytes of the fp32 parameter shards the global ``rank`` holds."""
    c = lay.coords(rank)
    total = 0
    for stage in lay.stages_of(c["pp"]):
        total += sum(local_numel(s, lay, c) for s in stage_specs(cfg, lay, stage))
    return _PARAM_BYTES * total


def memory(cfg: LlamaConfig, lay: Layout, shape: TrainShape, rank: int, cache: dict | None = None) -> dict[str, int]:
    """{component: bytes} on the global ``rank`` (`COMPONENTS`), plus "total". ``cache``: see
    `stage_summary`."""
    cache = {} if cache is None else cache
    c = lay.coords(rank)
    p, M = c["pp"], shape.microbatches(lay)
    tokens = lay.micro_batch * shape.seq_len
    if lay.tp > 1 and shape.seq_len % lay.tp:
        raise ValueError(f"seq_len={shape.seq_len} must be divisible by tp={lay.tp} (sequence parallelism)")
    a = _act_bytes(lay)
    stages = lay.stages_of(p)
    sums = [stage_summary(cfg, lay, s, c, cache) for s in stages]
    local = sum(x.local for x in sums)
    gathered = sum(x.gathered for x in sums)
    block_max = max(x.block_max for x in sums)
    out = dict.fromkeys(COMPONENTS, 0)
    out["params"], out["grads"], out["optimizer"] = _PARAM_BYTES * local, _GRAD_BYTES * local, _OPT_BYTES * local
    if gathered:
        ends = [x for st in stages for x in stage_specs_ends(cfg, lay, st)]
        root = sum(gathered_numel(x, lay, c) for x in ends)
        early = sum(gathered_numel(x, lay, c) for x in ends if x.name != "tok_embeddings.weight")
        if lay.pp > 1:
            units = [u for x in sums for _, _, us in x.units for u in us] + [Unit(root)]
            out["fsdp_buffers"] = gathered * (a + _GRAD_BYTES) + max(_no_sync_extra(u, a) for u in units)
        elif not lay.reshard:  # every block stays gathered from its forward to its backward
            out["fsdp_buffers"] = (gathered + early) * a + block_max * _GRAD_BYTES
        else:
            out["fsdp_buffers"] = max(fsdp_backward_peak(x.units, root, a, early) for x in sums)
    if ("act",) not in cache:
        cache[("act",)] = {kind: layer_activation_elems(cfg, lay, i, tokens) for kind, i in _kinds(cfg)}
    act = cache[("act",)]
    per_stage = [x.dense_layers * act.get("dense", 0) + x.moe_layers * act.get("moe", 0) for x in sums]
    chunks = live_chunks(lay, p, M)
    extra = fp32_kept_bytes(cfg, lay, tokens)
    if lay.recompute:
        kept = sum(tokens * cfg.dim // lay.tp * (x.dense_layers + x.moe_layers) for x in sums) / len(stages)
        worst = max(act[kind] for kind in ("dense", "moe") if any(getattr(x, f"{kind}_layers") for x in sums))
        out["activations"] = int(a * (chunks * kept + worst) + extra)
    else:
        layers = sum(x.dense_layers + x.moe_layers for x in sums) / len(stages)
        out["activations"] = int(chunks * (a * sum(per_stage) / len(stages) + layers * extra))
    if lay.num_stages - 1 in stages:
        vocab = -(-cfg.vocab_size // lay.tp) if lay.loss_parallel else cfg.vocab_size
        out["logits"] = tokens * vocab * (a + 4 + 4 + 4)
    if 0 in stages and lay.tp > 1:  # DTensor's backward of the vocabulary-sharded embedding
        emb = cfg.vocab_size * cfg.dim * (a + 4)  # makes the whole (V, D) gradient
        if out["logits"]:  # the loss's backward is over before the embedding's begins
            out["logits"] = max(out["logits"], emb)
        else:
            out["activations"] += emb
    if lay.ep > 1 and any(x.moe_layers for x in sums):
        out["moe_dispatch"] = 2 * _routed_rows(cfg, tokens) * cfg.dim * a
    out["total"] = sum(out[k] for k in COMPONENTS)
    return out


def _no_sync_extra(u: Unit, a: int) -> int:
    """Bytes beyond a pipeline stage's gathered parameters and fp32 gradients (FSDP2 accumulates
    them unsharded in the reduce dtype while gradient sync is off) that unit ``u`` adds at its
    moment: its compute-dtype gradient before it is accumulated, or at its reduce-scatter copy-in
    (after the stage's backward, ``u`` resharded) its fp32 input, and for parameters sharded on a
    dim other than 0 the largest fp32 original beside its dim-0 copy."""
    made = u.numel * a if a < _GRAD_BYTES else 0
    return max(made, (_GRAD_BYTES - a) * u.numel + _GRAD_BYTES * u.d_max)


def fsdp_backward_peak(units: tuple, root: int, a: int, early: int = 0) -> int:
    """FSDP2's peak bytes in the backward of a stage resharding after forward (the forward holds
    less: no gradients), the largest of three moments of each unit u, with ``root`` the root
    module's gathered elements (held throughout), ``early`` those of its parameters whose
    gradient is made before the blocks' backward and kept, in compute dtype, until the root's
    post-backward (the final norm and the output projection), ``a`` the compute dtype's bytes,
    and ``units`` `StageSummary.units`. The backward runs the blocks last to first; an
    expert-parallel MoE block's outer unit (attention, norms, router) is gathered first and
    reduced last, its experts in between (without ep or etp the block is one unit).

    - u's gather: its all-gather output and the unsharded parameters copied out of it, and for
      parameters sharded on a dim other than 0 a third copy (the dim-0 chunks concatenated back);
    - u's post-backward begins: u gathered, its gradient in compute dtype as autograd made it, the
      block before's outer unit prefetched, and the reduce-scatter input (fp32) of the unit reduced
      before u (FSDP2 keeps one in flight until the next post-backward);
    - u's reduce-scatter copy-in: u resharded and that earlier input freed, u's gradient in compute
      dtype and its fp32 reduce-scatter input, and for parameters sharded on another dim their
      dim-0 copies in compute dtype, one original (the largest) not freed yet.

    The enclosing outer unit stays gathered during the experts' moments. Which kinds of block
    neighbour which is not known from counts, so each moment takes the largest neighbour."""
    kinds = {kind: (n, us) for kind, n, us in units}
    near = [(x, y) for x in kinds for y in kinds if x != y or kinds[x][0] > 1]  # block x runs just before y
    outer = {kind: us[0].numel for kind, (_, us) in kinds.items()}  # prefetched first, reduced last
    best = 2 * root * a + _GRAD_BYTES * max(outer.values(), default=0)  # the root's post-backward
    best = max(best, root * a + root * _GRAD_BYTES)  # the root's copy-in
    for kind, (_, us) in kinds.items():
        before = max((outer[x] for x, y in near if y == kind), default=0)  # prefetched during this block
        after = max((outer[y] for x, y in near if x == kind), default=0)  # reduced just before this block
        for j, u in enumerate(us):
            held = root + early + (us[0].numel if j else 0)  # the root, and the outer unit around the experts
            prev = us[1].numel if len(us) == 2 and not j else after  # the input still in flight
            gather = a * (held + 2 * u.numel + u.d_numel) + _GRAD_BYTES * prev
            post = a * (held + 2 * u.numel + before) + _GRAD_BYTES * prev
            copy_in = a * (held + u.numel + u.d_max + before) + _GRAD_BYTES * u.numel
            best = max(best, gather, post, copy_in)
    return best


def _kinds(cfg: LlamaConfig) -> list[tuple[str, int]]:
    """A representative layer index of each kind present: ("dense", i), ("moe", j)."""
    out = {}
    for i in range(cfg.n_layers):
        out.setdefault("moe" if cfg.is_moe_layer(i) else "dense", i)
    return list(out.items())


def peak_memory(
    cfg: LlamaConfig, lay: Layout, shape: TrainShape, cache: dict | None = None
) -> tuple[int, dict[str, int]]:
    """The rank that needs the most memory and its components. Within a pipeline rank, the
    rank at coordinate 0 of every other dimension holds the largest piece of every shard
    (torch.chunk's first piece is the longest), so only those P ranks are compared."""
    best, cache = None, {} if cache is None else cache
    for p in range(lay.pp):
        rank = lay.rank(pp=p)
        mem = memory(cfg, lay, shape, rank, cache)
        if best is None or mem["total"] > best[1]["total"]:
            best = (rank, mem)
    return best
