"""Sinkhorn plan (marginals, stability, invariances) and SinkhornRouter.

Legend: T tokens, D model dim, E experts, K slots per token.
"""

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from moe.routing import RouterConfig, SinkhornRouter, load_balancing_loss, router_z_loss, sinkhorn

D = 6


def _logits(T, E, seed, scale=1.0):
    return scale * torch.randn(T, E, generator=torch.Generator().manual_seed(seed))


def _router(seed=0, **kw):
    r = SinkhornRouter(RouterConfig(dim=D, kind="sinkhorn", **kw))
    with torch.no_grad():
        r.weight.copy_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(seed)))
    return r


def _x(T, seed=0):
    return torch.randn(T, D, generator=torch.Generator().manual_seed(seed + 7))


def _check_result(res, T, K, E):
    idx, w = res.expert_idx, res.weights
    assert idx.shape == (T, K) and w.shape == (T, K) and w.dtype == torch.float32
    assert bool(((idx >= 0) & (idx < E)).all()), "Sinkhorn routing is dropless"
    assert torch.equal(res.counts, torch.bincount(idx.flatten(), minlength=E))
    assert int(res.counts.sum()) == T * K
    assert bool((w >= 0).all())
    for row in idx.tolist():
        assert len(row) == len(set(row))


@given(T=st.integers(1, 16), E=st.integers(1, 8), scale=st.sampled_from([0.1, 1.0, 2.0]), seed=st.integers(0, 2**16))
@example(T=2, E=2, scale=2.0, seed=58842)  # a strong diagonal converges slowly: 1e-3 off after 100 iterations
def test_plan_marginals_after_enough_iterations(T, E, scale, seed):
    plan = sinkhorn(_logits(T, E, seed, scale), 300, 1.0).exp()
    assert plan.shape == (T, E) and plan.dtype == torch.float32
    torch.testing.assert_close(plan.sum(1), torch.ones(T), rtol=0, atol=1e-5)
    torch.testing.assert_close(plan.sum(0), torch.full((E,), T / E), rtol=1e-3, atol=1e-5)


@given(T=st.integers(1, 10), E=st.integers(1, 6), iters=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_rows_sum_to_one_after_any_number_of_iterations(T, E, iters, seed):
    plan = sinkhorn(_logits(T, E, seed, 3.0), iters, 1.0).exp()
    torch.testing.assert_close(plan.sum(1), torch.ones(T), rtol=0, atol=1e-5)


@pytest.mark.parametrize("iters", [1, 8, 50])
@pytest.mark.parametrize(
    "make",
    [
        lambda g: (torch.rand(9, 5, generator=g) * 2 - 1) * 1e4,  # uniform in [-1e4, 1e4]
        lambda g: torch.full((9, 5), 1e4),
        lambda g: torch.where(torch.rand(9, 5, generator=g) < 0.5, 1e4, -1e4),
        lambda g: torch.tensor([[1e4, -1e4, -1e4]] * 7),  # every token wants expert 0 with overwhelming margin
    ],
)
def test_plan_is_finite_for_logits_up_to_1e4_in_fp32(iters, make):
    logits = make(torch.Generator().manual_seed(0)).float()
    log_plan = sinkhorn(logits, iters, 1.0)
    assert not bool(torch.isnan(log_plan).any())
    plan = log_plan.exp()
    assert bool(torch.isfinite(plan).all())
    torch.testing.assert_close(plan.sum(1), torch.ones(logits.shape[0]), rtol=0, atol=1e-2)


@given(
    T=st.integers(1, 8), E=st.integers(1, 6), temperature=st.sampled_from([0.25, 0.7, 3.0]), seed=st.integers(0, 999)
)
def test_temperature_divides_the_logits(T, E, temperature, seed):
    logits = _logits(T, E, seed)
    torch.testing.assert_close(sinkhorn(logits, 5, temperature), sinkhorn(logits / temperature, 5, 1.0))


@given(T=st.integers(1, 8), E=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_plan_ignores_per_token_and_per_expert_offsets(T, E, seed):
    # the marginals fix the plan up to diagonal scalings, so row and column offsets cancel
    logits = _logits(T, E, seed)
    g = torch.Generator().manual_seed(seed + 1)
    shifted = logits + 5 * torch.randn(T, 1, generator=g) + 5 * torch.randn(1, E, generator=g)
    # column offsets cancel only at the fixed point: iterate to convergence
    torch.testing.assert_close(sinkhorn(shifted, 500, 1.0), sinkhorn(logits, 500, 1.0), rtol=1e-3, atol=1e-3)


def test_empty_plan():
    assert sinkhorn(torch.zeros(0, 4), 3, 1.0).shape == (0, 4)


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.zeros(4), 3, 1.0), r"logits_TE must be a floating \(T, E\) tensor, got shape \(4,\)"),
        ((torch.zeros(2, 4, dtype=torch.long), 3, 1.0), r"logits_TE must be a floating.*int64"),
        ((torch.zeros(2, 4), 0, 1.0), r"iters must be an int >= 1, got 0"),
        ((torch.zeros(2, 4), 3, 0.0), r"temperature must be > 0, got 0.0"),
    ],
)
def test_sinkhorn_bad_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        sinkhorn(*args)


@given(E=st.integers(1, 7), K=st.integers(1, 7), T=st.integers(0, 16), seed=st.integers(0, 2**16))
def test_training_selects_top_k_of_the_plan_with_megatron_gates(E, K, T, seed):
    K = min(K, E)
    r = _router(seed, num_experts=E, top_k=K, sinkhorn_iters=5).train()
    x = _x(T, seed)
    res = r(x)
    _check_result(res, T, K, E)
    logits = x @ r.weight.detach().T
    expected_idx = sinkhorn(logits, 5, 1.0).topk(K, dim=-1).indices
    assert torch.equal(res.expert_idx, expected_idx)
    scores = logits.sigmoid() if K == 1 else logits.softmax(-1)  # Megatron: sigmoid for k = 1, else softmax
    torch.testing.assert_close(res.weights, scores.gather(1, res.expert_idx))


@given(E=st.integers(1, 7), K=st.integers(1, 7), T=st.integers(0, 16), seed=st.integers(0, 2**16))
def test_eval_selects_top_k_of_the_logits(E, K, T, seed):
    K = min(K, E)
    r = _router(seed, num_experts=E, top_k=K).eval()
    x = _x(T, seed)
    res = r(x)
    _check_result(res, T, K, E)
    logits = x @ r.weight.detach().T
    scores = logits.sigmoid() if K == 1 else logits.softmax(-1)
    chosen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, res.expert_idx, True)
    if T and K < E:
        assert bool(
            (logits.masked_fill(~chosen, float("inf")).amin(1) >= logits.masked_fill(chosen, -1e30).amax(1)).all()
        )
    torch.testing.assert_close(res.weights, scores.gather(1, res.expert_idx))


@pytest.mark.parametrize("K", [1, 2])
def test_training_balances_skewed_logits_better_than_plain_top_k(K):
    r = _router(5, num_experts=4, top_k=K, sinkhorn_iters=20)
    with torch.no_grad():
        r.weight[:, 0] = torch.tensor([4.0, 0.0, 0.0, 0.0])  # feature 0 is a constant: expert 0 wins everywhere
    x = _x(64, 5)
    x[:, 0] = 1.0
    plain, balanced = r.eval()(x), r.train()(x)
    assert plain.stats.max_load >= 1.6, f"plain top-k counts {plain.counts.tolist()}"
    # approximate balance only: the top-k of a balanced fractional plan is not exactly balanced
    assert balanced.stats.max_load <= 1.3, f"Sinkhorn counts {balanced.counts.tolist()}"


def test_losses_are_zero_unless_set_and_match_the_loss_functions():
    x = _x(8)
    assert _router(0, num_experts=4, top_k=2)(x).aux_loss.item() == 0.0
    r = _router(0, num_experts=4, top_k=2, aux_loss_coef=0.01, z_loss_coef=0.001).train()
    res = r(x)
    logits = x @ r.weight.T
    torch.testing.assert_close(res.aux_loss, 0.01 * load_balancing_loss(logits.softmax(-1), res.expert_idx, 4))
    torch.testing.assert_close(res.z_loss, 0.001 * router_z_loss(logits))
    (res.weights.sum() + res.aux_loss + res.z_loss).backward()
    assert r.weight.grad is not None and bool(r.weight.grad.abs().sum() > 0)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("T", [0, 1, 3])
def test_tiny_batches_and_bf16(train, T):
    r = _router(1, num_experts=5, top_k=2, z_loss_coef=0.1).train(train)
    _check_result(r(_x(T)), T, 2, 5)
    x16 = _x(T).bfloat16()
    res, ref = r(x16), r(x16.float())
    assert res.weights.dtype == torch.float32
    assert torch.equal(res.expert_idx, ref.expert_idx) and torch.equal(res.weights, ref.weights)


@pytest.mark.parametrize(
    "x, match",
    [
        (torch.randn(3, D + 2), r"x must have shape \(T, D=6\), got \(3, 8\)"),
        (torch.full((2, D), float("nan")), r"x must be finite: found NaN"),
    ],
)
def test_bad_x_raises_value_error(x, match):
    with pytest.raises(ValueError, match=match):
        _router(0, num_experts=3)(x)
