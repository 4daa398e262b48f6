"""The layout of a ``moe train`` run: process group, `LlamaMesh`, `parallelize_llama` or
`pipeline_llama`, and the global gradient norm over parameters that live on different meshes.

Legend: W world size, P pipeline ranks, Dp data-parallel ranks, Tp tensor ranks, Ep expert ranks.

One process (W = 1) needs none of this: the model stays a plain `Llama`. Under torchrun (or
``--nproc``, which starts torchrun's agent) every rank builds the same model from the seed and
`parallelize_llama` shards it, following the trainer contract of docs/training.md. With P > 1,
`pipeline_llama` cuts it into stages first; a `StageView` then shows this rank's stages under
the whole model's parameter names, so optimiser state and checkpoints are keyed as in one process.
"""

from __future__ import annotations

import datetime
import os
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from .config import default_microbatches
from .ranks import record_rank
from .runlock import HELD_ENV, RunFolderError, acquire

__all__ = ["PP_SCHEDULES", "Layout", "StageView", "clip_grad_norm", "parallelize", "setup"]

# the command's names for the pipeline schedules -> moe.parallel.pipeline's
PP_SCHEDULES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved_1f1b", "dualpipev": "dualpipev"}
PP_SCHEDULES["interleaved_1f1b"] = PP_SCHEDULES["interleaved"]  # the name moe plan prints

# LlamaMesh slices its flattened views from the root mesh on purpose; said once per rank and
# slice, it would bury the progress bar
warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh", category=UserWarning)


class Layout:
    """What the loop needs to know about the ranks: who writes, which rows it reads, how a
    per-rank value becomes the global one."""

    def __init__(self, mesh=None, pipe=None) -> None:
        self.mesh = mesh  # a LlamaMesh, or None in one process
        self.pipe = pipe  # a LlamaPipeline (this rank's stages and their schedule) when P > 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    @property
    def pp_group(self):
        """The pipeline ranks of this rank (None without stages): their parameters are disjoint."""
        return self.mesh.world["pp"].get_group() if self.pipe is not None else None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def rows(self, batch: int) -> slice:
        """This rank's rows of a global batch of ``batch`` sequences: the d-th of Dp equal blocks,
        the rows `LlamaMesh.local_batch` takes (pipeline and tensor ranks read the same), so
        that a rank reads only its own windows of the data."""
        if self.mesh is None:
            return slice(0, batch)
        dp = self.mesh.dp_size
        if batch % dp:
            raise ValueError(f"the batch size {batch} must be divisible by the {dp} dp ranks")
        n = batch // dp
        return slice(self.mesh.dp_rank * n, (self.mesh.dp_rank + 1) * n)

    def mean_over_dp(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach() if self.mesh is None else self.mesh.mean_over_dp(t)

    def sum_counts(self, t: torch.Tensor) -> torch.Tensor:
        """Per-rank routing counts -> the whole step's: summed over every rank (the data-parallel
        and expert ranks saw different tokens, the pipeline ranks hold different layers), then
        divided by Tp, whose ranks route the same tokens (each reports them once)."""
        if self.mesh is None:
            return t
        out = t.clone()
        dist.all_reduce(out)
        return out // self.mesh.tp

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()


class StageView(nn.Module):
    """This rank's pipeline stage modules under the whole model's names (``tok_embeddings``,
    ``layers.<i>``, ``norm``, ``output``: a stage keeps its layers' keys), for the optimiser,
    the checkpoints and the balance stats. It shares the stages' modules and has no forward:
    the schedule runs the stages."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.config = parts[0].config
        self.layers = nn.ModuleDict()
        for part in parts:
            for name, layer in part.layers.items():
                self.layers[name] = layer
            for attr in ("tok_embeddings", "norm", "output"):
                if getattr(part, attr) is not None:
                    setattr(self, attr, getattr(part, attr))


def setup(cfg) -> tuple[torch.device, Layout | None]:
    """Join the process group when launched by torchrun (WORLD_SIZE set); returns the device and,
    for one process, a `Layout` without a mesh (the mesh comes with `parallelize`)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu"), Layout()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.collective_timeout))
    record_rank()
    if os.environ.get(HELD_ENV) is None:  # plain torchrun: rank 0 locks the run folder for the job
        _lock_on_rank0(cfg)
    dist.barrier()  # every rank has checked its arguments before any writes the run folder
    return device, None


def _lock_on_rank0(cfg) -> None:
    """Rank 0 takes the run folder's lock; every rank raises `RunFolderError` when it could not."""
    from pathlib import Path

    outcome = [None]
    if dist.get_rank() == 0:
        try:
            acquire(Path(cfg.out), fresh=not cfg.resume)
        except RunFolderError as err:
            outcome[0] = str(err)
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise RunFolderError(outcome[0])


def parallelize(model: nn.Module, cfg, device: torch.device) -> tuple[nn.Module, Layout]:
    """Lay ``model`` out as ``cfg`` says (``cfg.dp_shard`` already resolved by the command)."""
    from torch.distributed.device_mesh import init_device_mesh

    from ..parallel import LlamaMesh, parallelize_llama, pipeline_llama

    shape = (cfg.pp, cfg.dp_replicate, cfg.dp_shard, cfg.tp)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
    lm = LlamaMesh.build(mesh, ep=cfg.ep)
    moe = model.config.moe
    # BASE balances over the whole ep group, as one process balances over the whole batch
    # (--base-balance rank: each rank's tokens alone)
    global_base = cfg.ep > 1 and moe is not None and moe.router == "base" and cfg.base_balance == "group"
    blocks = dict(activation_checkpoint=False if cfg.ac == "none" else cfg.ac, dispatch=cfg.dispatch,
                  ranks_per_node=cfg.ranks_per_node, compile=cfg.compile, chunks=cfg.ep_chunks,
                  reshard_after_forward=bool(cfg.reshard))  # fmt: skip
    if cfg.pp == 1:
        model = parallelize_llama(model, lm, ep=cfg.ep, etp=cfg.etp, global_base=global_base, **blocks)
        return model, Layout(lm)
    micro = cfg.micro_batches or default_microbatches(cfg.pp, cfg.pp_schedule)
    pipe = pipeline_llama(
        model, lm, schedule=PP_SCHEDULES[cfg.pp_schedule], microbatches=micro,
        ep=cfg.ep, etp=cfg.etp, global_base=global_base, **blocks,
    )  # fmt: skip
    return StageView(pipe.models), Layout(lm, pipe)


def _unpartial(g: DTensor) -> DTensor:
    if any(p.is_partial() for p in g.placements):
        g = g.redistribute(placements=[Replicate() if p.is_partial() else p for p in g.placements])
    return g


@torch.no_grad()
def clip_grad_norm(params, max_norm: float, pp_group=None) -> float:
    """`torch.nn.utils.clip_grad_norm_` (2-norm) for gradients that are DTensors on different
    meshes (experts over edp x ep, the rest over dp, tp shards): each gradient's local squared
    sum is summed over the mesh dimensions that shard it (never over the replicating ones), so
    every element counts once, then over all gradients, then over ``pp_group`` (the pipeline
    ranks: each holds other stages' parameters). Every rank gets the same norm."""
    grads = [p.grad for p in params if p.grad is not None]
    sums: dict[tuple, torch.Tensor] = {}  # (mesh dims, sharded dims) -> local squared sum
    meshes: dict[tuple, object] = {}
    plain = None
    for g in grads:
        if isinstance(g, DTensor):
            g = _unpartial(g)
            dims = tuple(i for i, p in enumerate(g.placements) if p.is_shard())
            key = (g.device_mesh.mesh_dim_names, tuple(g.device_mesh.shape), dims)
            local = g.to_local().double().square().sum()
            sums[key] = sums[key] + local if key in sums else local
            meshes[key] = g.device_mesh
        else:
            local = g.double().square().sum()
            plain = local if plain is None else plain + local
    total = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else "cpu")
    if plain is not None:
        total = total + plain
    for key in sorted(sums, key=repr):  # the same order on every rank
        s = sums[key]
        for i in key[2]:
            dist.all_reduce(s, group=meshes[key].get_group(i))
        total = total + s
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    norm = float(total.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm
