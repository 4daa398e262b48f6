"""`parallelize_llama`: tensor, sequence, fully-sharded and expert parallelism for a `Llama`.

Legend: B batch, S sequence, D model dim, V vocabulary, Tp tensor ranks, Dp data ranks.

Applied from outside, in torchtitan's order: TP + SP (one DTensor `parallelize_module` plan per
block, written as data in `block_plan`), EP through `parallelize_moe`, activation checkpointing,
`torch.compile`, then FSDP2 per block. The mesh is a `LlamaMesh` (see `moe.parallel.layout` for
the dimensions and the rule that folds ``ep`` onto ``dp_shard``).

Between blocks the residual stream is this rank's sequence shard, a plain (B, S/Tp, D) tensor.
An MoE feed-forward under TP takes one of two paths (docs/training.md):
- replicated (default): its input is gathered to the whole (B, S, D) of the tp group, every tp
  rank routes and computes the same tokens (the routing group is the one of one process) and
  keeps its sequence shard of the output. Its gradients agree over tp: nothing to reduce there.
- ``etp=True``: the experts' hidden dim is sharded over tp (`parallelize_moe`'s etp path: the
  sequence shards are gathered, routed together, and the partial outputs reduce-scattered).
  The router and shared experts then get partial gradients on each tp rank; their FSDP group
  spans dp x tp and sums over it, dividing by Dp only.
Expert weights (DTensors over ep, and tp under etp) are sharded by FSDP2 over the ranks that
hold the same experts; their gradients already hold the whole ep group's tokens, so FSDP divides
them by Dp, not by its own group size. No `reduce_gradients` call is needed afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..layer import MoE, aux_loss
from ..routing import TopKRouter
from .expert_parallel import parallelize_moe
from .layout import LlamaMesh

__all__ = [
    "LlamaParallel",
    "block_plan",
    "llama_loss",
    "loss_context",
    "model_plan",
    "parallelize_llama",
    "router_loss",
]


@dataclasses.dataclass(frozen=True)
class LlamaParallel:
    """What `parallelize_llama` did, kept on the model as ``model.parallel_layout``."""

    mesh: LlamaMesh
    etp: bool
    loss_parallel: bool


def block_plan(block: nn.Module, *, etp: bool = False) -> dict:
    """The TP + SP plan of one `TransformerBlock`, by submodule name."""
    plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }
    if not isinstance(block.feed_forward, MoE):
        plan |= {
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        }
    elif etp:  # the layer takes its sequence shard as a plain tensor and gathers it itself
        plan["feed_forward"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
    else:  # the whole sequence in, the same on every tp rank; each keeps its shard of the output
        plan["feed_forward"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=True,
        )
    return plan


def model_plan(model: nn.Module, *, loss_parallel: bool = False) -> dict:
    """The plan of the parts outside the blocks (those a pipeline stage still has)."""
    plan = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


def _moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]


def _check(model: nn.Module, lm: LlamaMesh, etp: bool, loss_parallel: bool) -> None:
    """The layout checks that need the model; the same on every rank for the same arguments."""
    cfg, tp, ep = model.config, lm.tp, lm.ep
    if cfg.n_heads % tp or cfg.n_kv_heads % tp:
        raise ValueError(
            f"tp={tp} must divide n_heads={cfg.n_heads} and n_kv_heads={cfg.n_kv_heads} "
            f"(attention heads are sharded over tp); choose tp among the common divisors"
        )
    if (etp or loss_parallel) and tp == 1:
        raise ValueError(
            f"etp / loss_parallel shard over tp, but the mesh has tp=1 (etp={etp}, loss_parallel={loss_parallel})"
        )
    for name, layer in _moe_layers(model):
        if layer.config.num_experts % ep:
            raise ValueError(f"ep={ep} must divide num_experts={layer.config.num_experts} (layer {name!r})")
        if etp and layer.config.hidden_dim % tp:
            raise ValueError(
                f"etp: tp={tp} must divide the expert hidden_dim={layer.config.hidden_dim} (layer {name!r})"
            )
        if layer.config.fused and (ep > 1 or etp):
            raise ValueError(f"layer {name!r}: MoEConfig.fused is single-device only; set fused=False for ep/etp")


def check_agreement(what: str, mine: dict, group=None) -> None:
    """Raise on every rank of ``group`` (default: all) if any of them was given other ``mine``."""
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    for rank, theirs in enumerate(gathered):
        if theirs != mine:
            diff = {k: (mine[k], theirs.get(k)) for k in mine if mine[k] != theirs.get(k)}
            rank = dist.get_global_rank(group, rank) if group is not None else rank
            raise ValueError(f"ranks disagree in {what}: rank {rank} differs, (here, there): {diff}")


class _SumOverGroup:
    """Sum a tensor over a process group (the loads that move a top-k router's bias)."""

    def __init__(self, group) -> None:
        self.group = group

    def __call__(self, t: Tensor) -> Tensor:
        t = t.clone()
        dist.all_reduce(t, group=self.group)
        return t


# selective checkpointing keeps these ops' outputs (the matmuls and attention: the costly ones
# to recompute) and re-runs the rest (norms, activations, elementwise), as torchtitan's op policy
_SAVED_OPS = {
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}  # fmt: skip


def _keep_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(module: nn.Module, selective: bool = False) -> None:
    """Re-run ``module``'s forward in backward instead of keeping its activations (all of them,
    or with ``selective`` all but the matmul and attention outputs)."""
    forward = module.forward
    extra = {"context_fn": functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)} if selective else {}

    @functools.wraps(forward)
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    module.forward = run


def checkpoint_and_compile(model: nn.Module, *, activation_checkpoint: bool | str = False, compile=False, tp: int = 1):
    """Activation checkpointing (True / "full": every block re-runs its forward in backward;
    "selective": keeping the matmul and attention outputs) and torch.compile (True or
    torch.compile's options) of each block of ``model``, in place; what `parallelize_llama`
    applies, usable in one process."""
    if activation_checkpoint not in (False, True, "full", "selective"):
        raise ValueError(
            f"activation_checkpoint must be False, True, 'full' or 'selective', got {activation_checkpoint!r}"
        )
    for block in model.layers.values():
        if activation_checkpoint:
            _checkpointed(block, selective=activation_checkpoint == "selective")
        if compile:
            options = {"fullgraph": True} if compile is True else dict(compile)
            _compile_block(block, options, checkpointed=bool(activation_checkpoint), tp=tp)
    return model


def _compile_block(block: nn.Module, options: dict, *, checkpointed: bool, tp: int) -> None:
    """torch.compile a block in place (its parameter names stay). A dense block, and an MoE
    block whose layer runs on this rank alone, compile whole (the layer traces without a graph
    break: tests/test_layer_compile.py). An MoE block compiles only its attention and norms,
    leaving the MoE layer eager, when
    - its layer is expert-parallel (``layer.parallel`` set): the dispatch sizes its all-to-all
      from counts read on the host and its agreement collectives branch on what they read;
    - its top-k bias update sums loads over the data-parallel ranks (a collective in the forward);
    - tp > 1: the layer's tensor-parallel input and output steps are not tested traced;
    - it is activation-checkpointed: the layer's python side effects (its pending loss, the
      top-k bias update) cannot sit inside a traced checkpoint, and eager, the layer sees the
      re-run in backward and skips them there."""
    ff = block.feed_forward
    summed = getattr(ff, "router", None) is not None and getattr(ff.router, "sum_over_ranks", None) is not None
    summed = summed and ff.router.config.bias_update_rate > 0
    if isinstance(ff, MoE) and (ff.parallel is not None or summed or tp > 1 or checkpointed):
        for part in (block.attention_norm, block.attention, block.ffn_norm):
            part.compile(**options)
    else:
        block.compile(**options)


def _check_seq_len(tp: int):
    def hook(module, args):
        tokens = args[0]
        if tokens.shape[1] % tp:
            raise ValueError(
                f"the sequence length {tokens.shape[1]} must be divisible by tp={tp} (sequence parallelism "
                f"shards it over the tp ranks); pad or crop the batch"
            )

    return hook


def _shard_sum(module: nn.Module, mesh, divide_by: int, **kw) -> None:
    """FSDP over ``mesh`` whose reduction sums, then divides by ``divide_by`` (not the mesh size)."""
    fully_shard(module, mesh=mesh, **kw)
    module.set_gradient_divide_factor(float(divide_by))
    if mesh.size() > 1:  # a plain SUM then a division: gloo has no PREMUL_SUM
        # (not on one rank: there torch 2.13 would divide twice, once in its copy, once after)
        module.set_force_sum_reduction_for_comms(True)


def _expert_placement(experts: nn.Module, size: int, kw: dict) -> dict:
    """FSDP2's keywords for a unit holding ``experts``, sharded over ``size`` ranks. FSDP2
    shards dim 0, the unit's experts, when they split evenly over the ranks; otherwise (e.g. one
    expert per ep rank held by 16 ranks, or 8 experts over 128) every rank would keep a padded
    whole expert and the all-gather would make ``size`` copies of it, so the model dim D is
    sharded instead (w1, w3 (E, D, F): dim 1; w2 (E, F, D): dim 2), which tp never shards, when
    it splits evenly (FSDP2 pads only dim 0). Other parameters keep dim 0."""
    local = experts.w1.to_local() if isinstance(experts.w1, DTensor) else experts.w1
    if not local.shape[0] % size or local.shape[1] % size:
        return kw
    d_dim = {id(experts.w1): 1, id(experts.w2): 2} | ({id(experts.w3): 1} if experts.w3 is not None else {})
    return dict(kw, shard_placement_fn=lambda p: Shard(d_dim.get(id(p), 0)))


def _shard_experts(experts: nn.Module, lm: LlamaMesh, **kw) -> None:
    """Fully shard expert weights over the ranks holding the same experts (``edp``, possibly
    one rank: FSDP2 then only casts for mixed precision and divides). Their gradient sums the
    whole ep group's tokens, so it is divided by Dp. Which dim: `_expert_placement`."""
    edp = lm.world["edp"]
    _shard_sum(experts, edp, lm.dp_size, **_expert_placement(experts, edp.size(), kw))


def parallelize_llama(
    model: nn.Module,
    mesh,
    *,
    ep: int = 1,
    etp: bool = False,
    loss_parallel: bool = False,
    activation_checkpoint: bool = False,
    compile: bool | dict = False,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    static_splits: bool = False,
    global_base: bool | str = False,
    dispatch: str = "flat",
    ranks_per_node: int | None = None,
    chunks: int = 1,
    names: dict[str, str] | None = None,
) -> nn.Module:
    """Lay ``model`` (a `Llama`, or a pipeline stage of one) out over ``mesh``; returns ``model``.

    Args:
        mesh: a DeviceMesh naming any of ``pp``, ``dp_replicate``, ``dp_shard``, ``tp`` (our
            names; ``names`` maps them to yours), or a `LlamaMesh` built from one.
        ep: expert-parallel size, folded onto ``dp_shard`` (it must divide it).
        etp: shard each expert's hidden dim over ``tp`` instead of replicating the layer there.
        loss_parallel: the output projection keeps its vocabulary shards: logits are a
            (B, S, V/Tp) DTensor, for `llama_loss` (which computes the loss under
            `torch.distributed.tensor.parallel.loss_parallel`).
        activation_checkpoint: re-run each block's forward in backward.
        compile: torch.compile each block (True: ``fullgraph=True``; a dict: torch.compile's
            options); an MoE block compiles whole on one rank's experts; expert-parallel,
            tensor-parallel or checkpointed, its MoE layer stays eager (see `_compile_block`).
        mp_policy: FSDP2's `MixedPrecisionPolicy` (e.g. bf16 params, fp32 reductions on GPU).
        static_splits, global_base, dispatch, ranks_per_node, chunks: passed to `parallelize_moe`
            (``dispatch="hierarchical"``: the two-level dispatcher over the ep group's nodes;
            ``chunks=C``: the exchange in C chunks overlapping the experts).

    Every rank calls this with the same model (built from the same seed: the parameters are
    sharded from the values each rank holds) and options; a disagreement, or a layout that does
    not fit, raises ValueError on every rank. The trainer then feeds each rank
    ``mesh.local_batch(tokens)`` and uses `llama_loss` (cross entropy + the router losses).
    """
    lm = mesh if isinstance(mesh, LlamaMesh) else LlamaMesh.build(mesh, ep=ep, names=names)
    if lm.ep != ep and ep != 1:
        raise ValueError(f"ep={ep} disagrees with the LlamaMesh given, built for ep={lm.ep}")
    options = dict(
        mesh=lm.describe(), etp=etp, loss_parallel=loss_parallel, ac=activation_checkpoint, compile=compile,
        mp=repr(mp_policy), static_splits=static_splits, global_base=global_base, dispatch=dispatch,
        ranks_per_node=ranks_per_node, chunks=chunks,
    )  # fmt: skip
    mine = {"config": repr(model.config), "layers": sorted(model.layers.keys()), "options": options}
    check_agreement("parallelize_llama", mine, lm.world["dp_tp"].get_group())  # the ranks of this stage
    _check(model, lm, etp, loss_parallel)
    if mp_policy is not None and lm.dp_size == 1:
        raise ValueError("mp_policy is applied by FSDP2, which needs data-parallel ranks; the mesh has dp=1")
    world, tp = lm.world, lm.tp
    if tp > 1:
        for block in model.layers.values():
            parallelize_module(block, world["tp"], block_plan(block, etp=etp))
        parallelize_module(model, world["tp"], model_plan(model, loss_parallel=loss_parallel))
        if model.tok_embeddings is not None:
            model.register_forward_pre_hook(_check_seq_len(tp))
    moe_layers = _moe_layers(model)
    if moe_layers and (lm.ep > 1 or etp):
        moe_mesh = world["ep", "tp"] if etp else world["ep"]
        parallelize_moe(
            model, moe_mesh, ep="ep", etp="tp" if etp else None, static_splits=static_splits,
            global_base=global_base, dispatch=dispatch, ranks_per_node=ranks_per_node, chunks=chunks,
        )  # fmt: skip
    if lm.dp_size > 1:
        for _, layer in moe_layers:
            if isinstance(layer.router, TopKRouter):  # one bias on every rank: loads of all dp ranks
                layer.router.sum_over_ranks = _SumOverGroup(world["dp"].get_group())
    checkpoint_and_compile(model, activation_checkpoint=activation_checkpoint, compile=compile, tp=tp)
    kw = dict(mp_policy=mp_policy or MixedPrecisionPolicy(), reshard_after_forward=reshard_after_forward)
    for block in model.layers.values():
        ff = block.feed_forward
        if isinstance(ff, MoE) and ff.parallel is not None:
            _shard_experts(ff.experts, lm, **kw)
            ff.parallel.compute_dtype = kw["mp_policy"].param_dtype
        if isinstance(ff, MoE) and etp:
            for part in (ff.router, ff.shared):
                if part is not None and any(p.requires_grad for p in part.parameters()):
                    _shard_sum(part, world["dp_tp"], lm.dp_size, **kw)
        if lm.dp_size > 1:  # the experts of a layer on one rank's experts are in the block's unit
            local = isinstance(ff, MoE) and ff.parallel is None
            own = _expert_placement(ff.experts, world["dp_shard"].size(), kw) if local else kw
            fully_shard(block, mesh=world["dp_replicate", "dp_shard"], **own)
    if lm.dp_size > 1:
        fully_shard(model, mesh=world["dp_replicate", "dp_shard"], **kw)
    model.parallel_layout = LlamaParallel(mesh=lm, etp=etp, loss_parallel=loss_parallel)
    return model


def router_loss(model: nn.Module) -> Tensor:
    """`moe.aux_loss` of a model laid out by `parallelize_llama`: the router losses since the
    last call, to add to this rank's loss. Under etp each tp rank reports 1/Tp of its group's
    router losses (so their gradients sum once); the value returned is the whole group's, with
    the gradient of that share."""
    loss = aux_loss(model)
    layout = getattr(model, "parallel_layout", None)
    if layout is not None and layout.etp:
        loss = loss + (layout.mesh.tp - 1) * loss.detach()
    return loss


def llama_loss(model: nn.Module, logits_BSV: Tensor, targets_BS: Tensor) -> Tensor:
    """This rank's training loss: mean cross entropy over its tokens + `router_loss(model)`.
    The target of the whole step is the mean of this over the data-parallel ranks (FSDP2
    averages the gradients): equal token counts per rank make it the global token mean."""
    flat, labels = logits_BSV.flatten(0, 1), targets_BS.flatten()
    if isinstance(logits_BSV, DTensor):  # loss_parallel: vocabulary-sharded logits
        with loss_context(model):  # entered already when the caller runs the backward in it
            ce = F.cross_entropy(flat, labels)
        ce = ce.full_tensor() if isinstance(ce, DTensor) else ce
    else:
        ce = F.cross_entropy(flat.float(), labels)
    return ce + router_loss(model)


_loss_parallel_depth = 0  # loss_context() blocks entered: loss_parallel() must not be nested (its exit disarms it)


@contextlib.contextmanager
def loss_context(model: nn.Module):
    """The context the loss and its backward must run in: `loss_parallel` when the model was
    laid out with ``loss_parallel=True`` (its vocabulary-sharded cross entropy needs it in the
    backward too), else a no-op."""
    global _loss_parallel_depth
    layout = getattr(model, "parallel_layout", None)
    if layout is None or not layout.loss_parallel or _loss_parallel_depth:
        yield
        return
    _loss_parallel_depth += 1
    try:
        with loss_parallel():
            yield
    finally:
        _loss_parallel_depth -= 1
