"""Megatron-core: our `moe.MoE` in the MLP slot of its GPT layer spec, and weight conversion
between Megatron's ``MoELayer`` state dict and ours.

Needs the ``megatron`` extra: ``pip install 'moe[megatron]'`` (tested with megatron-core 0.16.1,
torch 2.13, CPU; see docs/adapters.md for what runs where).

Legend: s sequence, b batch, h = D model dim, E experts, F expert hidden dim, tp tensor-parallel size.

Weight layouts (E experts, D model dim, F expert hidden dim; gated linear units put the gate
first: ``fc1(x) = [x @ w1 | x @ w3]``, Megatron's ``glu`` chunks it in that order):

    router.weight                               (E, D)      <-> router.weight (E, D)
    SequentialMLP  experts.local_experts.{e}.linear_fc1.weight  (2F, D)  <-> w1[e].T, w3[e].T
                   experts.local_experts.{e}.linear_fc2.weight  (D, F)   <-> w2[e].T
    GroupedMLP     experts.weight1  (D, E*2F), used as weight1.view(E, D, 2F)  <-> [w1 | w3]
                   experts.weight2  (E*F, D),  used as weight2.view(E, F, D)   <-> w2
    TEGroupedMLP   experts.linear_fc1.weight{e}  (2F, D)     <-> w1[e].T, w3[e].T
                   experts.linear_fc2.weight{e}  (D, F)      <-> w2[e].T

Megatron's top-k router (softmax scores, ``moe_router_pre_softmax=False``) is our "topk" router
with softmax scores renormalised over the chosen experts.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ..config import MoEConfig
from ..layer import MoE, aux_loss
from ..parallel import parallelize_moe

try:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.spec_utils import ModuleSpec
except ImportError as err:  # optional dependency: say how to get it
    raise ImportError("moe.adapters.megatron needs megatron-core: pip install 'moe[megatron]'") from err

__all__ = [
    "LAYOUTS",
    "MegatronMoE",
    "from_megatron_state_dict",
    "moe_config_from_megatron",
    "moe_module_spec",
    "to_megatron_state_dict",
]

LAYOUTS = ("sequential", "grouped", "te_grouped")


def moe_config_from_megatron(config, **overrides) -> MoEConfig:
    """The `MoEConfig` of a Megatron ``TransformerConfig``'s MoE (softmax top-k, SwiGLU experts
    when ``gated_linear_unit``); ``overrides`` change any field (e.g. ``router="base"``)."""
    if not config.num_moe_experts:
        raise ValueError(f"config.num_moe_experts must be set, got {config.num_moe_experts!r}")
    if config.moe_router_score_function != "softmax" or config.moe_router_pre_softmax:
        raise ValueError(
            "only Megatron's softmax top-k router without pre-softmax converts, got "
            f"moe_router_score_function={config.moe_router_score_function!r}, "
            f"moe_router_pre_softmax={config.moe_router_pre_softmax}"
        )
    fields = dict(
        dim=config.hidden_size,
        hidden_dim=config.moe_ffn_hidden_size or config.ffn_hidden_size,
        num_experts=config.num_moe_experts,
        top_k=config.moe_router_topk,
        router="topk",
        router_options={"score_func": "softmax", "renormalize": True},
        activation="swiglu" if config.gated_linear_unit else "gelu",
        aux_loss_coef=float(config.moe_aux_loss_coeff or 0.0),
        z_loss_coef=float(config.moe_z_loss_coeff or 0.0),
    )
    fields.update(overrides)
    return MoEConfig(**fields)


def _experts(layer: MoE) -> tuple[Tensor, Tensor | None, Tensor]:
    ex = layer.experts
    return ex.w1.detach(), (ex.w3.detach() if ex.w3 is not None else None), ex.w2.detach()


def to_megatron_state_dict(layer: MoE, *, layout: str = "sequential", prefix: str = "") -> dict[str, Tensor]:
    """``layer``'s weights as the state dict of Megatron's ``MoELayer`` (keys under ``prefix``,
    e.g. ``"decoder.layers.3.mlp."``). Shared experts are not converted (raises)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layer.shared is not None:
        raise ValueError("layers with shared experts do not convert (Megatron keeps them in shared_experts.*)")
    w1, w3, w2 = _experts(layer)
    fc1_EDF2 = torch.cat([w1, w3], dim=2) if w3 is not None else w1  # (E, D, 2F): gate first
    sd = {f"{prefix}router.weight": layer.router.weight.detach().clone()}
    num_experts, dim, _ = fc1_EDF2.shape
    if layout == "grouped":
        sd[f"{prefix}experts.weight1"] = fc1_EDF2.reshape(dim, -1).clone()  # the inverse of .view(E, D, 2F)
        sd[f"{prefix}experts.weight2"] = w2.reshape(-1, dim).clone()
        return sd
    for e in range(num_experts):
        if layout == "sequential":
            fc1, fc2 = f"experts.local_experts.{e}.linear_fc1.weight", f"experts.local_experts.{e}.linear_fc2.weight"
        else:
            fc1, fc2 = f"experts.linear_fc1.weight{e}", f"experts.linear_fc2.weight{e}"
        sd[prefix + fc1] = fc1_EDF2[e].T.contiguous()
        sd[prefix + fc2] = w2[e].T.contiguous()
    return sd


def _detect(keys: list[str]) -> str:
    if any(k.endswith("experts.weight1") for k in keys):
        return "grouped"
    if any(".local_experts." in k for k in keys):
        return "sequential"
    if any(re.search(r"experts\.linear_fc1\.weight\d+$", k) for k in keys):
        return "te_grouped"
    raise ValueError(f"no Megatron expert weights found among keys {sorted(keys)[:8]}...")


@torch.no_grad()
def from_megatron_state_dict(state_dict: dict[str, Tensor], config: MoEConfig, *, prefix: str = "") -> MoE:
    """An `MoE` holding the weights of a Megatron ``MoELayer`` state dict (any of `LAYOUTS`,
    detected from the keys; ``_extra_state`` entries are ignored)."""
    sd = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix) and not k.endswith("_extra_state")}
    layout = _detect(list(sd))
    num_experts, dim, f = config.num_experts, config.dim, config.hidden_dim
    gated = config.activation == "swiglu"
    width = 2 * f if gated else f
    if layout == "grouped":
        fc1_EDF2 = sd["experts.weight1"].view(num_experts, dim, width)
        w2_EFD = sd["experts.weight2"].view(num_experts, f, dim)
    else:
        names = (
            ("experts.local_experts.{}.linear_fc1.weight", "experts.local_experts.{}.linear_fc2.weight")
            if layout == "sequential"
            else ("experts.linear_fc1.weight{}", "experts.linear_fc2.weight{}")
        )
        fc1_EDF2 = torch.stack([sd[names[0].format(e)].T for e in range(num_experts)])
        w2_EFD = torch.stack([sd[names[1].format(e)].T for e in range(num_experts)])
    want = (num_experts, dim, width)
    if tuple(fc1_EDF2.shape) != want:
        raise ValueError(
            f"fc1 weights must give (E, D, {'2F' if gated else 'F'}) = {want}, got {tuple(fc1_EDF2.shape)}"
        )
    layer = MoE(config).to(fc1_EDF2.dtype)
    layer.router.weight.copy_(sd["router.weight"])
    layer.experts.w1.copy_(fc1_EDF2[..., :f])
    if gated:
        layer.experts.w3.copy_(fc1_EDF2[..., f:])
    layer.experts.w2.copy_(w2_EFD)
    return layer


class MegatronMoE(nn.Module):
    """Our `MoE` in the MLP slot of a Megatron transformer layer: ``forward(hidden_states)``
    takes [s, b, h] ([s/tp, b, h] under sequence parallelism) and returns ``(output, None)``.

    Megatron's process groups come from ``pg_collection`` when Megatron passes one (newer
    versions), else from its ``parallel_state``:

    - Expert parallelism (expert-model-parallel size > 1) and expert-tensor parallelism
      (expert-tensor-parallel size > 1; Megatron's default is the tp size) go to
      `moe.parallel.parallelize_moe` over a mesh of Megatron's expert-parallel and
      expert-tensor-parallel groups: each rank routes its own tokens, our dispatcher sends the
      rows to the ranks that own their experts, each expert's hidden dim is split over etp.
      The expert weights stay plain tensors holding this rank's shard, marked
      ``allreduce=False`` as Megatron marks its own experts, so Megatron's DDP reduces their
      gradients over the expert-data-parallel group only. This needs distinct tokens on every
      rank: tp = 1, or sequence parallelism.
    - Without them, the experts are replicated. Under sequence parallelism the tokens are
      gathered from the sequence-parallel region and the output reduce-scattered back with
      Megatron's own mappings, so the residual stream keeps Megatron's layout; every tp rank
      routes the same tokens and the reduce-scatter's sum is divided by tp to keep one copy.
    - Under sequence parallelism every parameter that is not an expert shard is marked
      ``sequence_parallel`` (as Megatron marks its router), so Megatron's
      ``finalize_model_grads`` sums its gradient over the tp ranks, which each saw a part.
    - Router losses reach the loss through Megatron's ``MoEAuxLossAutoScaler`` on the output,
      as Megatron's own MoE does (its scale is set by Megatron's schedules, also under PP).
    - ``global_base``: BASE layers balance over the whole expert-parallel group (each rank
      keeps its rows of one assignment of all the group's tokens) instead of per rank; with
      ep = 1 every rank balances the tokens it routes.
    """

    def __init__(
        self, config, moe: MoEConfig | None = None, *, global_base: bool = False, pg_collection=None, **_ignored
    ) -> None:
        super().__init__()
        self.config = config  # Megatron's TransformerConfig
        self.moe = MoE(moe if moe is not None else moe_config_from_megatron(config))
        groups = _megatron_groups(pg_collection)
        self.tp_group = groups["tp"]
        tp, ep, etp = (dist.get_world_size(groups[k]) for k in ("tp", "ep", "expt_tp"))
        self.sequence_parallel = bool(getattr(config, "sequence_parallel", False)) and tp > 1
        self.expert_parallel = ep > 1 or etp > 1
        if self.expert_parallel:
            _check_expert_layout(self.moe.config, tp, ep, etp, self.sequence_parallel)
            mesh = _expert_mesh(groups, ep, etp)
            parallelize_moe(self.moe, mesh, ep="ep", etp="etp" if etp > 1 else None, global_base=global_base)
            for name in ("w1", "w3", "w2"):  # Megatron's DDP and optimizer take plain tensors
                w = getattr(self.moe.experts, name)
                if w is not None:
                    local = nn.Parameter(w.to_local().detach().clone(), requires_grad=w.requires_grad)
                    local.allreduce = False  # Megatron's mark of an expert-parallel parameter
                    setattr(self.moe.experts, name, local)
        if self.sequence_parallel:
            for name, p in self.moe.named_parameters():
                if not (self.expert_parallel and name.startswith("experts.")):
                    p.sequence_parallel = True

    def forward(self, hidden_states: Tensor, *args, **kwargs):
        gather = self.sequence_parallel and not self.expert_parallel
        x = (
            tensor_parallel.gather_from_sequence_parallel_region(hidden_states, group=self.tp_group)
            if gather
            else hidden_states
        )
        y = self.moe(x.transpose(0, 1)).transpose(0, 1)  # routed as [b, s, h] for per-sequence routers
        loss = aux_loss(self.moe)
        if gather:  # every tp rank routed the same tokens: count their loss once over the tp sum
            loss = loss / dist.get_world_size(self.tp_group)
        if loss.requires_grad and torch.is_grad_enabled():
            y = MoEAuxLossAutoScaler.apply(y, loss)
        if gather:
            y = y / dist.get_world_size(self.tp_group)
            y = tensor_parallel.reduce_scatter_to_sequence_parallel_region(y, group=self.tp_group)
        return y.contiguous(), None


def _megatron_groups(pg_collection) -> dict:
    """Megatron's tp, ep, expert-tp and expert-tp x ep groups, from ``pg_collection`` or, when
    Megatron passes none (0.16 does not for a custom MLP), from ``parallel_state``."""
    names = ("tp", "ep", "expt_tp", "tp_ep")
    if pg_collection is not None and all(getattr(pg_collection, n, None) is not None for n in names):
        return {n: getattr(pg_collection, n) for n in names}
    if not parallel_state.model_parallel_is_initialized():
        raise ValueError(
            "MegatronMoE needs Megatron's process groups: call parallel_state.initialize_model_parallel "
            "first, or pass a pg_collection with tp, ep, expt_tp and tp_ep groups"
        )
    return {
        "tp": parallel_state.get_tensor_model_parallel_group(),
        "ep": parallel_state.get_expert_model_parallel_group(),
        "expt_tp": parallel_state.get_expert_tensor_parallel_group(),
        "tp_ep": parallel_state.get_expert_tensor_and_model_parallel_group(),
    }


def _check_expert_layout(cfg: MoEConfig, tp: int, ep: int, etp: int, sequence_parallel: bool) -> None:
    if cfg.num_experts % ep:
        raise ValueError(
            f"num_experts={cfg.num_experts} must be divisible by Megatron's expert_model_parallel_size={ep}"
        )
    if cfg.hidden_dim % etp:
        raise ValueError(
            f"the experts' hidden_dim={cfg.hidden_dim} must be divisible by Megatron's "
            f"expert_tensor_parallel_size={etp}"
        )
    if tp > 1 and not sequence_parallel:
        raise ValueError(
            f"expert_model_parallel_size={ep} / expert_tensor_parallel_size={etp} with "
            f"tensor_model_parallel_size={tp} needs sequence_parallel=True (each rank must route its own "
            "tokens, as Megatron-LM requires for MoE with tensor parallelism); or set "
            "expert_model_parallel_size=1 and expert_tensor_parallel_size=1 to replicate the experts"
        )


def _expert_mesh(groups: dict, ep: int, etp: int) -> DeviceMesh:
    """A DeviceMesh ("ep", "etp") of Megatron's expert-tensor x expert-parallel group: every rank
    tells the group its (ep, etp) coordinates, so the mesh follows Megatron's rank order."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    tp_ep = groups["tp_ep"]
    me = torch.tensor(
        [dist.get_rank(groups["ep"]), dist.get_rank(groups["expt_tp"]), dist.get_rank()], device=device_type
    )
    everyone = [torch.empty_like(me) for _ in range(dist.get_world_size(tp_ep))]
    dist.all_gather(everyone, me, group=tp_ep)
    mesh = torch.empty(ep, etp, dtype=torch.long)
    for ep_rank, etp_rank, rank in (t.tolist() for t in everyone):
        mesh[ep_rank, etp_rank] = rank
    return DeviceMesh.from_group([groups["ep"], groups["expt_tp"]], device_type, mesh, mesh_dim_names=("ep", "etp"))


def moe_module_spec(moe: MoEConfig | None = None, *, global_base: bool = False) -> ModuleSpec:
    """A ``ModuleSpec`` for the ``mlp`` of Megatron's GPT layer spec:
    ``spec.submodules.mlp = moe_module_spec(cfg)`` (``None``: the config comes from Megatron's
    ``TransformerConfig`` MoE fields, see `moe_config_from_megatron`). ``global_base``: see
    `MegatronMoE`."""
    return ModuleSpec(module=MegatronMoE, params={"moe": moe, "global_base": global_base})
