"""BaseRouter: balanced in training, greedy in eval, gradient through the gate."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moe.routing import (
    BaseRouter,
    RouterConfig,
    assignment_score,
    balanced_assignment_ref,
    build_router,
    expert_capacities,
    router_z_loss,
)

from ..host_reads import HostReads


def make(dim=12, experts=5, k=1, **kw):
    torch.manual_seed(0)
    return BaseRouter(RouterConfig(kind="base", dim=dim, num_experts=experts, top_k=k, **kw))


@given(st.integers(0, 40), st.integers(1, 6), st.integers(1, 3), st.integers(0, 999))
def test_training_is_exactly_balanced(t, e, k, seed):
    k = min(k, e)
    router = make(experts=e, k=k)
    x = torch.randn(t, 12, generator=torch.Generator().manual_seed(seed))
    res = router(x)
    # exact balance; which experts take the T*K % E extra tokens follows the scores
    assert torch.equal(res.counts.sort(descending=True).values, expert_capacities(t, e, k))
    assert res.expert_idx.shape == (t, k)
    assert (res.expert_idx.sort(dim=1).values.diff(dim=1) != 0).all(), "a token got the same expert twice"
    logits = x @ router.weight.detach().T
    torch.testing.assert_close(res.weights, torch.sigmoid(logits.gather(1, res.expert_idx)))
    assert res.stats.dropped_fraction == 0.0
    # the training assignment is the optimal balanced one, not merely a balanced one
    best = float(assignment_score(logits, balanced_assignment_ref(logits, k)))
    assert float(assignment_score(logits, res.expert_idx)) == pytest.approx(best, rel=1e-5, abs=1e-5)
    # preferred: the slots that went to one of their token's K highest-scoring experts, counted per slot
    top = [set(row) for row in logits.topk(k, dim=1).indices.tolist()]
    want = sum(e in top[i] for i, row in enumerate(res.expert_idx.tolist()) for e in row)
    assert res.preferred.dtype == torch.int64 and int(res.preferred) == want


def test_eval_is_greedy_top_k():
    router = make(experts=4, k=2).eval()
    x = torch.randn(30, 12)
    x[:, :] += router.weight.detach()[0] * 50  # every token prefers expert 0: unbalanced on purpose
    res = router(x)
    logits = x @ router.weight.detach().T
    assert torch.equal(res.expert_idx, logits.topk(2, dim=1).indices)
    assert res.counts[0] == 30


def test_centroids_learn_through_the_gate():
    router = make()
    x = torch.randn(20, 12)
    res = router(x)
    res.weights.sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("solver", ["exact", "approx"])
def test_extra_tokens_follow_the_config(solver):
    # 37 tokens on 4 experts: one expert takes 10. "lowest" pins it to expert 0 whatever the
    # scores; "best" (the default) gives it to the expert the tokens score highest.
    router = make(experts=4, base_solver=solver, base_extras="lowest")
    x = torch.randn(37, 12, generator=torch.Generator().manual_seed(2))
    x += router.weight.detach()[3] * 20  # every token leans towards expert 3
    assert router(x).counts.tolist() == [10, 9, 9, 9]
    assert make(experts=4, base_solver=solver)(x).counts.tolist() == [9, 9, 9, 10]
    with pytest.raises(ValueError, match=r"base_extras must be one of \('best', 'lowest'\), got 'first'"):
        make(base_extras="first")
    for bad in (-1.0, float("inf"), "1e6"):  # global BASE's price of a round, in bytes
        with pytest.raises(ValueError, match=r"base_round_bytes must be a finite number >= 0"):
            make(base_round_bytes=bad)


def test_bf16_input_routes_in_fp32():
    router = make(experts=3)
    res = router(torch.randn(9, 12, dtype=torch.bfloat16))
    assert res.weights.dtype == torch.float32
    assert torch.equal(res.counts, torch.tensor([3, 3, 3]))


def test_z_loss_and_build_router():
    cfg = RouterConfig(kind="base", dim=12, num_experts=5, z_loss_coef=0.1)
    router = build_router(cfg)
    assert isinstance(router, BaseRouter)
    x = torch.randn(10, 12)
    res = router(x)
    torch.testing.assert_close(res.z_loss, 0.1 * router_z_loss(x @ router.weight.detach().T))
    assert res.aux_loss.item() == 0.0


def test_approx_solver_trains_balanced_without_host_reads():
    router = make(experts=4, base_solver="approx")
    with pytest.raises(ValueError, match="finite"):  # by default the input is checked on the host
        router(torch.full((4, 12), float("nan")))
    router.sync_free = True  # as the expert-parallel static path sets it
    x = torch.randn(37, 12)
    with HostReads(x, router.weight) as seen:
        res = router(x)
        res.weights.sum().backward()
    assert seen.reads == [] and res.stats is None  # stats are plain floats: they would need a read
    assert torch.equal(res.counts.sort(descending=True).values, expert_capacities(37, 4, 1))
    assert router.weight.grad is not None
    with pytest.raises(RuntimeError, match="finite"):  # checked on the device
        router(torch.full((4, 12), float("nan")))
    router.eval()
    assert router(x).stats is not None and router.host_syncs
    res = make(experts=5, k=3, base_solver="approx")(x)  # K > 1 too
    assert torch.equal(res.counts.sort(descending=True).values, expert_capacities(37, 5, 3))
    with pytest.raises(ValueError, match="base_solver"):
        make(base_solver="auction")


def test_price_updates_reach_the_solver():
    # max_iters None: each solver's own default
    for iters, passed in ((None, {"extras": "best"}), (3, {"extras": "best", "max_iters": 3})):
        router, seen = make(base_max_iters=iters), []
        solver = router.assign
        router.assign = lambda s, k, seen=seen, solver=solver, **options: (
            seen.append(options) or solver(s, k, **options)
        )
        router(torch.randn(9, 12))
        assert seen == [passed]
    with pytest.raises(ValueError, match="base_max_iters"):
        make(base_max_iters=-1)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_bad_input_raises(mode):
    router = make()
    router.train(mode == "train")
    with pytest.raises(ValueError, match="finite"):
        router(torch.full((4, 12), float("nan")))
    with pytest.raises(ValueError, match=r"x must have shape"):
        router(torch.randn(4, 11))
