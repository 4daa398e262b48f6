"""The chunked dispatcher over gloo, 3 ranks: chunks=2 and 4 give chunks=1's outputs and every
gradient (top-k with drops, dropless top-k, BASE counted and static, global BASE), with a rank
that has no tokens, ranks with fewer rows than chunks and experts that get nothing; a model of
a slow network (every exchange written only when waited for) gives the same numbers, and the
schedule overlaps each chunk's experts with another chunk's exchange, forward and backward; no
new host reads; a failing rank fails every rank. One launch."""

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from moe import MoE, MoEConfig, aux_loss
from moe.parallel import ChunkedDispatcher, FlatDispatcher, parallelize_moe

from ..host_reads import HostReads
from .launch import check_nan_on_one_rank, init, spawn

pytestmark = pytest.mark.distributed
TOL = dict(rtol=1e-5, atol=1e-6)
WORLD, E = 3, 6
CASES = {
    "topk-dropping": dict(router="topk", top_k=2, capacity_factor=1.0, aux_loss_coef=0.01, z_loss_coef=1e-3),
    "topk": dict(router="topk", top_k=2),
    "base": dict(router="base", top_k=2),
    "base-static": dict(router="base", top_k=2, router_options={"base_solver": "approx", "base_extras": "lowest"}),
    "base-global": dict(router="base", top_k=1, combine="sigmoid_residual", num_shared_experts=1),
}


def build(case: str) -> MoE:
    torch.manual_seed(0)
    return MoE(MoEConfig(dim=8, hidden_dim=12, num_experts=E, **CASES[case]))


def tokens_of(case: str, rank: int, n: int) -> torch.Tensor:
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(1000 * len(case) + 17 * rank + n))


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def run(layer: MoE, x_in: torch.Tensor) -> tuple:
    x = x_in.clone().requires_grad_()
    y = layer(x)
    ((y * torch.linspace(-1, 1, 8)).sum() + aux_loss(layer)).backward()
    return y.detach(), x.grad, {name: local(p.grad).clone() for name, p in layer.named_parameters()}


def check_same_as_one_chunk(mesh, case: str, tokens: list[int], chunks=(2, 4), away: int | None = None, **options):
    """Outputs, x.grad and every parameter's local gradient equal chunks=1's on this rank.
    ``away``: an expert no token chooses (a selection bias), so it gets nothing."""
    base = build(case)
    if away is not None:
        with torch.no_grad():
            base.router.bias[away] = -1e4
    x_in = tokens_of(case, dist.get_rank(), tokens[dist.get_rank()])
    one = parallelize_moe(copy.deepcopy(base), mesh, **options)
    assert type(one.dispatcher) is FlatDispatcher
    y1, gx1, g1 = run(one, x_in)
    for c in chunks:
        layer = parallelize_moe(copy.deepcopy(base), mesh, chunks=c, **options)
        assert type(layer.dispatcher) is ChunkedDispatcher and layer.dispatcher.chunks == c
        y, gx, g = run(layer, x_in)
        what = f"{case} chunks={c}"
        torch.testing.assert_close(y, y1, **TOL, msg=lambda m, w=what: f"{w} output: {m}")
        torch.testing.assert_close(gx, gx1, **TOL, msg=lambda m, w=what: f"{w} x.grad: {m}")
        assert g.keys() == g1.keys() and {"router.weight", "experts.w1", "experts.w2", "experts.w3"} <= g.keys()
        for name, grad in g.items():
            torch.testing.assert_close(grad, g1[name], **TOL, msg=lambda m, n=name, w=what: f"{w} {n}.grad: {m}")
    if away is not None:
        assert (one.last_routing.expert_idx != away).all()


@contextlib.contextmanager
def slow_network(log: list):
    """Every all-to-all issued with async_op=True is written only when it is waited for: until
    then its output holds NaN (as memory the network has not written yet would hold garbage),
    and it reads its input only then. ``log`` gets ("issue", n) and ("wait", n) in turn."""
    real = dist.all_to_all_single
    issued = []

    class Deferred:
        def __init__(self, args, kwargs):
            self.args, self.kwargs, self.done = args, kwargs, False

        def wait(self):
            if not self.done:
                real(*self.args, **self.kwargs)
                self.done = True
                log.append(("wait", issued.index(self)))
            return True

    def all_to_all_single(out, x, *args, async_op=False, **kwargs):
        if not async_op:
            return real(out, x, *args, **kwargs)
        out.fill_(float("nan"))
        issued.append(Deferred((out, x, *args), kwargs))
        log.append(("issue", len(issued) - 1))
        return issued[-1]

    dist.all_to_all_single = all_to_all_single
    try:
        yield issued
    finally:
        dist.all_to_all_single = real


class _Mark(torch.autograd.Function):
    """Identity; its backward logs how many exchanges are in flight when it runs."""

    @staticmethod
    def forward(ctx, x, log, issued):
        ctx.log, ctx.issued = log, issued
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(("experts-backward", sum(not w.done for w in ctx.issued)))
        return grad, None, None


def check_slow_network_and_schedule(mesh) -> None:
    """Under `slow_network` chunks=4 still equals chunks=1 (a dropped wait reads NaN), and
    every chunk's experts, forward and backward, run while another chunk's exchange is in
    flight; with chunks=1 nothing is in flight then."""
    rank = dist.get_rank()
    x_in = tokens_of("topk", rank, [7, 3, 10][rank])
    ref = run(parallelize_moe(build("topk"), mesh), x_in)
    for chunks in (1, 4):
        layer = parallelize_moe(build("topk"), mesh, chunks=chunks)
        log: list = []
        with slow_network(log) as issued:
            experts_forward = layer.experts.forward

            def logged(x_MD, counts_E, forward=experts_forward, issued=issued, log=log):
                log.append(("experts", sum(not w.done for w in issued)))
                return _Mark.apply(forward(x_MD, counts_E), log, issued)

            layer.experts.forward = logged
            got = run(layer, x_in)
        for a, b, what in zip(got[:2], ref[:2], ("output", "x.grad"), strict=True):
            torch.testing.assert_close(a, b, **TOL, msg=lambda m, w=what, c=chunks: f"slow network chunks={c} {w}: {m}")
        for name, grad in got[2].items():
            torch.testing.assert_close(grad, ref[2][name], **TOL, msg=lambda m, n=name: f"slow network {n}.grad: {m}")
        in_flight = [n for what, n in log if what.startswith("experts")]
        assert len(in_flight) == 2 * chunks, log
        if chunks == 1:  # the flat dispatcher: nothing asynchronous
            assert in_flight == [0, 0] and not issued, log
        else:
            assert min(in_flight) >= 1, log  # every GEMM, forward and backward, has an exchange beside it
            assert all(w.done for w in issued) and len(issued) == 4 * chunks, log


def check_no_new_host_reads(mesh) -> None:
    """The chunked path reads back what the flat one does: the same list on the counted path,
    nothing on BASE's static path with the sync-free solver."""
    x = tokens_of("base-static", dist.get_rank(), 6).requires_grad_()
    for case, static in (("topk-dropping", False), ("base-static", True)):
        reads = {}
        for chunks in (1, 2):
            layer = parallelize_moe(build(case), mesh, chunks=chunks, static_splits=static)
            with HostReads(x, *layer.parameters()) as seen:
                (layer(x) * torch.linspace(-1, 1, 8)).sum().backward()
            reads[chunks] = seen.reads
        assert reads[2] == reads[1], (case, reads)
        assert (reads[1] == []) == static, (case, reads)


def check_failing_rank(mesh) -> None:
    """A rank whose input cannot be routed (NaN) raises, and so do the others; the group stays usable."""
    layer = parallelize_moe(build("topk"), mesh, chunks=2)
    check_nan_on_one_rank(layer, lambda: tokens_of("topk", dist.get_rank(), 5), bad_rank=1)


def check_bad_arguments(mesh) -> None:
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="chunks must be a positive int"):
            parallelize_moe(build("topk"), mesh, chunks=bad)
    with pytest.raises(ValueError, match="use dispatch_strategy 'resort' or 'auto'"):
        parallelize_moe(build("topk"), mesh, chunks=2, dispatch_strategy="per_expert")
    with pytest.raises(ValueError, match="disagree"):
        parallelize_moe(build("topk"), mesh, chunks=2 if dist.get_rank() else 4)


def worker(rank: int, world: int, store: str) -> None:
    init(rank, world, store)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        check_same_as_one_chunk(mesh, "topk-dropping", [9, 0, 5])  # a rank with no tokens
        check_same_as_one_chunk(mesh, "topk", [2, 1, 11], away=4)  # fewer rows than chunks; an empty expert
        check_same_as_one_chunk(mesh, "base", [6, 8, 0], chunks=(4,))
        check_same_as_one_chunk(mesh, "base-static", [5, 5, 5], chunks=(3,), static_splits=True)
        check_same_as_one_chunk(mesh, "base-global", [4, 0, 7], chunks=(2,), global_base=True)
        check_slow_network_and_schedule(mesh)
        check_no_new_host_reads(mesh)
        check_failing_rank(mesh)
        check_bad_arguments(mesh)
    finally:
        dist.destroy_process_group()


def test_chunked_matches_one_chunk():
    spawn(worker, WORLD)
