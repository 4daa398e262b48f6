"""How the ranks agree: on the configuration when `parallelize_moe` runs (`check_same_config`),
and that a forward can go on, so that a failure on one rank is an error on every rank, never a
wait until the timeout or a step run on the wrong data.

Legend: W ranks in the ep group, Wt in the etp group, E experts, T tokens on this rank.

Every forward issues the same sequence of *status collectives* on every rank, fixed by the
configuration (which `parallelize_moe` checked is the same everywhere), each able to carry a
failure notice, and in this order:

- "static" (static path, sync-free router): each rank's T and whether its input is finite, over
  ep, checked on the device, before the tokens are gathered or routed;
- "etp" (etp meshes): each etp rank's T and seq_len, over etp, before the tokens are gathered;
- "bias" (top-k with the aux-loss-free bias, training): the load all-reduce over the mesh;
- "global" (global BASE, training): over ep (or the group it balances over), the solve's header
  by prices (each rank's status in its slot), the size exchange of the gathered path;
- "counts" (counted path) or "static" (static path, host-reading router): the count exchange,
  or each rank's T, over ep, after routing and before any row moves.

A rank that cannot go on (a bad input, a router error, a notice from a peer) runs the rest of
the sequence with notices in place of its data (`Agreement.relay`) and raises; a rank that
receives a notice does the same. So every rank takes part in the same collectives, no row moves
after a notice, and the group stays usable. Inputs are checked locally before the first
collective (`input_error`), so a rank's bad input is agreed in it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from .all_to_all import all_to_all
from .dispatch import raise_if_peers_failed

__all__ = ["Agreement", "all_reduce_mesh", "check_same_config", "exchange_sizes", "input_error"]


def all_reduce_mesh(t: Tensor, mesh: DeviceMesh, op=dist.ReduceOp.SUM) -> Tensor:
    """Reduce ``t`` in place over every rank of ``mesh`` (one all-reduce per dimension)."""
    for dim in range(mesh.ndim):
        dist.all_reduce(t, op=op, group=mesh.get_group(dim))
    return t


def _difference(mine: dict, theirs: dict) -> str:
    """Where two ranks' descriptions differ, in words."""
    where = f"the MoE layers: {[n for n, *_ in mine['layers']]} here, {[n for n, *_ in theirs['layers']]} there"
    pairs = [("parallelize_moe options", mine["options"], theirs["options"])]
    if len(theirs["layers"]) == len(mine["layers"]):
        pairs += [
            (f"layer {a!r}", {**cfg, "parallelised": done}, {**other, "parallelised": other_done})
            for (a, cfg, done), (_, other, other_done) in zip(mine["layers"], theirs["layers"], strict=True)
        ]
    for what, here, there in pairs:
        diff = {k: (v, there.get(k)) for k, v in here.items() if there.get(k) != v}
        if diff:
            return f"{what}: (here, there) {diff}"
    return where


def check_same_config(layers: list, mesh: DeviceMesh, options: dict) -> None:
    """Raise ValueError on every rank if any rank of the mesh has other layers or options.

    Runs before any local check, so every rank takes part in the same collectives whatever its
    arguments: one gather per mesh dimension, then one all-reduce per dimension of a mismatch
    flag (a rank whose own groups agree still learns that a rank elsewhere in the mesh differs).
    """
    mine = {
        "options": options,
        "layers": [(name, dataclasses.asdict(layer.config), layer.parallel is not None) for name, layer in layers],
    }
    found = None
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
        for rank, theirs in enumerate(gathered):
            if found is None and theirs != mine:
                found = (
                    f"global rank {dist.get_global_rank(group, rank)} (mesh dimension "
                    f"{mesh.mesh_dim_names[dim]!r}) differs from this rank in {_difference(mine, theirs)}"
                )
    flag = torch.tensor([float(found is not None)], device=mesh.device_type)
    all_reduce_mesh(flag, mesh, dist.ReduceOp.MAX)
    if flag.item():
        raise ValueError(
            "ranks disagree on the MoE configuration: " + (found or "another rank of the mesh found a difference")
        )


def exchange_sizes(n: int, group, device: torch.device) -> list[int]:
    """Every rank's ``n`` in rank order (one small all-to-all and a host sync)."""
    world = dist.get_world_size(group)
    sizes = all_to_all(torch.full((world,), n, dtype=torch.int64, device=device), [1] * world, [1] * world, group)
    return sizes.tolist()


def input_error(x, dim: int, dtype: torch.dtype, device_type: str) -> ValueError | None:
    """What is wrong with a layer's input ``x: (..., D)`` that this rank can see alone, or None.

    Besides the shape: the rows travel to other ranks in x's dtype and on its device, so both
    must be the experts' (one device raises the dtype mismatch in the grouped GEMM)."""
    if not isinstance(x, Tensor):
        return ValueError(f"x must be a torch.Tensor of shape (..., D={dim}), got {type(x).__name__}")
    if x.dim() == 0 or x.shape[-1] != dim:
        return ValueError(f"x must have shape (..., D={dim}), got {tuple(x.shape)}")
    if x.dtype != dtype:
        return ValueError(f"x must have the experts' dtype {dtype}, got {x.dtype}")
    if x.device.type != device_type:
        return ValueError(f"x must be on the mesh's device type {device_type!r}, got {x.device}")
    return None


class Agreement:
    """The status collectives of one layer's forwards: ``start`` names those ahead, each is
    marked ``passed`` when run, ``relay`` runs the rest with failure notices."""

    def __init__(self, mesh, ep_group, etp_group, num_experts: int) -> None:
        self.mesh, self.ep_group, self.etp_group = mesh, ep_group, etp_group
        self.num_experts = num_experts
        self.device = torch.device(mesh.device_type)
        self.ahead: list[str] = []  # status collectives still to run in this forward
        # the "global" stage's `GroupBalance` (global BASE's, over the ep group or a larger one:
        # the torchtitan adapter's, over every data-parallel rank), set by the dispatcher when a
        # forward starts with that stage
        self.global_balance = None
        # values each rank sends every rank in the count exchange: the flat dispatcher's rows per
        # local expert, unless the dispatcher exchanges other counts (the two-level one's)
        self.count_width = num_experts // dist.get_world_size(ep_group)

    def start(self, stages: list[str]) -> None:
        self.ahead = list(stages)

    def passed(self, stage: str) -> None:
        if stage in self.ahead:  # a router called by itself, outside a forward, runs none
            self.ahead.remove(stage)

    def relay(self, err: Exception):
        """Run every status collective still ahead with a failure notice, then raise ``err``."""
        ahead, self.ahead = self.ahead, []
        for stage in ahead:
            if stage == "etp":
                self._etp_exchange(-1, None)
            elif stage == "bias":
                loads = torch.zeros(self.num_experts + 1, dtype=torch.float32, device=self.device)  # as the router's
                self.sum_loads(loads, failed=True)
            elif stage == "global":
                self.global_balance.fail(self.device)
            elif stage == "static":
                exchange_sizes(-1, self.ep_group, self.device)
            else:  # "counts": the dispatcher's count exchange, every count -1
                world, width = dist.get_world_size(self.ep_group), self.count_width
                poison = torch.full((world * width,), -1, dtype=torch.int64, device=self.device)
                all_to_all(poison, [width] * world, [width] * world, self.ep_group)
        raise err

    def _etp_exchange(self, n: int, seq_len: int | None) -> list[list[int]]:
        world = dist.get_world_size(self.etp_group)
        sent = torch.full((world, 2), n, dtype=torch.int64, device=self.device)
        sent[:, 1] = 0 if seq_len is None else seq_len
        got = all_to_all(sent.view(-1), [2] * world, [2] * world, self.etp_group)
        return got.view(world, 2).tolist()

    def etp_sizes(self, n: int, seq_len: int | None, *, static: bool) -> list[int]:
        """Stage "etp", host-reading: the etp ranks' token counts (the gather's sizes); every
        etp rank raises alike when one failed, breaks the static promise or has another
        seq_len (they route the same tokens)."""
        got = self._etp_exchange(n, seq_len)
        self.passed("etp")
        sizes, seq_lens = [a for a, _ in got], [b or None for _, b in got]
        try:
            raise_if_peers_failed(sizes, self.etp_group, "token exchange")
            ranks = dist.get_process_group_ranks(self.etp_group)
            if static and len(set(sizes)) > 1:
                raise ValueError(
                    f"static_splits=True promises the same number of tokens on every rank, but the etp ranks "
                    f"{ranks} have {sizes}"
                )
            if len(set(seq_lens)) > 1:
                raise ValueError(
                    f"the etp ranks {ranks} route the same tokens, so must pass one seq_len; got {seq_lens}"
                )
        except ValueError as err:
            self.relay(err)
        return sizes

    def static_sizes(self, n: int) -> None:
        """Stage "static", host-reading, after routing: every ep rank raises alike when one
        failed or the ranks route different numbers of tokens (the static splits would not
        match: a collective mismatch)."""
        sizes = exchange_sizes(n, self.ep_group, self.device)
        self.passed("static")
        raise_if_peers_failed(sizes, self.ep_group, "row exchange")
        if len(set(sizes)) > 1:
            ranks = dist.get_process_group_ranks(self.ep_group)
            raise ValueError(
                f"static_splits=True promises the same number of tokens on every rank, but the ep ranks {ranks} "
                f"route {sizes}"
            )

    def on_device(self, x_TD: Tensor | None, seq_len: int | None) -> None:
        """Stages "static" and then "etp" for a router that reads nothing back: each rank's T,
        or -1 where its input is not finite (``x_TD`` None: this rank failed already and raises
        its own error next), over ep, then over etp carrying the ep group's verdict; checked with
        ``torch._assert_async`` (a RuntimeError on CPU, a device-side assert on CUDA) on every
        other rank alike."""
        n = -1 if x_TD is None else x_TD.shape[0]
        mine = torch.full((), n, dtype=torch.int64, device=self.device)
        if x_TD is not None and x_TD.numel():  # aminmax propagates NaN; one pass, ~5x isfinite(x).all() on CPU
            lo, hi = torch.aminmax(x_TD)
            mine = torch.where(torch.isfinite(lo) & torch.isfinite(hi), mine, -1)
        world = dist.get_world_size(self.ep_group)
        got = all_to_all(mine.expand(world).contiguous(), [1] * world, [1] * world, self.ep_group)
        ok = (got == n).all()
        self.passed("static")
        if self.etp_group is not None:
            world = dist.get_world_size(self.etp_group)
            seq = torch.full((), seq_len or 0, dtype=torch.int64, device=self.device)
            sent = torch.stack([torch.where(ok, n, -1), seq]).expand(world, 2)
            got = all_to_all(sent.reshape(-1), [2] * world, [2] * world, self.etp_group).view(world, 2)
            ok = (got[:, 0] == n).all() & (got[:, 1] == seq).all()
            self.passed("etp")
        if x_TD is not None:
            torch._assert_async(
                ok,
                "expert-parallel ranks disagree (static_splits=True): a rank's input is bad or not finite (see "
                "its error), or the ranks route different numbers of tokens, or etp ranks pass different seq_len",
            )

    def sum_loads(self, t: Tensor, *, failed: bool = False) -> Tensor:
        """Stage "bias": ``t`` summed over every rank of the mesh, or zeros everywhere when a
        rank failed (the bias then moves by sign(0) = 0 on every rank, so it stays the same on
        all of them; the failure is raised at the count exchange that always follows)."""
        flag = t.new_full((1,), float(failed))
        total = all_reduce_mesh(torch.cat([t, flag]), self.mesh)
        self.passed("bias")
        return torch.where(total[-1] > 0, torch.zeros_like(t), total[:-1])
