"""ExpertChoiceRouter: every expert takes exactly C tokens, its best ones, with softmax weights.

Legend: T tokens, D model dim, E experts, K average experts per token, C tokens per expert.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moe.routing import ExpertChoiceRouter, RouterConfig, router_z_loss

D = 5


def _router(seed=0, **kw):
    r = ExpertChoiceRouter(RouterConfig(dim=D, kind="expert_choice", **kw))
    with torch.no_grad():
        r.weight.copy_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(seed)))
    return r


def _x(T, seed=0):
    return torch.randn(T, D, generator=torch.Generator().manual_seed(seed + 7))


def _check_result(res, T, E, C):
    """Expert-choice layout: (T, E) slots, slot e holds e or -1; C tokens per expert."""
    idx, w = res.expert_idx, res.weights
    assert idx.shape == (T, E) and w.shape == (T, E) and w.dtype == torch.float32
    assert res.top_k == E and res.num_experts == E
    taken = idx >= 0
    assert torch.equal(idx[taken], torch.arange(E).expand(T, E)[taken]), "slot e may only hold expert e"
    assert bool((w[~taken] == 0).all())
    assert torch.equal(res.counts, taken.sum(0))
    assert torch.equal(res.counts, torch.full((E,), C))
    assert int(res.counts.sum()) == int(taken.sum())


@given(
    T=st.integers(0, 20),
    E=st.integers(1, 8),
    K=st.integers(1, 8),
    cf=st.one_of(st.none(), st.floats(0.1, 3.0)),
    seed=st.integers(0, 2**16),
)
def test_every_expert_takes_its_C_best_tokens(T, E, K, cf, seed):
    K = min(K, E)
    r = _router(seed, num_experts=E, top_k=K, capacity_factor=cf)
    x = _x(T, seed)
    res = r(x)
    C = min(T, math.ceil((1.0 if cf is None else cf) * T * K / E))
    _check_result(res, T, E, C)
    probs = (x @ r.weight.detach().T).softmax(-1)
    taken = res.expert_idx >= 0
    torch.testing.assert_close(res.weights, torch.where(taken, probs, torch.zeros_like(probs)))
    if 0 < C < T:  # within each expert's column, every taken token scores at least as high as any other
        worst_taken = probs.masked_fill(~taken, float("inf")).amin(0)
        best_other = probs.masked_fill(taken, float("-inf")).amax(0)
        assert bool((worst_taken >= best_other).all())
    untouched = int((~taken.any(1)).sum())
    assert res.stats.dropped_fraction == pytest.approx(untouched / T if T else 0.0)
    assert res.stats.max_load == (1.0 if C else 0.0)


def test_capacity_is_clamped_to_T():
    res = _router(0, num_experts=3, top_k=3, capacity_factor=4.0)(_x(5))
    _check_result(res, 5, 3, 5)  # ceil(4 * 5 * 3 / 3) = 20 > T: every expert takes every token
    assert bool((res.expert_idx >= 0).all())


def test_a_token_may_be_taken_by_no_expert_or_by_several():
    r = _router(0, num_experts=3, top_k=1)
    with torch.no_grad():
        r.weight.zero_()
        r.weight[:, 0] = torch.tensor([3.0, 3.0, -3.0])  # experts 0 and 1 both want the largest x0
    x = torch.zeros(6, D)
    x[:, 0] = torch.tensor([-3.0, -2.0, -1.0, 1.0, 2.0, 3.0])
    res = r(x)  # C = 2
    assert (res.expert_idx >= 0).sum(1).tolist() == [1, 1, 0, 0, 2, 2]
    assert res.stats.dropped_fraction > 0


def test_losses():
    x = _x(8)
    r = _router(1, num_experts=4, top_k=2, aux_loss_coef=1.0, seq_aux_loss_coef=1.0, z_loss_coef=0.01)
    res = r(x, seq_len=4)
    assert res.aux_loss.item() == 0.0, "balanced by construction: no load-balancing loss"
    logits = x @ r.weight.T
    torch.testing.assert_close(res.z_loss, 0.01 * router_z_loss(logits))
    (res.weights.sum() + res.z_loss).backward()
    assert r.weight.grad is not None and bool(r.weight.grad.abs().sum() > 0)
    assert _router(1, num_experts=4)(x).z_loss.item() == 0.0


@pytest.mark.parametrize("T, E", [(0, 4), (1, 4), (3, 7), (2, 1)])
def test_tiny_batches(T, E):
    res = _router(2, num_experts=E, top_k=1)(_x(T))
    _check_result(res, T, E, min(T, math.ceil(T / E)))


def test_bf16_input_routes_in_fp32():
    r = _router(3, num_experts=4, top_k=2)
    x = _x(10, 3).bfloat16()
    res, ref = r(x), r(x.float())
    assert res.weights.dtype == torch.float32
    assert torch.equal(res.expert_idx, ref.expert_idx) and torch.equal(res.weights, ref.weights)
    _check_result(r.bfloat16()(x), 10, 4, 5)


@pytest.mark.parametrize(
    "x, match",
    [
        (torch.randn(D), r"x must have shape \(T, D=5\), got \(5,\)"),
        (torch.randn(4, D - 1), r"x must have shape \(T, D=5\), got \(4, 4\)"),
        (torch.tensor([[float("nan")] * D]), r"x must be finite: found NaN"),
    ],
)
def test_bad_x_raises_value_error(x, match):
    with pytest.raises(ValueError, match=match):
        _router(0, num_experts=3)(x)
