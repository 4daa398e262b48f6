"""Router losses against plain-Python references.

Legend: T tokens, E experts, K slots per token, B sequences, S tokens per sequence.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moe.routing import load_balancing_loss, router_z_loss, sequence_load_balancing_loss


def _probs_TE(T, E, seed):
    g = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(T, E, generator=g)).softmax(dim=-1)


def _idx_TK(T, K, E, seed, drop_p=0.0):
    """K distinct experts per token, each slot dropped (-1) with probability drop_p."""
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
    return torch.where(torch.rand(T, K, generator=g) < drop_p, -1, idx)


def _ref_loss(probs_TE, idx_TK, E):
    """E * sum_e f_e * P_e with a Python loop over the slots, float64."""
    T, K = idx_TK.shape
    f = [0.0] * E
    for e in idx_TK.flatten().tolist():
        if e >= 0:
            f[e] += 1.0 / (T * K)
    P = probs_TE.double().mean(dim=0).tolist()
    return E * sum(fe * pe for fe, pe in zip(f, P, strict=True)), f


routings = st.tuples(
    st.integers(1, 12),  # T
    st.integers(1, 7),  # E
    st.integers(1, 7),  # K (clamped to E)
    st.integers(0, 2**16),  # seed
    st.sampled_from([0.0, 0.3]),  # drop probability
)


@given(E=st.integers(1, 9), reps=st.integers(1, 4), K=st.integers(1, 9), coef=st.sampled_from([1.0, 0.01, 0.37]))
def test_switch_loss_is_one_at_perfect_balance(E, reps, K, coef):
    K = min(K, E)
    T = reps * E  # T*K divisible by E: every expert gets exactly T*K/E slots
    idx = (torch.arange(T * K) % E).view(T, K)
    probs = torch.full((T, E), 1.0 / E)
    loss = load_balancing_loss(probs, idx, E)
    assert loss.dim() == 0 and loss.dtype == torch.float32
    assert float(coef * loss) == pytest.approx(coef, rel=1e-6)


@pytest.mark.parametrize("E", [1, 3, 8])
def test_switch_loss_is_E_when_everything_goes_to_one_expert(E):
    probs = torch.nn.functional.one_hot(torch.zeros(5, dtype=torch.long), E).float()
    assert float(load_balancing_loss(probs, torch.zeros(5, 1, dtype=torch.long), E)) == pytest.approx(E)


@given(routings)
def test_switch_loss_value_and_gradient_match_reference(r):
    T, E, K, seed, drop_p = r
    K = min(K, E)
    probs = _probs_TE(T, E, seed).requires_grad_()
    idx = _idx_TK(T, K, E, seed, drop_p)
    loss = load_balancing_loss(probs, idx, E)
    ref, f = _ref_loss(probs.detach(), idx, E)
    assert loss.item() == pytest.approx(ref, rel=1e-5, abs=1e-6)
    loss.backward()
    # f is a count: the gradient flows through the probabilities only, d/dP[t, e] = E * f_e / T
    expected = torch.tensor(f, dtype=torch.float32).mul(E / T).expand(T, E)
    torch.testing.assert_close(probs.grad, expected, rtol=1e-5, atol=1e-7)


@given(routings)
def test_switch_loss_with_uniform_probs_is_the_kept_fraction(r):
    T, E, K, seed, drop_p = r
    K = min(K, E)
    idx = _idx_TK(T, K, E, seed, drop_p)
    loss = load_balancing_loss(torch.full((T, E), 1.0 / E), idx, E)
    assert float(loss) == pytest.approx(float((idx >= 0).float().mean()), rel=1e-5)


@given(B=st.integers(1, 4), S=st.integers(1, 6), E=st.integers(1, 6), K=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_sequence_loss_is_the_mean_of_per_sequence_losses(B, S, E, K, seed):
    K = min(K, E)
    T = B * S
    probs = _probs_TE(T, E, seed)
    idx = _idx_TK(T, K, E, seed, 0.2)
    got = sequence_load_balancing_loss(probs, idx, E, S)
    per_seq = [load_balancing_loss(probs[b * S : (b + 1) * S], idx[b * S : (b + 1) * S], E) for b in range(B)]
    assert float(got) == pytest.approx(float(torch.stack(per_seq).mean()), rel=1e-5, abs=1e-7)
    whole = sequence_load_balancing_loss(probs, idx, E, T)
    assert float(whole) == pytest.approx(float(load_balancing_loss(probs, idx, E)), rel=1e-6)


@given(T=st.integers(1, 10), E=st.integers(1, 8), scale=st.sampled_from([0.1, 3.0, 50.0]), seed=st.integers(0, 2**16))
def test_z_loss_is_mean_squared_logsumexp(T, E, scale, seed):
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(T, E, generator=g, dtype=torch.float64)
    ref = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / T
    got = router_z_loss(logits.float())
    assert got.dtype == torch.float32
    assert float(got) == pytest.approx(ref, rel=1e-5)


def test_z_loss_is_finite_for_large_logits_and_differentiable():
    logits = torch.tensor([[1.0e4, -1.0e4, 0.0], [200.0, 200.0, 200.0]], requires_grad=True)
    loss = router_z_loss(logits)
    ref = (1.0e4**2 + (200.0 + math.log(3.0)) ** 2) / 2
    assert loss.item() == pytest.approx(ref, rel=1e-6)
    loss.backward()
    assert torch.isfinite(logits.grad).all()


def test_empty_batch_gives_zero_losses_that_backpropagate():
    probs = torch.zeros(0, 4, requires_grad=True)
    idx = torch.zeros(0, 2, dtype=torch.long)
    losses = [
        load_balancing_loss(probs, idx, 4),
        sequence_load_balancing_loss(probs, idx, 4, 3),
        router_z_loss(probs),
    ]
    for loss in losses:
        assert loss.dim() == 0 and loss.item() == 0.0
        loss.backward()


def test_bf16_probs_are_computed_in_fp32():
    probs = _probs_TE(6, 4, 0)
    idx = _idx_TK(6, 2, 4, 0)
    got = load_balancing_loss(probs.bfloat16(), idx, 4)
    assert got.dtype == torch.float32
    assert float(got) == pytest.approx(float(load_balancing_loss(probs.bfloat16().float(), idx, 4)))


_P = torch.full((4, 3), 1 / 3)
_I = torch.zeros(4, 1, dtype=torch.long)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: load_balancing_loss(_P[0], _I, 3), r"probs_TE must be a floating \(T, E\).*got shape \(3,\)"),
        (lambda: load_balancing_loss(_P.long(), _I, 3), r"probs_TE must be a floating.*int64"),
        (lambda: load_balancing_loss(_P, _I, 5), r"probs_TE must have E = num_experts = 5.*\(4, 3\)"),
        (
            lambda: load_balancing_loss(_P, _I[:3], 3),
            r"expert_idx_TK must have the same T as probs_TE \(T = 4\).*\(3, 1\)",
        ),
        (lambda: load_balancing_loss(_P, _I.float(), 3), r"expert_idx_TK must be an integer.*float32"),
        (lambda: load_balancing_loss(_P, _I[:, 0], 3), r"expert_idx_TK must be an integer \(T, K\).*\(4,\)"),
        (lambda: load_balancing_loss(_P, _I, 0), r"num_experts must be an int >= 1, got 0"),
        (lambda: sequence_load_balancing_loss(_P, _I, 3, 3), r"seq_len must divide .* T = 4, got seq_len = 3"),
        (lambda: sequence_load_balancing_loss(_P, _I, 3, 0), r"seq_len must be an int >= 1, got 0"),
        (lambda: router_z_loss(_P[0]), r"logits_TE must be a floating \(T, E\).*\(3,\)"),
        (lambda: router_z_loss(_I), r"logits_TE must be a floating.*int64"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
