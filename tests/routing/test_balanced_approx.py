"""The sync-free balanced assignment: exact balance for every input, near-optimal, and not one
value read back on the host."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moe.routing import assignment_score, balanced_assignment, balanced_assignment_approx

from ..host_reads import HostReads
from .test_balanced import DTYPES, KINDS, check_feasible, greedy_with_capacity, make_scores


@given(
    st.integers(0, 2**31 - 1), st.integers(1, 40), st.integers(1, 9), st.sampled_from(KINDS), st.sampled_from(DTYPES)
)
def test_exactly_balanced_and_reads_nothing(seed, t, e, kind, dtype):
    scores = make_scores(seed, t, e, kind, dtype)
    with HostReads(scores) as seen:
        idx = balanced_assignment_approx(scores)
    assert seen.reads == []
    check_feasible(idx, t, e, 1)


@pytest.mark.parametrize("kind", ["gauss", "one_expert"])
def test_near_the_optimum_and_above_greedy(kind):
    scores = make_scores(3, 1024, 16, kind, torch.float32)
    best = float(assignment_score(scores, balanced_assignment(scores)))
    got = float(assignment_score(scores, balanced_assignment_approx(scores)))
    assert got >= greedy_with_capacity(scores)
    assert best - got <= 0.01 * abs(best), (best, got)


@given(st.integers(0, 2**31 - 1), st.integers(1, 8), st.integers(1, 6))
def test_balanced_strict_argmax_is_kept(seed, e, per_expert):
    g = torch.Generator().manual_seed(seed)
    t = e * per_expert
    target = torch.randperm(t, generator=g) % e  # each expert wanted by exactly T/E tokens
    scores = torch.rand(t, e, generator=g)
    scores[torch.arange(t), target] += 1.5
    assert torch.equal(balanced_assignment_approx(scores)[:, 0], target)


def test_nan_input_still_gives_a_balanced_assignment():
    scores = torch.randn(50, 4)
    scores[3, 1] = float("nan")
    scores[7] = float("inf")
    check_feasible(balanced_assignment_approx(scores), 50, 4, 1)


def test_deterministic_and_empty():
    scores = torch.randn(500, 8)
    assert torch.equal(balanced_assignment_approx(scores), balanced_assignment_approx(scores.clone()))
    assert balanced_assignment_approx(torch.zeros(0, 3)).shape == (0, 1)


@pytest.mark.parametrize(
    "scores, k, options, match",
    [
        (torch.zeros(4, 3), 2, {}, "k=1 only"),
        (torch.zeros(4, 3), 4, {}, "k must be"),
        (torch.zeros(3), 1, {}, r"shape \(T, E\)"),
        (torch.zeros(4, 3, dtype=torch.int64), 1, {}, "floating-point"),
        (torch.zeros(4, 3), 1, {"max_iters": -1}, "max_iters"),
        (torch.zeros(4, 3), 1, {"eps": 0.0}, "eps"),
    ],
)
def test_bad_input_raises(scores, k, options, match):
    with pytest.raises(ValueError, match=match):
        balanced_assignment_approx(scores, k, **options)
