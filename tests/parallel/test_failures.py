"""One rank of an expert-parallel group with bad input: every rank raises (the failing one its
own error, the others PeerFailedError naming it, or all the same error when the ranks disagree),
none waits for the others, and a good step afterwards runs on every rank and gives the
single-process layer's result: the group is still usable and in step. The groups time out
after 20 s, so a regression fails the test instead of hanging it for long."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from moe.parallel import PeerFailedError, parallelize_moe

from .launch import init, spawn
from .test_expert_parallel import TOL, build, tokens_of

pytestmark = pytest.mark.distributed
TIMEOUT_S = 20


def good_step(layer, ref, case: str, tokens: list[int], *, together: list[int] | None = None) -> None:
    """Every rank runs a step on good input (``tokens[r]`` on rank r) and gets the reference's
    output for its tokens, the reference routing the tokens of the ranks ``together`` (global
    BASE: all; etp: the rank's etp group; default: the rank's own)."""
    rank = dist.get_rank()
    together = together or [rank]
    blocks = [tokens_of(case, 100 + r, n) for r, n in enumerate(tokens)]
    y = layer(blocks[rank])
    start = sum(tokens[r] for r in together if r < rank)
    expect = ref(torch.cat([blocks[r] for r in together]))[start : start + tokens[rank]]
    torch.testing.assert_close(y, expect, **TOL)


def fails_everywhere(layer, x, bad: int, own: str, peers: str | None = None, peer_error=PeerFailedError) -> None:
    """``layer(x)`` raises on every rank: a ValueError matching ``own`` on rank ``bad``, on the
    others ``peer_error`` matching ``peers`` (by default: a PeerFailedError naming ``bad``)."""
    if dist.get_rank() == bad:
        with pytest.raises(ValueError, match=own):
            layer(x)
    else:
        with pytest.raises(peer_error, match=peers or rf"ranks \[{bad}\] failed"):
            layer(x)


def parallel_and_reference(case: str, mesh, **options):
    # the static path needs BASE's capacities from the token count alone: the "lowest" extras
    layer = build(case, extras="lowest" if options.get("static_splits") and case.startswith("base") else None)
    ref = copy.deepcopy(layer)
    return parallelize_moe(layer, mesh, **options), ref


def check_router_collectives(mesh) -> None:
    """NaN on one rank where the router itself communicates before the dispatch: the top-k bias
    all-reduce, global BASE's header. The bias moves on no rank."""
    rank = dist.get_rank()
    for case, options, tokens in (
        ("topk-bias", {}, [5, 4]),
        ("topk-bias", {}, [0, 4]),  # the healthy rank has no tokens
        ("base", {"global_base": True}, [5, 4]),
        ("base-k2", {"global_base": True}, [0, 4]),
    ):
        layer, ref = parallel_and_reference(case, mesh, **options)
        for bad in (1, 0):
            x = tokens_of(case, rank, tokens[rank] if rank != bad else 5)
            if rank == bad:
                x[2, 3] = float("nan")
            fails_everywhere(layer, x, bad, "finite")
        if case == "topk-bias":
            assert not layer.router.bias.any(), layer.router.bias
        good_step(layer, ref, case, tokens, together=[0, 1] if options else None)


def check_bad_shape_or_dtype(mesh) -> None:
    """x of another model dim, or bf16 into fp32 experts, on one rank: refused on every rank
    before any row moves, for every router and global BASE."""
    rank, world = dist.get_rank(), dist.get_world_size()
    bad_inputs = (
        (lambda x: x[:, :6], r"shape \(\.\.\., D=8\)"),
        (lambda x: x.bfloat16(), "experts' dtype torch.float32"),
        (lambda x: x[0, 0], r"shape \(\.\.\., D=8\)"),  # a 0-d tensor
    )
    for case, options in (
        ("topk", {}),
        ("topk-bias", {}),
        ("base-approx", {}),
        ("base", {"global_base": True}),
        ("sinkhorn", {}),
        ("expert_choice", {}),
    ):
        layer, ref = parallel_and_reference(case, mesh, **options)
        for bad, (spoil, message) in enumerate(bad_inputs):
            bad %= world
            x = tokens_of(case, rank, 5)
            fails_everywhere(layer, spoil(x) if rank == bad else x, bad, message)
        good_step(layer, ref, case, [5, 3], together=[0, 1] if options else None)


def check_static_splits(mesh) -> None:
    """static_splits=True with its promise broken (uneven token counts) or bad input on one
    rank. A router that reads back anyway (the exact solver): ValueError on every rank. The
    sync-free one: agreed on the device before routing, a RuntimeError on every rank on CPU."""
    rank = dist.get_rank()
    disagree = "ranks disagree"
    for case, sync_free in (("base-k2", False), ("base", False), ("base-approx", True)):
        layer, ref = parallel_and_reference(case, mesh, static_splits=True)
        uneven = tokens_of(case, rank, 6 - rank)
        if sync_free:
            with pytest.raises(RuntimeError, match=disagree):
                layer(uneven)
        else:
            with pytest.raises(ValueError, match=r"promises the same number of tokens.*route \[6, 5\]"):
                layer(uneven)
        for bad in (1, 0):
            x = tokens_of(case, rank, 6)
            if rank == bad:
                x[2, 3] = float("inf") if bad else float("nan")
            if sync_free:
                with pytest.raises(RuntimeError, match="finite" if rank == bad else disagree):
                    layer(x)
            else:
                fails_everywhere(layer, x, bad, "finite")
        x = tokens_of(case, rank, 6)
        if sync_free:
            fails_everywhere(layer, x.bfloat16() if rank == 1 else x, 1, "dtype", disagree, peer_error=RuntimeError)
        else:
            fails_everywhere(layer, x.bfloat16() if rank == 1 else x, 1, "dtype")
        good_step(layer, ref, case, [6, 6])
    # A router error after the sync-free path's agreement has nothing left to carry it: here
    # every rank fails alike (so nobody waits), and the layer then refuses to run again rather
    # than meet, on a rank that failed alone, its peers' row exchange with another step's rows.
    layer, _ = parallel_and_reference("base-approx", mesh, static_splits=True)

    def broken_router(*args, **kwargs):
        raise ValueError("the router failed")

    layer.router.forward = broken_router
    x = tokens_of("base-approx", rank, 6)
    with pytest.raises(ValueError, match="the router failed"):
        layer(x)
    with pytest.raises(ValueError, match="cannot run again"):
        layer(x)


def check_etp(mesh) -> None:
    """On a (ep=2, etp=2) mesh, ranks [[0, 1], [2, 3]]: a failure on one rank reaches its etp
    group in the token exchange and the other ep ranks in the count exchange (or the static
    path's), so all four raise; then a good step."""
    rank = dist.get_rank()
    group = [0, 1] if rank < 2 else [2, 3]
    peers = r"ranks \[\d(, \d)?\] failed"
    layer, ref = parallel_and_reference("topk-bias", mesh, etp="etp")
    x = tokens_of("topk-bias", rank, 4)
    fails_everywhere(layer, x[:, :5] if rank == 0 else x, 0, "D=8", peers)
    y = x.clone()
    y[1, 1] = float("nan")
    with pytest.raises(ValueError, match="finite" if rank >= 2 else peers):
        layer(y if rank == 2 else x)  # the etp ranks 2 and 3 both route the NaN
    with pytest.raises(ValueError, match="must pass one seq_len" if rank < 2 else peers):
        layer(x, seq_len=4 if rank == 0 else 8)
    assert not layer.router.bias.any()
    good_step(layer, ref, "topk-bias", [4, 3, 0, 5], together=group)
    for case, sync_free in (("base-k2", False), ("base-approx", True)):
        layer, ref = parallel_and_reference(case, mesh, etp="etp", static_splits=True)
        x = tokens_of(case, rank, 3 if rank == 3 else 4)
        if sync_free:
            with pytest.raises(RuntimeError, match="ranks disagree"):
                layer(x)
        else:
            with pytest.raises(ValueError, match="promises the same number" if rank >= 2 else peers):
                layer(x)
        good_step(layer, ref, case, [4] * 4, together=group)


def worker(rank: int, world: int, store: str) -> None:
    init(rank, world, store, TIMEOUT_S)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
        check_router_collectives(mesh)
        check_bad_shape_or_dtype(mesh)
        check_static_splits(mesh)
    finally:
        dist.destroy_process_group()


def test_one_rank_fails_every_rank_raises():
    spawn(worker, 2)
