"""`LlamaMesh`: the named mesh every parallel dimension of `parallelize_llama` lives on.

Legend: P pipeline ranks, R replicate ranks, Sh shard ranks (``dp_shard``), Ep expert ranks,
Tp tensor ranks; data-parallel ranks Dp = R * Sh.

The caller's DeviceMesh names any subset of ``pp``, ``dp_replicate``, ``dp_shard``, ``tp`` (a
missing one has size 1). Expert parallelism is folded onto the data-parallel ranks, as in
Megatron-core and torchtitan: the ``ep`` ranks see different tokens. The rule: ``ep`` divides
``dp_shard``, and the ep ranks are consecutive ``dp_shard`` ranks, so ``dp_shard`` splits into
(``dp_shard_mod_ep`` = Sh / Ep, ``ep``). The ranks holding the same experts are then the
(``dp_replicate``, ``dp_shard_mod_ep``) ones: the experts are fully sharded over those.

One DeviceMesh with all five dimensions (sizes of 1 allowed) is built from the caller's rank
layout, plus four flattened views: ``dp_shard`` (= dp_shard_mod_ep x ep), ``edp`` (=
dp_replicate x dp_shard_mod_ep: the ranks holding the same experts), ``dp`` (every
data-parallel rank: the batch is split over it) and ``dp_tp`` (dp x tp). Every TP DTensor and
every FSDP group shares this root mesh, as FSDP2's 2-D layouts require.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["DIMS", "LlamaMesh"]

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")  # the dimensions a caller's mesh may name
_WORLD_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp")


@dataclasses.dataclass(frozen=True, eq=False)
class LlamaMesh:
    """The built mesh. Make one per layout with `LlamaMesh.build` (it creates process groups,
    on every rank) and pass it to `parallelize_llama` / `pipeline_llama` any number of times."""

    world: DeviceMesh  # dims _WORLD_DIMS, plus the flattened "dp_shard", "edp", "dp", "dp_tp"
    ep: int

    @classmethod
    def build(cls, mesh: DeviceMesh, *, ep: int = 1, names: dict[str, str] | None = None) -> LlamaMesh:
        """``names`` maps our dimension names (`DIMS`) to the caller's, e.g. {"tp": "model"}."""
        if not isinstance(mesh, DeviceMesh):
            raise ValueError(f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialised: call dist.init_process_group first")
        if mesh.size() != dist.get_world_size():
            raise ValueError(
                f"the mesh must span every process: mesh {tuple(mesh.shape)} has {mesh.size()} ranks, "
                f"the world has {dist.get_world_size()}; pass the whole mesh (pipeline stages included)"
            )
        names = {d: d for d in DIMS} | dict(names or {})
        theirs = {v: k for k, v in names.items() if v is not None}
        given = mesh.mesh_dim_names
        if given is None:
            raise ValueError(f"mesh dimensions must be named, some of {DIMS}; got an unnamed mesh {tuple(mesh.shape)}")
        unknown = [n for n in given if n not in theirs]
        if unknown:
            raise ValueError(f"mesh dimension(s) {unknown} are not one of {sorted(theirs)} (ours: {DIMS})")
        if not isinstance(ep, int) or ep < 1:
            raise ValueError(f"ep must be a positive int (the expert-parallel size), got {ep!r}")
        ranks = mesh.mesh
        order = [given.index(names[d]) for d in DIMS if names[d] in given]
        ranks = ranks.permute(order)  # our order, missing dimensions added below
        sizes = {d: (mesh.size(given.index(names[d])) if names[d] in given else 1) for d in DIMS}
        if sizes["dp_shard"] % ep:
            raise ValueError(
                f"ep={ep} must divide dp_shard={sizes['dp_shard']}: expert parallelism is folded onto "
                f"the dp_shard ranks (mesh {dict(zip(given, mesh.shape, strict=True))}); "
                f"make dp_shard a multiple of ep or lower ep"
            )
        shape = (sizes["pp"], sizes["dp_replicate"], sizes["dp_shard"] // ep, ep, sizes["tp"])
        world = DeviceMesh(mesh.device_type, ranks.reshape(shape), mesh_dim_names=_WORLD_DIMS)
        world["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
        world["dp_replicate", "dp_shard_mod_ep"]._flatten("edp")
        world["dp_replicate", "dp_shard_mod_ep", "ep"]._flatten("dp")
        world["dp_replicate", "dp_shard_mod_ep", "ep", "tp"]._flatten("dp_tp")
        return cls(world=world, ep=ep)

    def size(self, dim: str) -> int:
        return self.world[dim].size()

    @property
    def tp(self) -> int:
        return self.size("tp")

    @property
    def pp(self) -> int:
        return self.size("pp")

    @property
    def dp_size(self) -> int:
        return self.size("dp")

    @property
    def dp_rank(self) -> int:
        return self.world["dp"].get_local_rank()

    @property
    def device(self) -> torch.device:
        return torch.device(self.world.device_type)

    def local_batch(self, batch: Tensor) -> Tensor:
        """This rank's rows of the global batch (B, ...) -> (B / Dp, ...): data-parallel rank d
        takes the d-th of Dp equal blocks; pipeline and tensor ranks take the same rows."""
        if batch.shape[0] % self.dp_size:
            raise ValueError(f"the batch size {batch.shape[0]} must be divisible by the {self.dp_size} dp ranks")
        return batch.chunk(self.dp_size)[self.dp_rank]

    def mean_over_dp(self, value: Tensor) -> Tensor:
        """The mean of a per-rank value over the data-parallel ranks (e.g. the reported loss)."""
        out = value.detach().clone()
        group = self.world["dp"].get_group()
        dist.all_reduce(out, group=group)
        if dist.get_backend(group) == "gloo":
            _released_by_gloo(out)
        return out / self.dp_size

    def describe(self) -> dict[str, int]:
        return {d: self.size(d) for d in _WORLD_DIMS}


def _released_by_gloo(t: Tensor, timeout_s: float = 1.0) -> None:
    """Wait, up to ``timeout_s``, until gloo's worker thread has dropped its reference to ``t``.

    The worker lets go of a collective's tensors a moment after the caller's wait returns. If
    the caller's Python object of the tensor is gone by then (a reported loss, read with
    ``.item()``) the worker must take the GIL to free it, and if the interpreter is already
    shutting down (this was the script's last collective) the process aborts with "terminate
    called without an active exception" after its work is done. Holding ``t`` until the worker
    has let go makes the worker's release GIL-free. The sleeps release the GIL; the last one
    gives the workers of the other groups (FSDP's last reduce-scatter, say), which may still be
    waiting for the GIL to free their own tensors, a moment to take it.
    """
    deadline = time.monotonic() + timeout_s
    while t._use_count() > 1 and time.monotonic() < deadline:
        time.sleep(1e-4)
    time.sleep(1e-3)
