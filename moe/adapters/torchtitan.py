"""torchtitan: `moe.MoE` as the feed-forward of torchtitan's Llama (llama3 module), under its
own trainer, TP/SP, FSDP2/HSDP and pipeline parallelism, plus expert parallelism.

Needs the ``torchtitan`` extra: ``pip install 'moe[torchtitan]'`` (tested with torchtitan 0.3.0,
torch 2.13, ``--parallelism.spmd_backend partial_dtensor``).

Legend: B batch, L sequence, D model dim, El experts on this rank.

What each parallel dimension does to the MoE layers (docs/adapters.md):
- FSDP2 / HSDP (dp_shard, dp_replicate): the router and the experts are sharded like any
  other parameter of their block (torchtitan's ``apply_fsdp_to_decoder``); each rank routes its
  own tokens.
- TP with or without SP: the block's input is a DTensor on the tp mesh. The layer gathers the
  sequence (Megatron's "gather from the sequence-parallel region"), every tp rank routes all
  tokens with replicated weights, and the output is handed back in the input's placement
  (a local slice under SP). Gradients of replicated compute are already whole on every tp rank.
- EP (``--parallelism.expert_parallel_degree``, over data-parallel ranks, tp = 1): the experts
  become ``Shard(0)`` DTensors on torchtitan's ``ep`` mesh, our dispatcher moves the rows
  (all-to-all), and FSDP shards them further over ``efsdp`` as torchtitan does for its own MoE.
- PP: nothing to do; each stage's MoE layers carry their router losses to the loss (below).
- Global BASE (``moe_model_spec(..., global_base=True)``): BASE layers solve their assignment
  over the tokens of every data-parallel rank (torchtitan's "loss" mesh), as one process does
  over the whole batch (tested under FSDP2 and EP).

Router losses: the aux and z losses are attached to the layer's output by `_AttachLoss`
(Megatron's aux-loss scaler): the forward value is unchanged and the backward adds
``aux_loss_scale`` times the losses' gradient, so they reach the training loss on every
pipeline stage without the trainer knowing about them. The scale is set so that it matches
torchtitan's loss normalisation (its losses are sums divided by the global token count and
summed over ranks): 1 / (data-parallel ranks * microbatches * gradient-accumulation steps).
Under activation checkpointing (full or selective) the re-run in the backward attaches the
same losses again (`moe.aux_loss` called during a backward returns the re-run's), so the
graphs match and the losses count once.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ..config import MoEConfig
from ..layer import MoE, aux_loss
from ..parallel import FlatDispatcher, GroupBalance
from ..routing import BaseRouter, TopKRouter

try:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.llama3 import Llama3Model, model_registry, parallelize_llama
    from torchtitan.protocols.model_spec import ModelSpec
    from torchtitan.protocols.module import Module
except ImportError as err:  # optional dependency: say how to get it
    raise ImportError("moe.adapters.torchtitan needs torchtitan: pip install 'moe[torchtitan]'") from err

__all__ = [
    "Llama3MoEModel",
    "MoEFeedForward",
    "llama3_moe_debugmodel",
    "moe_model_spec",
    "parallelize_llama_moe",
    "pipeline_llama_moe",
]


class _AttachLoss(torch.autograd.Function):
    """Identity on ``y``; in backward, the scalar ``loss`` gets gradient ``scale`` (the
    layer's router losses join the training loss without passing through it)."""

    @staticmethod
    def forward(ctx, y: Tensor, loss: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        shape, dtype, device = ctx.loss_meta
        return grad_y, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


class MoEFeedForward(Module):
    """torchtitan Module around `moe.MoE`: ``forward(x_BLD) -> (B, L, D)``, the feed-forward slot
    of a transformer block. Its Config holds the `MoEConfig`; parameters are initialised by
    torchtitan's init path (``init_states`` -> `MoE.reset_parameters`)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        moe: MoEConfig

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.moe = MoE(config.moe)
        self.aux_loss_scale = 1.0  # set by `parallelize_llama_moe` from the trainer's batch layout
        self.balance: _GlobalBalance | None = None  # global BASE without EP: its status collective

    def _init_self_parameters(self) -> None:
        router = self.moe.router
        if isinstance(router, BaseRouter) and isinstance(router.weight, DTensor):
            _reset_whole(router)  # BASE's orthogonal init needs the whole matrix (a QR), not a shard
            for module in (self.moe.experts, self.moe.shared):
                if module is not None:
                    module.reset_parameters()
        else:
            self.moe.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        if isinstance(x, DTensor):  # tensor parallel: gather the sequence, hand it back after
            full = [Replicate()] * x.device_mesh.ndim
            y = self._local(x.redistribute(placements=full).to_local())
            return DTensor.from_local(y, x.device_mesh, full, run_check=False).redistribute(placements=x.placements)
        return self._local(x)

    def _local(self, x_BLD: Tensor) -> Tensor:
        seq_len = x_BLD.shape[1] if x_BLD.dim() == 3 else None
        replicated = {
            name: t.to_local()  # the tp ranks compute the same thing: their gradients are already whole
            for name, t in [*self.moe.named_parameters(), *self.moe.named_buffers()]
            if isinstance(t, DTensor) and all(p.is_replicate() for p in t.placements)
        }
        if self.balance is not None and self.moe.training:
            self.balance.start()
        try:
            if replicated:
                y = torch.func.functional_call(self.moe, replicated, (x_BLD,), {"seq_len": seq_len}, strict=False)
            else:
                y = self.moe(x_BLD, seq_len=seq_len)
        except ValueError as err:
            if self.balance is None:
                raise
            self.balance.relay(err)  # the other ranks wait in the global solve's header: they raise too
        loss = aux_loss(self.moe)  # this call's router losses (zero without coefficients)
        if loss.requires_grad and torch.is_grad_enabled():
            y = _AttachLoss.apply(y, loss, self.aux_loss_scale)
        return y


@torch.no_grad()
def _reset_whole(module: nn.Module) -> None:
    """``module.reset_parameters()`` on whole plain tensors, then each DTensor parameter takes its
    shard of the first rank's values (so every rank holds the same matrix, as one process)."""
    params = {n: p for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
    for name, p in params.items():
        setattr(module, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device)))
    try:
        module.reset_parameters()
        whole = {name: getattr(module, name).detach() for name in params}
    finally:
        for name, p in params.items():
            setattr(module, name, p)
    for name, p in params.items():
        p.to_local().copy_(distribute_tensor(whole[name], p.device_mesh, p.placements).to_local())


class Llama3MoEModel(Llama3Model):
    """torchtitan's Llama3 with `MoEFeedForward` in every ``moe_every``-th block, counted from
    ``moe_first``; the other blocks keep their dense feed-forward. ``moe.dim`` must be the model
    dim. The swap happens when the model is built, after torchtitan has filled in the dense
    configs' sharding, so the dense blocks keep theirs."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Llama3Model.Config):
        moe: MoEConfig | None = None
        moe_every: int = 1
        moe_first: int = 0

        def moe_layers(self) -> list[int]:
            """Indices of the blocks whose feed-forward is an `MoEFeedForward`."""
            if self.moe is None:
                return []
            first, every = self.moe_first, self.moe_every
            return [i for i in range(len(self.layers)) if i >= first and (i - first) % every == 0]

    def __init__(self, config: Config) -> None:
        _check_moe_config(config)
        layers = list(config.layers)
        for i in config.moe_layers():
            layers[i] = dataclasses.replace(layers[i], feed_forward=MoEFeedForward.Config(moe=config.moe))
        super().__init__(dataclasses.replace(config, layers=layers))

    def verify_module_protocol(self) -> None:
        """torchtitan's check that every submodule is one of its Modules, skipping the insides
        of our layers (plain nn.Modules that `MoEFeedForward` initialises itself)."""
        inner = {id(m) for ff in self.modules() if isinstance(ff, MoEFeedForward) for m in ff.moe.modules()}
        bad = [
            f"'{n}' ({type(m).__name__})"
            for n, m in self.named_modules()
            if not isinstance(m, Module) and id(m) not in inner
        ]
        if bad:
            raise RuntimeError(f"The following modules do not satisfy the Module protocol: {', '.join(bad)}")


def _check_moe_config(config: Llama3MoEModel.Config) -> None:
    if config.moe is None:
        return
    if not isinstance(config.moe, MoEConfig):
        raise ValueError(f"moe must be a moe.MoEConfig, got {type(config.moe).__name__}")
    if config.moe.dim != config.dim:
        raise ValueError(f"moe.dim must equal the model dim {config.dim}, got {config.moe.dim}")
    if config.moe_every < 1 or config.moe_first < 0:
        raise ValueError(
            f"moe_every must be >= 1 and moe_first >= 0, got moe_every={config.moe_every}, moe_first={config.moe_first}"
        )
    if not config.moe_layers():
        raise ValueError(f"no block gets an MoE: moe_first={config.moe_first} with {len(config.layers)} layers")


def _attach_expert_parallel(layer: MoE, ep_mesh) -> None:
    """`moe.parallel.parallelize_moe`'s expert sharding, for a model still on the meta device
    (torchtitan parallelises before it allocates, so there is nothing to broadcast yet)."""
    size = ep_mesh.size()
    if layer.config.num_experts % size:
        raise ValueError(f"num_experts={layer.config.num_experts} must be divisible by the ep degree, {size}")
    ex = layer.experts
    for name in ("w1", "w3", "w2"):
        w = getattr(ex, name)
        if w is not None:
            setattr(ex, name, nn.Parameter(distribute_tensor(w.detach(), ep_mesh, [Shard(0)]), w.requires_grad))
    dim_name = ep_mesh.mesh_dim_names[0]
    layer.dispatcher = FlatDispatcher(ep_mesh, layer.config.num_experts, ep=dim_name)
    if isinstance(layer.router, TopKRouter):
        group = ep_mesh.get_group()
        layer.router.sum_over_ranks = lambda t: _summed(t, group)  # the bias moves alike everywhere


class _GlobalBalance:
    """The one status collective of a global-BASE forward when the layer has no expert
    parallelism (so no `moe.parallel.Agreement`): `GroupBalance`'s first. A rank that fails
    before it (bad input, NaN logits) runs it with a failure notice, so every rank raises."""

    def __init__(self, balance: GroupBalance, device: torch.device) -> None:
        self.balance, self.device = balance, device
        self.ahead = False

    def start(self) -> None:
        self.ahead = True

    def passed(self, stage: str) -> None:  # told by GroupBalance when its exchange has run
        self.ahead = False

    def relay(self, err: Exception):
        if self.ahead:
            self.ahead = False
            self.balance.fail(self.device)
        raise err


def _balance_globally(ff: MoEFeedForward, mesh, method: str = "prices") -> None:
    """BASE over every data-parallel rank's tokens: `moe.parallel.GroupBalance` on ``mesh``'s
    group (torchtitan's "loss" mesh: the ranks that hold different tokens), so the assignment is
    the one a single process makes over the whole batch. Under EP its first collective is one of
    the dispatcher's status collectives; without EP `_GlobalBalance` carries failures."""
    layer, group = ff.moe, mesh.get_group()
    balance = layer.router.assign = GroupBalance.around(layer.router, group, method)
    if layer.parallel is not None:
        balance.agreement = layer.parallel.agreement
    else:
        ff.balance = balance.agreement = _GlobalBalance(balance, torch.device(mesh.device_type))


def _replicate_on(module: nn.Module, mesh) -> None:
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            setattr(sub, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()]), p.requires_grad))
        for name, b in list(sub.named_buffers(recurse=False)):
            keep = name not in sub._non_persistent_buffers_set
            sub.register_buffer(name, distribute_tensor(b, mesh, [Replicate()]), persistent=keep)


def _summed(t: Tensor, group) -> Tensor:
    t = t.clone()
    torch.distributed.all_reduce(t, group=group)
    return t


def parallelize_llama_moe(
    model: nn.Module, *, parallel_dims, training, parallelism, global_base: bool | str = False, **kwargs
) -> nn.Module:
    """torchtitan's ``parallelize_llama`` (TP/SP, activation checkpointing, compile, FSDP2)
    with the MoE layers' expert parallelism and aux-loss scale set first. Same signature, plus
    ``global_base``: BASE layers balance over all data-parallel ranks' tokens (as one process
    over the whole batch) instead of each rank's own; `moe_model_spec` passes it."""
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    if layers and parallel_dims.ep_enabled and parallel_dims.tp_enabled:
        # torchtitan's ep mesh takes its ranks from the tp ranks too, which here all route the same tokens
        raise NotImplementedError(
            "expert parallelism with our MoE runs over data-parallel ranks only (tensor_parallel_degree=1); got "
            f"tensor_parallel_degree={parallel_dims.tp} with expert_parallel_degree={parallel_dims.ep}"
        )
    if global_base:
        others = sorted({m.moe.config.router for m in layers if not isinstance(m.moe.router, BaseRouter)})
        if others:
            raise ValueError(f"global_base=True needs BASE routers in every MoE layer, got router={others}")
    dp = parallel_dims.dp_replicate * parallel_dims.dp_shard * parallel_dims.cp
    micro = 1
    if parallel_dims.pp_enabled:
        micro = training.local_batch_size // parallelism.pipeline_parallel_microbatch_size
    accum = 1
    if training.global_batch_size > 0:
        accum = max(1, training.global_batch_size // (training.local_batch_size * dp))
    for m in layers:
        m.aux_loss_scale = 1.0 / (dp * micro * accum)
    if parallel_dims.tp_enabled and layers:
        # Replicated on the tp mesh like torchtitan's norms, so FSDP2, gradient clipping and
        # checkpoints see every parameter on the same (dp, tp) meshes as the rest of the model.
        tp_mesh = parallel_dims.get_mesh("tp")
        for m in layers:
            _replicate_on(m.moe, tp_mesh)
    if parallel_dims.ep_enabled and layers:
        ep_mesh, efsdp_mesh = parallel_dims.get_mesh("ep"), parallel_dims.get_mesh("efsdp")
        policy = MixedPrecisionPolicy(
            param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
            cast_forward_inputs=False,
        )
        for m in layers:
            _attach_expert_parallel(m.moe, ep_mesh)
            fully_shard(m.moe.experts, mesh=efsdp_mesh, mp_policy=policy)
    loss_mesh = parallel_dims.get_optional_mesh("loss")  # None with one data-parallel rank
    if global_base and loss_mesh is not None:
        for m in layers:
            _balance_globally(m, loss_mesh, "gather" if global_base == "gather" else "prices")
    return parallelize_llama(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism, **kwargs)


def pipeline_llama_moe(model: nn.Module, **kwargs):
    """torchtitan's ``pipeline_llm`` (same signature and result), with one change: torch's
    pipeline stages learn their shapes by running a forward on tensors made from metadata,
    which are uninitialised memory. Our routers reject non-finite input (they raise instead of
    routing NaN), so those tensors are zero-filled."""
    schedule, parts, has_first, has_last = pipeline_llm(model, **kwargs)
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    for stage in stages:
        if stage is not None and hasattr(stage, "_to_tensor"):
            stage._to_tensor = _zero_filled(stage._to_tensor)
    return schedule, parts, has_first, has_last


def _zero_filled(to_tensor):
    def zero_filled(arg):
        t = to_tensor(arg)
        if not isinstance(arg, Tensor):  # made from metadata: uninitialised
            with torch.no_grad():
                t.zero_()
        return t

    return zero_filled


def moe_model_spec(
    spec: ModelSpec, moe: MoEConfig, *, every: int = 1, first: int = 0, global_base: bool | str = False
) -> ModelSpec:
    """A torchtitan llama3 ``ModelSpec`` with `MoEFeedForward` in every ``every``-th block from
    ``first``, parallelised by `parallelize_llama_moe`; the rest of the spec is unchanged.
    ``global_base`` (BASE routers only): balance over all data-parallel ranks' tokens."""
    if not isinstance(spec.model, Llama3Model.Config):
        raise ValueError(f"spec must be a torchtitan llama3 ModelSpec, got a {type(spec.model).__name__}")
    if global_base and moe.router != "base":
        raise ValueError(f"global_base=True needs moe.router='base', got {moe.router!r}")
    base = {f.name: getattr(spec.model, f.name) for f in dataclasses.fields(Llama3Model.Config)}
    model = Llama3MoEModel.Config(**base, moe=moe, moe_every=every, moe_first=first)
    _check_moe_config(model)
    return dataclasses.replace(
        spec,
        name=f"{spec.name}_moe",
        model=model,
        parallelize_fn=functools.partial(parallelize_llama_moe, global_base=global_base)
        if global_base
        else parallelize_llama_moe,
        pipelining_fn=pipeline_llama_moe,
        state_dict_adapter=None,  # the HF Llama conversion knows no MoE weights
    )


def llama3_moe_debugmodel():
    """``--module moe.adapters.torchtitan --config llama3_moe_debugmodel``: torchtitan's llama3
    debug config with an 8-expert top-2 MoE in every other block."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    dim = config.model_spec.model.dim
    moe = MoEConfig(dim=dim, hidden_dim=dim, num_experts=8, top_k=2, aux_loss_coef=0.01)
    config.model_spec = moe_model_spec(model_registry("debugmodel"), moe, every=2, first=1)
    return config
