"""The exact solver's thread choice (moe/routing/balanced/threads.py): the result never depends on
the thread count, the faster count is the one used, and torch's own count is left as it was."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe.routing.balanced import balanced_assignment
from moe.routing.balanced import threads as th


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    t=st.sampled_from([256, 1000, 4096]),
    e=st.sampled_from([8, 64]),
    k=st.sampled_from([1, 2]),
    kind=st.sampled_from(["gauss", "skewed", "ties"]),
    seed=st.integers(0, 2**16),
)
def test_same_assignment_on_one_and_two_threads(two_threads, t, e, k, kind, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(t, e, generator=g)
    if kind == "skewed":
        s[:, : e // 8 or 1] += 2
    elif kind == "ties":
        s = s.round()
    with th.adaptive_threads(False):
        torch.set_num_threads(1)
        one = balanced_assignment(s, k)
        torch.set_num_threads(2)
        two = balanced_assignment(s, k)
    assert torch.equal(one, two)


def _fed(times_n: float, times_1: float, n: int = 2) -> th._Choice:
    choice = th._Choice()
    for _ in range(th._WARMUP + th.WINDOW):
        threads = choice.pick(("size",), n)
        choice.record(("size",), threads, times_n if threads == n else times_1)
    return choice


@pytest.mark.parametrize(("times_n", "times_1", "preferred"), [(0.2, 0.01, 1), (0.005, 0.008, 2)])
def test_faster_count_is_used_and_the_other_probed(times_n, times_1, preferred):
    choice = _fed(times_n, times_1)
    picks = [choice.pick(("size",), 2) for _ in range(2 * th.PROBE_EVERY)]
    other = 3 - preferred
    assert picks.count(other) == 2  # one probe in PROBE_EVERY solves
    assert picks.count(preferred) == len(picks) - 2


def test_a_machine_that_turns_busy_is_followed():
    choice = _fed(0.005, 0.008)  # quiet: two threads win
    key = ("size",)
    for _ in range(4 * th.PROBE_EVERY):  # now every 2-thread solve stalls
        threads = choice.pick(key, 2)
        choice.record(key, threads, 0.2 if threads == 2 else 0.008)
    assert choice.pick(key, 2) == 1


def test_torch_thread_count_restored_even_when_the_solve_raises(two_threads):
    key = ("raises",)
    for _ in range(th._WARMUP + 1):  # run until the one-thread choice is tried
        with th.solve_threads(key):
            inside = torch.get_num_threads()
        if inside == 1:
            break
    assert inside == 1
    th._CHOICE.times[key][2].extend([1.0] * th.WINDOW)  # make one thread the choice
    with pytest.raises(ValueError), th.solve_threads(key):
        assert torch.get_num_threads() == 1
        raise ValueError("in the solve")
    assert torch.get_num_threads() == 2


def test_adaptive_off_keeps_torch_count(two_threads):
    key = ("off",)
    th._CHOICE.times[key] = {2: [1.0] * th.WINDOW, 1: [0.001] * th.WINDOW}
    th._CHOICE.calls[key] = 1
    with th.adaptive_threads(False), th.solve_threads(key):
        assert torch.get_num_threads() == 2
    with th.solve_threads(key):
        assert torch.get_num_threads() == 1
