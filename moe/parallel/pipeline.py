"""`pipeline_llama`: cut a `Llama` into pipeline stages on the mesh's ``pp`` dimension, lay
each stage out with `parallelize_llama`, and drive them with a `torch.distributed.pipelining`
schedule (GPipe, 1F1B, interleaved 1F1B with virtual stages, or DualPipeV, whose paired steps
run one micro-batch's forward and another's backward layer by layer: `moe.parallel.paired`).

Legend: P pipeline ranks, V stages per rank (virtual stages), N = P * V stages, M micro-batches,
L layers.

Stages are balanced by layer count: stage s takes the s-th of N contiguous runs of layers
(the first L mod N runs one longer); the embedding goes with the first stage, the final norm
and output projection with the last. Interleaved 1F1B puts stages r, r + P, ... on rank r;
DualPipeV puts stages r and 2P - 1 - r on rank r (a V: rank P - 1 holds the middle two).

The router losses of a stage's MoE layers reach the gradient exactly once per micro-batch:
`_AttachLoss` returns the stage's output unchanged and, in backward, hands the stage's router
loss the gradient 1 alongside the output's gradient (Megatron-core's aux-loss scaler does the
same). The schedule divides every gradient by M afterwards, so the step's objective is

    (1/M) * sum over micro-batches m of (CE_m + sum over all stages' MoE layers of router_loss_m),

each term over micro-batch m's tokens, then the mean over the data-parallel ranks: the same
at any P, V and schedule. The reported loss (`LlamaPipeline.step`) is that value.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.pipelining.schedules import OVERLAP_F_B

from .layout import LlamaMesh
from .llama import check_agreement, parallelize_llama, router_loss
from .paired import DualPipeVFullBackward, PairedForwardBackward

__all__ = ["SCHEDULES", "LlamaPipeline", "pipeline_llama", "stage_layers"]

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "dualpipev": DualPipeVFullBackward,
}
MULTI_STAGE = ("interleaved_1f1b", "dualpipev")  # the schedules that take V >= 2 stages per rank


def stage_layers(layer_names: list[str], num_stages: int) -> list[list[str]]:
    """The layers of each stage: contiguous runs, balanced by count (earlier runs one longer)."""
    if num_stages > len(layer_names):
        raise ValueError(
            f"the model has {len(layer_names)} layers, fewer than the {num_stages} pipeline stages "
            f"(pp x stages_per_rank); lower pp or stages_per_rank"
        )
    size, extra = divmod(len(layer_names), num_stages)
    out, start = [], 0
    for s in range(num_stages):
        end = start + size + (s < extra)
        out.append(layer_names[start:end])
        start = end
    return out


class _AttachLoss(torch.autograd.Function):
    """``out`` unchanged; in backward ``loss`` gets the gradient 1 (its weight in the
    micro-batch's objective, before the schedule's 1/M)."""

    @staticmethod
    def forward(ctx, out: Tensor, loss: Tensor) -> Tensor:
        ctx.loss_dtype, ctx.loss_device = loss.dtype, loss.device
        # a new tensor on out's storage, not out itself: an input returned as it came is made a
        # view of it, and a stage's output must not be one (the zero-bubble backward input
        # pass of DualPipeV detaches the stage's outputs in place)
        return out.detach()

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        return grad_out, torch.ones((), dtype=ctx.loss_dtype, device=ctx.loss_device)


@dataclasses.dataclass(eq=False)
class LlamaPipeline:
    """This rank's stage modules, and the stages and schedule that drive them (built at the
    first `step`, when the batch shape is known; later batches must have the same shape)."""

    mesh: LlamaMesh
    models: list[nn.Module]  # this rank's stage modules, in stage order (give them to the optimizer)
    stages: list[PipelineStage]  # built at the first step
    schedule: object  # likewise
    microbatches: int
    schedule_kind: str = "1f1b"
    indices: list[int] = dataclasses.field(default_factory=list)  # this rank's stage indices
    num_stages: int = 1
    dtype: torch.dtype = torch.float32  # of the activations between stages
    router_losses: list[Tensor] = dataclasses.field(default_factory=list)  # this step's, detached
    shape: tuple | None = None  # (B, S) of the batch the stages were built for
    lm_loss: Tensor | None = None  # the last step's cross entropy and router losses, as `step` reports them
    aux_loss: Tensor | None = None
    paired: PairedForwardBackward | None = None  # DualPipeV's paired forward and backward

    def _build(self, tokens_BS: Tensor) -> None:
        """Make the stages for this batch shape, their inputs and outputs given so the schedule
        never runs a stage on made-up inputs to learn them."""
        b, s = tokens_BS.shape
        mb, s_local, cfg = b // self.microbatches, s // self.mesh.tp, self.models[0].config
        dev = self.mesh.device
        h = torch.empty(mb, s_local, cfg.dim, dtype=self.dtype, device=dev, requires_grad=True)
        for index, part in zip(self.indices, self.models, strict=True):
            first, last = index == 0, index == self.num_stages - 1
            inputs = torch.empty(mb, s, dtype=tokens_BS.dtype, device=dev) if first else h
            outputs = torch.empty(mb, s, cfg.vocab_size, dtype=self.dtype, device=dev) if last else h
            group = self.mesh.world["pp"].get_group()
            self.stages.append(
                PipelineStage(part, index, self.num_stages, dev, input_args=inputs, output_args=outputs, group=group)
            )
        kind = SCHEDULES[self.schedule_kind]
        multi = self.schedule_kind in MULTI_STAGE
        self.schedule = kind(self.stages if multi else self.stages[0], self.microbatches, loss_fn=_cross_entropy)
        if self.schedule_kind == "dualpipev":
            self.paired = PairedForwardBackward(self.stages, dev)
            for part in self.models:
                self.paired.attach(part, _turn_point)
            self.schedule.register_custom_function(OVERLAP_F_B, self.paired)
        self.shape = (b, s)

    @property
    def has_first(self) -> bool:
        return 0 in self.indices

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.indices

    def parameters(self):
        return itertools.chain.from_iterable(m.parameters() for m in self.models)

    def named_parameters(self):
        return itertools.chain.from_iterable(m.named_parameters() for m in self.models)

    def step(self, tokens_BS: Tensor, targets_BS: Tensor, *, documents: Tensor | None = None) -> Tensor:
        """Forward and backward of this rank's batch (``mesh.local_batch`` of the global one) in M
        micro-batches; returns the reported loss (the objective above, meaned over the
        data-parallel ranks), the same on every rank. The optimizer steps afterwards.
        ``documents`` (B, S), given on every rank: `Llama.forward`'s document masking, each
        micro-batch's rows to each stage."""
        if tokens_BS.shape[0] % self.microbatches:
            raise ValueError(
                f"the batch size {tokens_BS.shape[0]} must be divisible by microbatches={self.microbatches}"
            )
        if tokens_BS.dim() != 2 or tokens_BS.shape != targets_BS.shape:
            raise ValueError(
                f"tokens and targets must both be (B, S), got {tuple(tokens_BS.shape)}, {tuple(targets_BS.shape)}"
            )
        if self.shape is None:
            self._build(tokens_BS)
        elif tuple(tokens_BS.shape) != self.shape:
            raise ValueError(f"the stages were built for batches of {self.shape}, got {tuple(tokens_BS.shape)}")
        self.router_losses.clear()
        losses: list[Tensor] = []
        self._run(self.schedule.step, tokens_BS, targets_BS, documents, losses)
        # [cross entropy, router losses]: the last stage has the first, every stage some of the second
        parts = torch.zeros(2, dtype=torch.float32, device=self.mesh.device)
        for t in losses:
            parts[0] += t.detach().float()
        for t in self.router_losses:
            parts[1] += t.detach().float()
        parts /= self.microbatches
        dist.all_reduce(parts, group=self.mesh.world["pp"].get_group())
        parts = self.mesh.mean_over_dp(parts)
        self.lm_loss, self.aux_loss = parts[0], parts[1]
        return parts.sum()

    def _run(self, run, tokens_BS: Tensor, targets_BS: Tensor, documents: Tensor | None, losses: list) -> None:
        """``schedule.step`` or ``schedule.eval`` with what this rank's stages take: the tokens on
        the first, the targets on the last, the documents (a keyword, split into micro-batches
        like the tokens) on all."""
        kwargs = {} if documents is None else {"documents": documents}
        if self.has_first:
            run(tokens_BS, target=targets_BS if self.has_last else None, losses=losses, **kwargs)
        elif self.has_last:
            run(target=targets_BS, losses=losses, **kwargs)
        else:
            run(**kwargs)

    @torch.no_grad()
    def evaluate(self, tokens_BS: Tensor, targets_BS: Tensor, *, documents: Tensor | None = None) -> Tensor:
        """The mean cross entropy of this rank's batch (forward only, in M micro-batches of the
        step's shape), meaned over the data-parallel ranks; the same on every rank. The stage
        modules should be in eval mode; the router losses of these forwards are discarded."""
        if self.shape is None:
            self._build(tokens_BS)
        if tuple(tokens_BS.shape) != self.shape or tokens_BS.shape != targets_BS.shape:
            raise ValueError(
                f"the stages were built for batches of {self.shape}, got {tuple(tokens_BS.shape)} "
                f"and targets {tuple(targets_BS.shape)}"
            )
        losses: list[Tensor] = []
        self._run(self.schedule.eval, tokens_BS, targets_BS, documents, losses)
        self.router_losses.clear()
        ce = torch.zeros((), dtype=torch.float32, device=self.mesh.device)
        for t in losses:
            ce += t.detach().float()
        ce /= self.microbatches
        dist.all_reduce(ce, group=self.mesh.world["pp"].get_group())
        return self.mesh.mean_over_dp(ce)


def _cross_entropy(logits_BSV: Tensor, targets_BS: Tensor) -> Tensor:
    return F.cross_entropy(logits_BSV.flatten(0, 1).float(), targets_BS.flatten())


def pipeline_llama(
    model: nn.Module,
    mesh,
    *,
    schedule: str = "1f1b",
    microbatches: int,
    stages_per_rank: int | None = None,
    ep: int = 1,
    names: dict[str, str] | None = None,
    **options,
) -> LlamaPipeline:
    """Cut ``model`` (the whole `Llama`, the same on every rank) into this rank's stages, lay
    each out with `parallelize_llama(stage, mesh, **options)` and build the schedule.

    Args:
        schedule: "gpipe", "1f1b", "interleaved_1f1b" or "dualpipev".
        microbatches: M, per data-parallel rank and step.
        stages_per_rank: V; 1 by default, 2 for "interleaved_1f1b" (which needs V >= 2) and
            "dualpipev" (which takes exactly 2).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    if options.get("loss_parallel"):
        raise ValueError("loss_parallel is not supported with pipeline stages; the last stage gathers the logits")
    multi = schedule in MULTI_STAGE
    virtual = stages_per_rank if stages_per_rank is not None else (2 if multi else 1)
    if (virtual >= 2) != multi or (schedule == "dualpipev" and virtual != 2):
        raise ValueError(
            f"stages_per_rank={virtual}: interleaved_1f1b needs >= 2, dualpipev takes 2, gpipe and 1f1b take 1"
        )
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive int, got {microbatches!r}")
    lm = mesh if isinstance(mesh, LlamaMesh) else LlamaMesh.build(mesh, ep=ep, names=names)
    agreed = dict(config=repr(model.config), schedule=schedule, microbatches=microbatches, virtual=virtual)
    check_agreement("pipeline_llama", agreed | {"options": repr(sorted(options.items()))})
    pp, rank = lm.pp, lm.world["pp"].get_local_rank()
    if schedule == "interleaved_1f1b" and microbatches % pp:
        raise ValueError(f"interleaved_1f1b needs microbatches ({microbatches}) divisible by pp ({pp})")
    if schedule == "dualpipev" and microbatches < 2 * pp:
        raise ValueError(f"dualpipev needs microbatches ({microbatches}) >= its 2 x pp = {2 * pp} stages")
    runs = stage_layers(list(model.layers.keys()), pp * virtual)
    mine = [rank, 2 * pp - 1 - rank] if schedule == "dualpipev" else [rank + v * pp for v in range(virtual)]
    mp = options.get("mp_policy")
    dtype = mp.param_dtype if mp is not None and mp.param_dtype is not None else next(model.parameters()).dtype
    pipe = LlamaPipeline(
        mesh=lm, models=[], stages=[], schedule=None, microbatches=microbatches, schedule_kind=schedule,
        indices=mine, num_stages=len(runs), dtype=dtype,
    )  # fmt: skip
    for index in mine:
        part = copy.deepcopy(model) if index != mine[-1] else model  # the last one reuses the model
        for name in list(part.layers.keys()):
            if name not in runs[index]:
                del part.layers[name]
        if index != 0:
            part.tok_embeddings = None
        if index != len(runs) - 1:
            part.norm = part.output = None
        part.register_forward_hook(_attach_router_loss(pipe))
        parallelize_llama(part, lm, ep=lm.ep, **options)
        pipe.models.append(part)
    return pipe


def _turn_point(module: nn.Module) -> bool:
    """Where DualPipeV's paired forward and backward take turns: at each decoder layer and at
    each MoE layer inside it (its dispatch is where the all-to-all starts)."""
    from ..layer import MoE
    from ..models.llama.model import TransformerBlock

    return isinstance(module, (TransformerBlock, MoE))


def _attach_router_loss(pipe: LlamaPipeline):
    def hook(module: nn.Module, args, out: Tensor) -> Tensor:
        loss = router_loss(module)
        pipe.router_losses.append(loss.detach())
        return _AttachLoss.apply(out, loss) if loss.requires_grad else out

    return hook
