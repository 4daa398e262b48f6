"""Expert-parallel dispatch over gloo, both strategies: EP=2 gives the single-process layer's
outputs and gradients, tokens are conserved, a rank may have no tokens, the receive splits are
the transpose of the send splits, and dispatch then combine returns the rows exactly."""

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe import MoE, MoEConfig
from moe.kernels import grouped_mm, permute, unpermute
from moe.parallel import combine, dispatch
from moe.parallel.dispatch import send_key

from .launch import init, spawn

pytestmark = pytest.mark.distributed
# per scenario: tokens on each rank (rank 0 has none in the second; in the third, 4 slots on up
# to 8 experts leave at least half of them with nothing)
TOKENS = {2: [(7, 3), (0, 5), (1, 1)]}


def sorted_rows(layer: MoE, x: torch.Tensor, world: int, strategy: str):
    res = layer.router(x)
    keys = send_key(res.expert_idx, layer.config.num_experts, world, strategy)
    xs, info = permute(x, keys, num_experts=layer.config.num_experts, backend="torch")
    return res, xs, info


def ep_forward(layer: MoE, x: torch.Tensor, world: int, strategy: str, w1, w3, w2) -> torch.Tensor:
    """The layer's forward with its experts spread over the ranks: this rank holds w1/w3/w2."""
    res, xs, info = sorted_rows(layer, x, world, strategy)
    x_local, counts_local, dinfo = dispatch(xs, info.counts, strategy=strategy)
    h = F.silu(grouped_mm(x_local, w1, counts_local)) * grouped_mm(x_local, w3, counts_local)
    y_local = grouped_mm(h, w2, counts_local)
    return unpermute(combine(y_local, dinfo), info, res.weights, backend="torch"), counts_local


def check_round_trip(layer: MoE, x: torch.Tensor, world: int, strategy: str) -> None:
    """Identity experts: combine(dispatch(rows)) is the rows, bit for bit; what rank i receives
    from rank j is what j sends to i (the receive-split matrix is the send-split transpose)."""
    _, xs, info = sorted_rows(layer, x, world, strategy)
    x_local, counts_local, dinfo = dispatch(xs, info.counts, strategy=strategy)
    assert torch.equal(combine(x_local, dinfo), xs)
    assert int(counts_local.sum()) == x_local.shape[0] == sum(map(sum, dinfo.recv))
    send = [None] * world
    recv = [None] * world
    dist.all_gather_object(send, dinfo.send)
    dist.all_gather_object(recv, dinfo.recv)
    rank = dist.get_rank()
    assert all(recv[rank][j] == send[j][rank] for j in range(world)), (send, recv)


def worker(rank: int, world: int, store: str) -> None:
    init(rank, world, store)
    try:
        for tokens, num_experts, strategy in itertools.product(TOKENS[world], (2, 8), ("resort", "per_expert")):
            torch.manual_seed(0)  # the same global layer on every rank
            layer = MoE(MoEConfig(dim=8, hidden_dim=12, num_experts=num_experts, top_k=2))
            per = layer.config.num_experts // world
            ex = layer.experts
            local = [w.detach()[rank * per : (rank + 1) * per].clone().requires_grad_() for w in (ex.w1, ex.w3, ex.w2)]
            x = torch.randn(tokens[rank], 8, generator=torch.Generator().manual_seed(rank))
            x_ref, x_ep = x.clone().requires_grad_(), x.clone().requires_grad_()
            y_ref = layer(x_ref)
            y_ep, counts_local = ep_forward(layer, x_ep, world, strategy, *local)
            torch.testing.assert_close(y_ep, y_ref, rtol=1e-5, atol=1e-6)
            scale = torch.linspace(-1, 1, 8)
            (y_ref * scale).sum().backward()
            (y_ep * scale).sum().backward()
            torch.testing.assert_close(x_ep.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
            for w_local, w in zip(local, (ex.w1, ex.w3, ex.w2), strict=True):
                g = w.grad.clone()
                dist.all_reduce(g)  # the experts see every rank's tokens under expert parallelism
                torch.testing.assert_close(w_local.grad, g[rank * per : (rank + 1) * per], rtol=1e-5, atol=1e-6)
            kept = torch.tensor([int((layer.last_routing.expert_idx >= 0).sum()), int(counts_local.sum())])
            dist.all_reduce(kept)
            assert kept[0] == kept[1]  # tokens are conserved across ranks
            if tokens == (1, 1) and num_experts == 8:  # some expert received nothing, on some rank
                starved = torch.tensor([int((counts_local == 0).sum())])
                dist.all_reduce(starved)
                assert starved >= 4
            check_round_trip(layer, x, world, strategy)
    finally:
        dist.destroy_process_group()


def test_ep2_matches_single_process_layer():
    spawn(worker, 2)
