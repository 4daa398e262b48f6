"""Properties of the exact-balance assignment, against scipy's exact solvers."""

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from scipy.optimize import linear_sum_assignment, linprog

from moe.routing import (
    assignment_bound,
    assignment_score,
    balanced_assignment,
    balanced_assignment_approx,
    balanced_assignment_ref,
    exchange,
    expert_capacities,
    release_work_buffers,
)
from moe.routing.balanced import (
    _Capacities,
    _fill,
    _keep_best_device,
    _keep_best_host,
    _normalise,
    _pair_layout,
    _pair_layout_host,
    _Pairs,
    _Work,
    balanced_prices,
)
from moe.routing.balanced import exact as exact_module
from moe.routing.balanced.small import _top2_host
from moe.routing.exchange import cancel_cycles, keep_top_claims

KINDS = ("gauss", "int", "one_expert", "huge", "tiny", "equal")


def on_torch_ops(scores: torch.Tensor, k: int = 1, **options) -> torch.Tensor:
    """`balanced_assignment` with every problem on its torch ops: small K = 1 CPU problems take
    the numpy path (`moe.routing.balanced.small`) otherwise, so both paths meet each property."""
    with mock.patch.object(exact_module, "SMALL", 0):
        return balanced_assignment(scores, k, **options)


EXACT = [balanced_assignment, on_torch_ops]


def make_scores(seed: int, t: int, e: int, kind: str, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, e, generator=g, dtype=torch.float64)
    if kind == "int":  # many exact ties
        x = torch.randint(-2, 3, (t, e), generator=g).double()
    elif kind == "one_expert":  # every token prefers expert 0
        x[:, 0] += 10.0
    elif kind == "huge":
        x = x * 1e6
    elif kind == "tiny":
        x = x * 1e-6
    elif kind == "equal":
        x = torch.zeros(t, e, dtype=torch.float64)
    return x.to(dtype)


def optimum(scores: torch.Tensor, k: int, extras: str = "best") -> float:
    """Exact optimum: Hungarian on the expanded matrix for k = 1, the (integral) LP otherwise.

    ``extras="lowest"``: loads ``expert_capacities``. ``"best"``: any loads of b = T*K // E or
    b + 1, so r = T*K % E experts take b + 1. For k = 1 each expert has b mandatory slots (columns)
    and one optional one, and E - r dummy rows, which score 0 on the optional slots and can take
    nothing else, leave exactly E - r optional slots unused. For k > 1 the LP bounds each load
    between b and b + 1 (the constraint matrix stays totally unimodular)."""
    t, e = scores.shape
    base, spare = divmod(t * k, e)
    cap = expert_capacities(t, e, k).numpy()
    s = scores.double().numpy()
    scale = float(np.abs(s).max()) or 1.0  # the LP solver's tolerances are absolute
    s = s / scale
    movable = extras == "best" and spare > 0
    if k == 1:
        if movable:
            cols = np.concatenate([np.repeat(np.arange(e), base), np.arange(e)])
            dummy = np.full((e - spare, cols.size), -1e6)  # far below any real choice: never taken
            dummy[:, base * e :] = 0.0
            m = np.vstack([s[:, cols], dummy])
        else:
            m = s[:, np.repeat(np.arange(e), cap)]
        r, c = linear_sum_assignment(m, maximize=True)
        return float(m[r, c].sum()) * scale
    a_rows = np.kron(np.eye(t), np.ones((1, e)))  # each token: k experts
    a_cols = np.kron(np.ones((1, t)), np.eye(e))  # each expert: cap tokens
    if movable:  # base <= load <= base + 1
        res = linprog(
            -s.ravel(),
            A_ub=np.vstack([a_cols, -a_cols]),
            b_ub=np.concatenate([np.full(e, base + 1), np.full(e, -base)]),
            A_eq=a_rows,
            b_eq=np.full(t, k),
            bounds=(0, 1),
        )
    else:
        res = linprog(
            -s.ravel(), A_eq=np.vstack([a_rows, a_cols]), b_eq=np.concatenate([np.full(t, k), cap]), bounds=(0, 1)
        )
    assert res.status == 0
    return float(-res.fun) * scale


def check_feasible(idx: torch.Tensor, t: int, e: int, k: int, extras: str = "best") -> None:
    """K distinct experts per token; loads `expert_capacities` (``"lowest"``) or, for
    ``"best"``, b = T*K // E everywhere but r = T*K % E experts at b + 1."""
    assert idx.shape == (t, k) and idx.dtype == torch.int64
    assert ((idx >= 0) & (idx < e)).all()
    assert (idx.sort(dim=1).values.diff(dim=1) != 0).all(), "a token got the same expert twice"
    loads = torch.bincount(idx.flatten(), minlength=e)
    if extras == "lowest":
        assert torch.equal(loads, expert_capacities(t, e, k))
    else:
        assert torch.equal(loads.sort(descending=True).values, expert_capacities(t, e, k)), loads


def greedy_with_capacity(scores: torch.Tensor) -> float:
    """k = 1: pairs in decreasing score, taken while the token is free and the expert has room."""
    t, e = scores.shape
    room = expert_capacities(t, e, 1).tolist()
    free = [True] * t
    total = 0.0
    for flat in torch.argsort(scores.flatten(), descending=True, stable=True).tolist():
        i, j = divmod(flat, e)
        if free[i] and room[j] > 0:
            free[i], room[j] = False, room[j] - 1
            total += float(scores[i, j])
    return total


DTYPES = (torch.float64, torch.float32, torch.bfloat16)


@st.composite
def problems(draw):
    """(scores, k): sizes 1..24 x 1..8 with k anywhere in [1, E], every score kind and dtype."""
    t, e = draw(st.integers(1, 24)), draw(st.integers(1, 8))
    scores = make_scores(
        draw(st.integers(0, 2**31 - 1)), t, e, draw(st.sampled_from(KINDS)), draw(st.sampled_from(DTYPES))
    )
    if draw(st.booleans()):  # a non-contiguous view with the same values
        scores = scores.T.contiguous().T
    return scores, draw(st.integers(1, e))


def tolerance(scores: torch.Tensor, k: int) -> float:
    # stated bound: (2 * T * K + E) * eps * R, eps = 1e-6 by default and R <= the whole score
    # range (2 * T * K * eps * R for fixed loads: the E is the holder of the unused extra slots)
    scores = scores.double()
    rng = float(scores.max() - scores.min()) if scores.numel() else 0.0
    return (2 * scores.shape[0] * k + scores.shape[1]) * 1e-6 * rng + 1e-9 * (1 + float(scores.abs().sum()))


@pytest.mark.parametrize("solve", EXACT)
@pytest.mark.parametrize("extras", ["best", "lowest"])
@given(problem=problems())
def test_balanced_feasible_and_optimal(solve, extras, problem):
    scores, k = problem
    t, e = scores.shape
    idx = solve(scores, k, extras=extras)
    check_feasible(idx, t, e, k, extras)
    opt = optimum(scores, k, extras)
    got = float(assignment_score(scores, idx))
    assert abs(got - opt) <= tolerance(scores, k)
    if k == 1:
        assert got >= greedy_with_capacity(scores) - tolerance(scores, k)


@pytest.mark.parametrize("extras", ["best", "lowest"])
@given(problem=problems())
def test_reference_is_optimal(extras, problem):
    scores, k = problem
    t, e = scores.shape
    idx = balanced_assignment_ref(scores, k, extras=extras)
    check_feasible(idx, t, e, k, extras)
    assert abs(float(assignment_score(scores, idx)) - optimum(scores, k, extras)) <= tolerance(scores, k)


@pytest.mark.parametrize("extras", ["best", "lowest"])
@given(
    problem=problems(),
    seed=st.integers(0, 2**31 - 1),
    spread=st.sampled_from([0.0, 0.1, 10.0]),
    block=st.integers(1, 30),
)
def test_assignment_bound_is_never_below_the_optimum(extras, problem, seed, spread, block):
    """Weak duality: under any prices the bound is at least the best balanced total (scipy's),
    and reading the scores in blocks of any size gives the same bound."""
    scores, k = problem
    t, e = scores.shape
    size = float(scores.double().abs().max()) or 1.0
    prices = torch.randn(e, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * spread * size
    upper = float(assignment_bound(scores, prices, k, extras=extras, block=block))
    slack = 1e-7 * (1.0 + float(scores.double().abs().sum()) + t * k * float(prices.abs().max()))
    assert upper >= optimum(scores, k, extras) - slack
    assert upper == pytest.approx(float(assignment_bound(scores, prices, k, extras=extras)), rel=1e-12, abs=slack)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((torch.zeros(4, 3), torch.zeros(2)), {}, "prices_E must be a tensor of shape \\(E=3,\\)"),
        ((torch.zeros(4), torch.zeros(4)), {}, "scores_TE must have shape \\(T, E\\)"),
        ((torch.zeros(4, 3, dtype=torch.long), torch.zeros(3)), {}, "scores_TE must be a floating-point"),
        ((torch.zeros(4, 3), torch.zeros(3), 4), {}, "k must be an int in \\[1, E=3\\]"),
        ((torch.zeros(4, 3), torch.zeros(3)), {"block": 0}, "block must be an int >= 1"),
        ((torch.zeros(4, 3), torch.zeros(3)), {"extras": "most"}, "extras must be one of"),
    ],
)
def test_assignment_bound_refuses_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        assignment_bound(*args, **kwargs)


@pytest.mark.parametrize("solve", EXACT)
@given(st.integers(0, 2**31 - 1), st.integers(1, 24), st.integers(1, 8), st.sampled_from(KINDS), st.floats(0.1, 100.0))
@example(seed=382, t=21, e=8, kind="int", scale=1.0)  # K = 7 of 8: the fill's exchanges move complete tokens
def test_objective_invariances(solve, seed, t, e, kind, scale):
    # under extras="best" a per-expert constant changes which experts the extra slots suit: the
    # loads are fixed here so that the objective moves by exactly that constant times them
    scores = make_scores(seed, t, e, kind)
    k = 1 + seed % e
    base = float(assignment_score(scores, solve(scores, k, extras="lowest")))
    g = torch.Generator().manual_seed(seed + 1)
    tok_c = torch.randn(t, 1, generator=g, dtype=torch.float64) * 5
    exp_c = torch.randn(1, e, generator=g, dtype=torch.float64) * 5
    cap = expert_capacities(t, e, k).double()
    cases = [
        (scores + tok_c, base + k * float(tok_c.sum()), 1.0),  # per-token constant
        (scores + exp_c, base + float((exp_c[0] * cap).sum()), 1.0),  # per-expert constant
        (scores * scale, base * scale, scale),  # positive scaling
        (scores[torch.randperm(t, generator=g)], base, 1.0),  # token permutation
    ]
    for moved, expected, factor in cases:
        got = float(assignment_score(moved, solve(moved, k, extras="lowest")))
        # both solves are within the stated bound of their optimum, each on its own input
        assert abs(got - expected) <= tolerance(moved, k) + factor * tolerance(scores, k)


@pytest.mark.parametrize("solve", EXACT)
@given(st.integers(0, 2**31 - 1), st.integers(1, 16), st.integers(2, 6))
def test_matches_reference_exactly_on_continuous_scores(solve, seed, t, e):
    # continuous scores have a unique optimum almost surely: the indices must agree, not just the total
    scores = make_scores(seed, t, e, "gauss")
    k = 1 + seed % (e - 1)
    fast, ref = solve(scores, k), balanced_assignment_ref(scores, k)
    assert torch.equal(fast.sort(dim=1).values, ref.sort(dim=1).values)


@pytest.mark.parametrize("solver", [*EXACT, balanced_assignment_approx])
@given(st.integers(0, 2**31 - 1), st.integers(1, 8), st.integers(1, 6))
def test_balanced_strict_argmax_is_kept(solver, seed, e, per_expert):
    g = torch.Generator().manual_seed(seed)
    t = e * per_expert
    target = torch.randperm(t, generator=g) % e  # each expert wanted by exactly T/E tokens
    scores = torch.rand(t, e, generator=g)
    scores[torch.arange(t), target] += 1.5  # strict argmax
    assert torch.equal(solver(scores, 1)[:, 0], target)


def test_extra_slots_go_to_the_experts_that_score_best():
    # T=5, E=8: five experts take one token each. Every token prefers one of experts 3..7; giving
    # the slots to experts 0..4 (the fixed rule) forces three tokens onto experts they score 0.
    scores = torch.zeros(5, 8)
    scores[torch.arange(5), torch.arange(3, 8)] = 1.0
    for solver in (balanced_assignment, balanced_assignment_ref, balanced_assignment_approx):
        assert solver(scores)[:, 0].tolist() == [3, 4, 5, 6, 7], solver.__name__
        lowest = solver(scores, extras="lowest")
        check_feasible(lowest, 5, 8, 1, "lowest")
        assert float(assignment_score(scores, lowest)) == 2.0  # tokens 0 and 1 keep experts 3 and 4


@pytest.mark.parametrize("solve", EXACT)
@given(st.integers(0, 2**31 - 1), st.integers(1, 40), st.integers(2, 9), st.sampled_from(KINDS))
def test_best_extras_never_score_below_the_fixed_rule(solve, seed, t, e, kind):
    scores = make_scores(seed, t, e, kind)
    k = 1 + seed % e
    best = solve(scores, k)
    lowest = solve(scores, k, extras="lowest")
    check_feasible(best, t, e, k, "best")
    check_feasible(lowest, t, e, k, "lowest")
    gain = float(assignment_score(scores, best)) - float(assignment_score(scores, lowest))
    assert gain >= -tolerance(scores, k)
    if (t * k) % e == 0:  # nothing to choose: the same solve
        assert torch.equal(best, lowest)


@pytest.mark.parametrize("t, e, k", [(1000, 64, 1), (999, 16, 3), (4000, 64, 1)])
def test_best_extras_match_the_optimum_with_optional_slots_at_scale(t, e, k):
    g = torch.Generator().manual_seed(t + e)
    scores = torch.randn(t, e, generator=g)
    if k == 1:
        scores[:, : e // 8] += 1.0  # some experts in demand: the extra slots matter
    idx = balanced_assignment(scores, k)
    check_feasible(idx, t, e, k)
    assert float(assignment_score(scores, idx)) == pytest.approx(optimum(scores, k), rel=1e-6)


def test_movable_cycles_need_loads_within_one_of_the_mean():
    s_ET = torch.zeros(3, 4, dtype=torch.float64)
    out = torch.tensor([[0], [0], [0], [1]])  # loads 3, 1, 0 of a mean of 4 / 3
    with pytest.raises(ValueError, match="loads of 1 or 2"):
        cancel_cycles(s_ET, out, max_cycles=10, delta=1e-9, movable=True)


@pytest.mark.parametrize("solver", [balanced_assignment, balanced_assignment_approx, balanced_assignment_ref])
def test_unknown_extras_rule_is_refused(solver):
    with pytest.raises(ValueError, match="extras must be one of"):
        solver(torch.randn(5, 3), 1, extras="first")


@pytest.mark.parametrize(
    "args, match",
    [
        ((10.5, 4), "num_tokens must be an int, got 10.5"),
        ((10, 4.0), "num_experts must be an int"),
        ((10, 4, 1.0), "k must be an int"),
        ((True, 4), "num_tokens must be an int, got True"),
        ((10, 4, True), "k must be an int"),
        ((10, 4, 5), r"k must be in \[1, num_experts=4\]"),
        ((10, 4, 0), r"k must be in \[1, num_experts=4\]"),
        ((-1, 4), "num_tokens must be >= 0"),
        ((10, 0), "num_experts must be >= 1"),
    ],
)
def test_capacities_refuse_what_no_assignment_has(args, match):
    with pytest.raises(ValueError, match=match):
        expert_capacities(*args)


def test_capacities_never_exceed_the_tokens():
    for t in range(0, 12):
        for e in range(1, 7):
            for k in range(1, e + 1):
                cap = expert_capacities(t, e, k)
                assert int(cap.sum()) == t * k and int(cap.max()) <= t
    assert expert_capacities(np.int64(10), 4).tolist() == [3, 3, 2, 2]  # numpy ints are ints


@pytest.mark.parametrize("solve", EXACT)
def test_fairseq_tie_example_is_optimal(solve):
    scores = torch.tensor([[2.0, 0, 2], [0, 1, 0], [1, 2, 2]])
    assert float(assignment_score(scores, solve(scores))) == 5.0
    assert float(assignment_score(scores, balanced_assignment_ref(scores))) == 5.0


@pytest.mark.parametrize("solve", EXACT)
def test_capacity_rule_and_awkward_sizes(solve):
    assert expert_capacities(10, 4, 1).tolist() == [3, 3, 2, 2]
    assert expert_capacities(3, 8, 2).tolist() == [1, 1, 1, 1, 1, 1, 0, 0]
    g = torch.Generator().manual_seed(3)
    for t, e, k in [(1, 1, 1), (1, 5, 1), (1, 5, 5), (3, 8, 2), (7, 3, 3), (37, 5, 2), (2, 64, 1), (9, 6, 5)]:
        idx = solve(torch.randn(t, e, generator=g), k)
        check_feasible(idx, t, e, k)
    assert solve(torch.randn(0, 4), 2).shape == (0, 2)


@pytest.mark.parametrize("solve", EXACT)
@pytest.mark.parametrize("k", [1, 2])  # K = 1 takes the numpy path at this size, unless on the torch ops
def test_deterministic(solve, k):
    scores = make_scores(7, 300, 6, "int", torch.float32)  # many exact ties
    first = solve(scores, k)
    assert torch.equal(first, solve(scores.clone(), k))
    assert torch.equal(first, solve(scores.T.contiguous().T, k))


@pytest.mark.parametrize("k", [1, 2])
def test_solves_reuse_their_work_buffers_without_sharing_results(k):
    """On CPU a solve keeps its work buffers for the thread's next solve of the same shape:
    the exact solver (in inference mode) and the approximate one (outside it) must both be
    able to use them, and no result may alias them."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(96, 8, generator=g), torch.randn(96, 8, generator=g)
    first = balanced_assignment(x, k)
    kept = first.clone()
    held = balanced_workspace_ptr()
    approx = balanced_assignment_approx(y, k)
    second = balanced_assignment(y, k)
    assert balanced_workspace_ptr() == held  # the same allocation served all three
    assert torch.equal(first, kept)
    assert torch.equal(balanced_assignment(x, k), kept)
    check_feasible(approx, 96, 8, k)
    check_feasible(second, 96, 8, k)
    assert float(assignment_score(y, second)) >= float(assignment_score(y, approx)) - 1e-9
    release_work_buffers()
    assert balanced_workspace_ptr() is None
    assert torch.equal(balanced_assignment(x, k), kept)  # new buffers, same answer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_tiled_transposing_normalise_equals_one_pass(monkeypatch, dtype):
    """Large inputs are normalised in blocks of tokens read transposed (`_sub_transposed`); with
    blocks forced small, a ragged last one included, the result and the solve must not change."""
    import moe.routing.balanced.inputs as inputs

    scores = make_scores(7, 203, 12, "gauss", dtype)
    whole = _normalise(scores, jitter=1e-6)
    expected = balanced_assignment(scores, 2)
    monkeypatch.setattr(inputs, "_TILE_BYTES", 16 * 12 * scores.element_size())  # blocks of 16 tokens
    assert torch.equal(_normalise(scores, jitter=1e-6), whole)
    out = torch.empty(12, 203, dtype=torch.promote_types(dtype, torch.float32))
    hi = scores.amax(dim=1).to(out.dtype)
    assert torch.equal(inputs._sub_transposed(scores, hi, out), scores.T.to(out.dtype) - hi)
    release_work_buffers()
    assert torch.equal(balanced_assignment(scores, 2), expected)


def balanced_workspace_ptr() -> int | None:
    from moe.routing.balanced import _workspace

    held = getattr(_workspace, "held", None)
    return None if held is None else held[1][0].data_ptr()


def test_result_is_an_ordinary_tensor_autograd_can_save():
    """The solver runs in inference mode; its result must still index in a graph that is
    differentiated (an inference tensor cannot be saved for backward)."""
    scores = torch.randn(64, 8, dtype=torch.float64, requires_grad=True)
    idx = balanced_assignment(scores, 2)
    assert not idx.is_inference()
    scores.gather(1, idx).sum().backward()
    assert torch.equal(scores.grad.count_nonzero(dim=1), torch.full((64,), 2))


@pytest.mark.parametrize("solve", EXACT)
def test_huge_finite_scores(solve):
    scores = torch.tensor([[3e38, -3e38], [-3e38, 3e38]])
    assert solve(scores).flatten().tolist() == [0, 1]
    big = torch.tensor([[-1e308, 1e308], [1e308, -1e308]], dtype=torch.float64)
    assert balanced_assignment_ref(big).flatten().tolist() == [1, 0]
    assert solve(big).flatten().tolist() == [1, 0]


@pytest.mark.parametrize("solve", EXACT)
def test_tiny_finite_scores(solve):
    # ranges whose reciprocal overflows the dtype, and subnormal ones
    for value, dtype in ((1e-39, torch.float32), (1e-44, torch.float32), (1e-310, torch.float64)):
        scores = torch.tensor([[value, 0.0], [0.0, value]], dtype=dtype)
        assert solve(scores).flatten().tolist() == [0, 1]
        assert solve(-scores).flatten().tolist() == [1, 0]


@pytest.mark.parametrize("solve", EXACT)
def test_float32_with_many_cycles_reaches_the_optimum(solve):
    # no price updates: the exchange cycles do all the work, in float32
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(512, 16, generator=g)
    scores[:, :2] += 2.0
    for k in (1, 2):
        idx = solve(scores, k, max_iters=0)
        check_feasible(idx, 512, 16, k)
        assert float(assignment_score(scores, idx)) == pytest.approx(optimum(scores, k), rel=1e-5)


@pytest.mark.parametrize("solve", EXACT)
def test_tie_heavy_scores_at_scale_reach_the_optimum(solve):
    # integer scores in {0, 1, 2}: prices alone cannot split tied tokens
    g = torch.Generator().manual_seed(0)
    for t, k in ((2048, 1), (512, 2)):
        scores = torch.randint(0, 3, (t, 8), generator=g).double()
        idx = solve(scores, k)
        check_feasible(idx, t, 8, k)
        assert float(assignment_score(scores, idx)) == optimum(scores, k)
    # half the tokens identical, as zero (padding) embeddings give a BASE router
    scores = torch.randn(512, 16, generator=g)
    scores[::2] = scores[0]
    idx = solve(scores, 4)
    check_feasible(idx, 512, 16, 4)
    assert float(assignment_score(scores, idx)) == pytest.approx(optimum(scores, 4), rel=1e-6)
    idx = solve(torch.zeros(2048, 32), 6)  # every row tied
    check_feasible(idx, 2048, 32, 6)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # the certificate must pass within the default budget
def test_certificate_passes_on_tie_heavy_scores_by_default():
    g = torch.Generator().manual_seed(0)
    check_feasible(balanced_assignment(torch.randint(0, 3, (4096, 8), generator=g).double(), 2), 4096, 8, 2)
    scores = torch.randn(4096, 64, generator=g)
    scores[::2] = scores[0]
    check_feasible(balanced_assignment(scores, 8), 4096, 64, 8)


@pytest.mark.parametrize("solve", EXACT)
def test_larger_problem_matches_exact_optimum(solve):
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(512, 16, generator=g)
    for k in (1, 2):
        idx = solve(scores, k)
        check_feasible(idx, 512, 16, k)
        assert float(assignment_score(scores, idx)) == pytest.approx(optimum(scores, k), rel=1e-6)


@pytest.mark.parametrize("solve", EXACT)
def test_budget_exhausted_still_balanced_and_warns(solve):
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(300, 7, generator=g)
    scores[:, 2] += 3.0
    for k in (1, 3):
        with pytest.warns(RuntimeWarning, match="max_cycles=0"):
            idx = solve(scores, k, max_iters=0, max_cycles=0)
        check_feasible(idx, 300, 7, k)


def test_fill_exchanges_when_every_open_expert_is_held():
    # token 0 holds expert 0 and needs one more; only expert 0 has room: someone must move
    scores = torch.zeros(3, 3)
    out = torch.tensor([[0, -1], [1, 2], [1, 2]])
    _fill(scores.T.contiguous(), out, expert_capacities(3, 3, 2))
    check_feasible(out, 3, 3, 2)


def _fill_passes_whole(s_EN, out_NK, deficit_E, p_E):
    """The greedy passes over every short token at once, as one (N, E) array: the oracle of the
    block-wise `fill_passes`."""
    num_experts = s_EN.shape[0]
    a = s_EN.T - p_E[None]
    while True:
        short = (out_NK < 0).any(axis=1).nonzero()[0]
        if short.size == 0:
            return
        held = np.zeros((short.size, num_experts + 1), dtype=bool)
        held[np.arange(short.size)[:, None], out_NK[short]] = True
        sub = np.where(~held[:, :num_experts] & (deficit_E > 0)[None], a[short], -np.inf)
        best = sub.argmax(axis=1)
        rows = np.arange(short.size)
        top = sub[rows, best]
        sub[rows, best] = -np.inf
        ok = np.flatnonzero(np.isfinite(top))
        if ok.size == 0:
            return
        win = ok[keep_top_claims(best[ok], top[ok] - sub[ok].max(axis=1), deficit_E)]
        tok = short[win]
        out_NK[tok, (out_NK[tok] < 0).argmax(axis=1)] = best[win]
        deficit_E -= np.bincount(best[win], minlength=num_experts)


@given(
    n=st.integers(1, 40), e=st.integers(2, 9), k=st.integers(1, 3), block=st.integers(1, 50),
    ints=st.booleans(), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_fill_passes_by_blocks_equal_the_whole_passes(n, e, k, block, ints, seed):
    """The fill's passes read ``s - p`` a block of tokens at a time (at most ``FILL_BLOCK`` values):
    the same slots and deficits as the passes over the whole (N, E) at once, float32 scores
    against float64 prices as their float64 copy, ties (integer scores) included."""
    k = min(k, e)
    rng = np.random.default_rng(seed)
    s = rng.integers(0, 3, (e, n)).astype(np.float32) if ints else rng.standard_normal((e, n)).astype(np.float32)
    p = rng.standard_normal(e).round(1)
    out = np.full((n, k), -1, dtype=np.int64)
    for i in range(n):  # some tokens hold some experts already
        held = rng.permutation(e)[: rng.integers(0, k + 1)]
        out[i, : held.size] = held
    deficit = np.full(e, -(-int((out < 0).sum()) // e) + 1) - rng.integers(0, 2, e)
    want_out, want_def = out.copy(), deficit.copy()
    _fill_passes_whole(s.astype(np.float64), want_out, want_def, p)
    with mock.patch.object(exchange, "FILL_BLOCK", block):
        exchange.fill_passes(s, out, deficit, p)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(deficit, want_def)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fill_reads_the_short_tokens_columns(dtype):
    """`_fill` passes only the short tokens' scores to the passes (all of them, uncopied, when
    every token is short), in any float dtype: the slots the whole passes give those columns."""
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(5, 60, generator=g).to(dtype)  # (E, T)
    p = torch.randn(5, generator=g, dtype=torch.float64)
    cap = expert_capacities(60, 5, 1)
    for held in (30, 0):  # half the tokens already placed (by cycling experts), then none
        out = torch.full((60, 1), -1, dtype=torch.int64)
        out[:held, 0] = torch.arange(held) % 5
        short = (out[:, 0] < 0).nonzero().flatten().numpy()
        want = out.numpy().copy()
        sub = want[short]
        deficit = cap.numpy() - np.bincount(want[want >= 0], minlength=5)
        _fill_passes_whole(scores.double().numpy()[:, short], sub, deficit, p.numpy())
        want[short] = sub
        _fill(scores, out, cap, p)
        np.testing.assert_array_equal(out.numpy(), want)


def test_pair_margins_stay_lower_bounds_after_the_prices_move():
    # The certificate trusts these margins. A pair left out under p0 was `width` below its
    # token's best; when its expert's price then falls by 0.9 width (within what the pairs
    # allow), it can come within 0.1 width of the best, and the margin must say so.
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(512, 16, generator=g, dtype=torch.float64) * torch.linspace(0.2, 3.0, 16, dtype=torch.float64)
    work = _Work(scores, sync_ok=True)
    s = _normalise(scores, jitter=0.0)
    cap = expert_capacities(512, 16, 1)
    width = 0.05
    pairs = _Pairs(s, s.new_zeros(16, 1), width, _Capacities(512, 16, 1, "lowest", s.device), work)
    p = s.new_zeros(16, 1)
    p[::2] -= 0.9 * width  # every other expert's price falls
    picked = pairs.select(p, cap)
    assert picked is not None
    idx, margin = picked
    top = (s - p).topk(2, dim=0).values
    kept = idx[:, 0] >= 0
    assert torch.equal(idx[kept, 0], (s - p).argmax(dim=0)[kept])
    assert bool((margin <= top[0] - top[1] + 1e-12).all())


@pytest.mark.parametrize("seed", range(4))
def test_keep_best_on_the_host_matches_the_device_ops(seed):
    # The CPU solve keeps each full expert's best tokens in numpy, other devices in torch ops:
    # the two must agree, ties (coarse margins) going to the lowest token index.
    g = torch.Generator().manual_seed(seed)
    num_tokens, num_experts = 300, 7
    idx = torch.randint(0, num_experts, (num_tokens,), generator=g) ** 2 % num_experts  # uneven loads
    margin = torch.randint(0, 5, (num_tokens,), generator=g).double() / 4
    cap = expert_capacities(num_tokens, num_experts, 1)
    host = torch.from_numpy(_keep_best_host(idx.numpy(), margin.numpy(), cap.numpy()))
    assert torch.equal(host, _keep_best_device(idx, margin, cap))
    assert bool((torch.bincount(host[host >= 0], minlength=num_experts) <= cap).all())
    assert bool(((host == idx) | (host == -1)).all()) and bool((host == -1).any())


@pytest.mark.parametrize("num_tokens, num_experts", [(50, 7), (64, 8), (9, 4), (5, 8)])
def test_pair_layout_on_the_host_matches_the_device_ops(num_tokens, num_experts):
    # The pair table's layout is computed in numpy on CPU and in torch ops elsewhere.
    g = torch.Generator().manual_seed(num_tokens)
    keep = torch.rand(num_experts * num_tokens, generator=g) < 0.3
    keep[torch.arange(num_tokens) * num_experts % (num_experts * num_tokens)] = True
    keep[: num_tokens * 2] = False  # experts 0 and 1 have no pairs
    flat = torch.nonzero(keep).flatten()
    cap = expert_capacities(num_tokens, num_experts, 1)
    host, device = _pair_layout_host(flat, num_tokens, cap), _pair_layout(flat, num_tokens, cap)
    assert host[4] == device[4]
    for a, b in zip(host[:4], device[:4], strict=True):
        assert torch.equal(a, b)
    e_M, t_M, cell_M, pick, size = host
    assert torch.equal(e_M * num_tokens + t_M, flat)
    assert torch.equal(cell_M // size, e_M)  # each pair in its expert's row, from column 0
    count = torch.bincount(e_M, minlength=num_experts)
    assert torch.equal(cell_M % size, torch.cat([torch.arange(int(n)) for n in count]))
    assert size > max(int(count.max()), int(cap.max()))
    assert torch.equal(pick[:, 0], (size - cap).clamp(max=size - 1))  # experts taking no token: the last column


def test_pair_margin_is_zero_for_a_token_tied_at_its_best():
    # Token 0 scores experts 0 and 1 equally. Its margin must be 0, not the distance to its
    # third expert: the certificate skips a token whose margin exceeds the price change, and a
    # small price change can make the tied expert the better one.
    s_TE = torch.tensor([[0.0, 0.0, -0.5], [0.0, -0.3, -0.4], [-0.2, 0.0, -0.6], [-0.5, -0.4, 0.0]])
    cap = expert_capacities(4, 3, 1)
    p = torch.zeros(3, 1)
    caps = _Capacities(4, 3, 1, "lowest", p.device)
    picked = _Pairs(s_TE.T.contiguous(), p, 0.6, caps, _Work(s_TE, sync_ok=True)).select(p, cap)
    assert picked is not None
    idx, margin = picked
    assert idx[0, 0] == 0  # ties go to the lowest expert index
    assert margin[0] == 0
    assert margin[1:].tolist() == pytest.approx([0.3, 0.2, 0.4])


def test_certificate_with_a_basis_reads_the_tokens_the_price_change_reaches():
    # Two experts with scores x and 0: expert 0 should take the n largest x. The basis prices put
    # the boundary too low, so more than n tokens prefer expert 0; the excess, the ones that
    # prefer it most, wait at expert 1 as candidates, and every other token holds its best under
    # the basis. The cycles among the candidates cannot reach the optimum, and the tokens that
    # must move hold their best by far more than the band: only their distance to the price
    # change finds them.
    n = 50
    x = torch.linspace(-0.9, -0.1, 2 * n, dtype=torch.float64)
    s_ET = torch.stack([x, torch.zeros_like(x)])
    prices = torch.tensor([-0.7, 0.0], dtype=torch.float64)
    margin = (x - prices[0]).abs()
    prefer0 = torch.nonzero(x > prices[0]).flatten()
    excess = prefer0[n:]  # sorted by x: the largest
    out = (x <= prices[0]).long()[:, None]
    out[excess] = 1
    candidates = torch.nonzero((margin < 0.005) | (out[:, 0] != (x <= prices[0]).long())).flatten()
    optimum = float(x.sort().values[n:].sum())
    assert float(x[out[:, 0] == 0].sum()) < optimum - 1.0  # the start is far from the optimum
    assert cancel_cycles(s_ET, out, max_cycles=1000, delta=1e-9, candidates=candidates, basis=(prices, margin))
    assert torch.equal(torch.bincount(out[:, 0], minlength=2), torch.tensor([n, n]))
    assert float(x[out[:, 0] == 0].sum()) == pytest.approx(optimum, abs=1e-12)


@pytest.mark.parametrize(
    "scores, k, match",
    [
        (torch.tensor([[0.0, float("nan")]]), 1, "finite"),
        (torch.tensor([[0.0, float("inf")]]), 1, "finite"),
        (torch.zeros(3), 1, r"shape \(T, E\)"),
        (torch.zeros(2, 2, 2), 1, r"shape \(T, E\)"),
        (torch.zeros(4, 3), 4, "k must be"),
        (torch.zeros(4, 3), 0, "k must be"),
        (torch.zeros(4, 0), 1, "E >= 1"),
        (torch.zeros(4, 3, dtype=torch.int64), 1, "floating-point"),
    ],
)
def test_bad_input_raises(scores, k, match):
    with pytest.raises(ValueError, match=match):
        balanced_assignment(scores, k)
    with pytest.raises(ValueError, match=match):
        balanced_assignment_ref(scores, k)


@pytest.mark.parametrize(
    "option, match",
    [
        ({"max_iters": -1}, "max_iters"),
        ({"max_iters": 2.5}, "max_iters"),
        ({"max_iters": None}, "max_iters"),
        ({"max_cycles": -1}, "max_cycles"),
        ({"max_cycles": "3"}, "max_cycles"),
        ({"eps": 0.0}, "eps"),
        ({"eps": float("nan")}, "eps"),
        ({"eps": float("inf")}, "eps"),
        ({"eps": -1e-6}, "eps"),
    ],
)
def test_bad_options_raise(option, match):
    with pytest.raises(ValueError, match=match):
        balanced_assignment(torch.zeros(4, 2), **option)


def test_reference_handles_empty_input():
    assert balanced_assignment_ref(torch.zeros(0, 3), 2).shape == (0, 2)
    with pytest.raises(ValueError, match="eps"):
        balanced_assignment_ref(torch.zeros(2, 2), eps=0.0)


@pytest.mark.parametrize(("t", "e", "k"), [(0, 3, 1), (7, 3, 2), (10, 5, 5), (1, 8, 1)])
def test_capacities_on_the_host_equal_the_tensor(t, e, k):
    from moe.routing import expert_capacities_list

    assert expert_capacities_list(t, e, k) == expert_capacities(t, e, k).tolist()
    with pytest.raises(ValueError, match="k must be in"):
        expert_capacities_list(t, e, e + 1)


def prices_on_torch_ops(scores: torch.Tensor, k: int = 1, **options):
    """`balanced_prices` with every problem on its torch ops (as `on_torch_ops`)."""
    with mock.patch.object(exact_module, "SMALL", 0):
        return balanced_prices(scores, k, **options)


@pytest.mark.parametrize("solve", [balanced_prices, prices_on_torch_ops])
@pytest.mark.parametrize("extras", ["best", "lowest"])
@given(problem=problems())
def test_balanced_prices_certify_an_optimal_assignment(solve, extras, problem):
    """`balanced_prices`: a balanced assignment within the solver's tolerance of scipy's
    optimum, and prices (E,) float64 with mean zero under which no balanced assignment scores
    more than it, by more than that tolerance (weak duality: the prices' bound meets its
    total). None only where there is no choice to make (K = E, or every token's scores all
    equal)."""
    scores, k = problem
    t, e = scores.shape
    out, prices, done = solve(scores, k, extras=extras)
    assert done
    check_feasible(out, t, e, k, extras)
    got = float(assignment_score(scores, out))
    assert abs(got - optimum(scores, k, extras)) <= tolerance(scores, k)
    flat = bool((scores.amax(1) == scores.amin(1)).all())
    if prices is None:
        assert k == e or flat
        return
    assert not flat and prices.shape == (e,) and prices.dtype == torch.float64
    assert abs(float(prices.mean())) <= 1e-12 * (1.0 + float(prices.abs().max()))
    assert float(assignment_bound(scores, prices, k, extras=extras)) - got <= tolerance(scores, k)


def test_balanced_prices_are_in_the_scores_units():
    """Scores scaled by c, or shifted per token, give the same assignment and the prices times
    c, or the same prices: the solve runs on the normalised scores, whose units the prices are
    brought back to."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(4096, 16, generator=g, dtype=torch.float64)
    scores[:, 2] += 0.4  # crowded: the pick drops tokens and the fill and cycles move them
    out, prices, _ = balanced_prices(scores, 2)
    assert torch.equal(out, balanced_assignment(scores, 2))
    for c in (3.0, 1e-3, 1e35, 1e-35):  # the last two: divided by their largest magnitude first
        out_c, prices_c, _ = balanced_prices(scores * c, 2)
        assert torch.equal(out_c, out)
        torch.testing.assert_close(prices_c, prices * c, rtol=1e-9, atol=1e-12 * c)
    shifted, prices_s, _ = balanced_prices(scores + torch.randn(4096, 1, generator=g, dtype=torch.float64), 2)
    assert torch.equal(shifted, out)
    torch.testing.assert_close(prices_s, prices, rtol=0, atol=1e-9)
    got = float(assignment_score(scores, out))
    assert float(assignment_bound(scores, prices, 2)) - got <= tolerance(scores, 2)


def test_small_problems_whose_prices_prove_the_pick_skip_the_cycles(monkeypatch):
    # each expert is some T/E tokens' strict favourite: under prices that balance the pick,
    # every token holds its best expert and the pick is optimal with nothing left to exchange
    def no_cycles(*args, **kwargs):
        raise AssertionError("the cycles ran")

    monkeypatch.setattr(exact_module, "host_finish", no_cycles)
    g = torch.Generator().manual_seed(0)
    for t, e in ((64, 8), (1024, 8), (2048, 8)):
        target = torch.randperm(t, generator=g) % e
        scores = torch.rand(t, e, generator=g)
        scores[torch.arange(t), target] += 1.0
        assert torch.equal(balanced_assignment(scores)[:, 0], target)
    with pytest.raises(AssertionError, match="the cycles ran"):  # a skew one update cannot balance
        scores = torch.randn(1024, 8, generator=g)
        scores[:, 0] += 2.0
        balanced_assignment(scores, max_iters=1)


@pytest.mark.parametrize("num_experts", range(2, 20))
def test_host_top_two_matches_a_sort(num_experts):
    rng = np.random.default_rng(num_experts)
    a = rng.standard_normal((num_experts, 50)).astype(np.float32)
    a[:, 0] = 1.0  # a column tied throughout
    a[-1, 1] = a[0, 1] = 5.0  # the first and last rows tied at the top
    m1, m2 = _top2_host(a)
    ordered = np.sort(a, axis=0)
    assert np.array_equal(m1, ordered[-1]) and np.array_equal(m2, ordered[-2])


@pytest.mark.parametrize("t, e", [(2048, 8), (4096, 8)])
def test_the_numpy_path_stops_at_its_size(t, e):
    taken = []
    real = exact_module._host_solve
    with mock.patch.object(exact_module, "_host_solve", lambda *a: taken.append(1) or real(*a)):
        balanced_assignment(torch.randn(t, e))
    assert len(taken) == (t * e <= exact_module.SMALL)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("extras", ["best", "lowest"])
def test_exchange_edges_stay_their_groups_largest_gains(k, extras):
    """After every move of the exchange cycles, each edge a -> b is the largest gain of a's
    group to b, as a scan of every group gives it, though a move rescans only the edges its
    positions held, and Bellman-Ford's edges (the holder's included) follow; the solve is the
    one that scans every edge of a touched expert."""
    from moe.routing import cycle_graph
    from moe.routing.cycle_graph import _Graph

    refresh, apply = _Graph._refresh, _Graph._apply
    refreshes = []

    def counted(graph, slot, nodes, full=False):
        refreshes.append(full)
        refresh(graph, slot, nodes, full)

    def checked(graph, cycles):
        apply(graph, cycles)
        for e in range(graph.gain.shape[0]):
            lo, hi = graph.begin[e], graph.end[e]
            scan = np.maximum.reduce(graph.g[lo:hi], axis=0) if hi > lo else np.full(graph.gain.shape[1], -np.inf)
            np.testing.assert_array_equal(graph.gain[e], scan)
        kept = graph.w_in.copy()
        graph._rebuild_w_in()  # Bellman-Ford's edges, the holder's included, from the edges above
        np.testing.assert_array_equal(kept, graph.w_in)

    def scans_all(graph, slot, nodes, full=False):
        refresh(graph, slot, nodes, True)

    g = torch.Generator().manual_seed(k)
    for scores in (torch.randn(300, 13, generator=g), torch.randint(0, 3, (300, 13), generator=g).double()):
        scores[:, :2] += 1.5  # two favourites: many cycles when the prices do no work
        with (
            mock.patch.object(_Graph, "_refresh", counted),
            mock.patch.object(_Graph, "_apply", checked),
            mock.patch.object(cycle_graph, "SCAN_WHOLE", 0),  # the incremental edges at any size
        ):
            got = on_torch_ops(scores, k, max_iters=0, extras=extras)
        with mock.patch.object(_Graph, "_refresh", scans_all):
            assert torch.equal(got, on_torch_ops(scores, k, max_iters=0, extras=extras))
        assert float(assignment_score(scores, got)) == pytest.approx(optimum(scores, k, extras=extras), rel=1e-9)
    assert refreshes.count(False) > 20  # the incremental path ran
