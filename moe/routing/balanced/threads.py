"""How many threads a CPU solve runs on: one, or torch's count, whichever this process has
measured faster for problems of that size.

Why: a solve is about 60 torch operations on (T, E) tensors of 10^5 - 10^6 elements, each a
parallel region that ends only when every thread has done its static share. When another
process holds one of the cores, the thread scheduled there waits for a time slice (milliseconds)
in every region: at T=4096, E=64 a 2-thread solve then took 221 ms median against 7.6 ms on one
thread. On a quiet machine two threads are faster (5-8 ms). So each size keeps the last few
times of both choices, solves with the faster, and re-tries the other every `PROBE_EVERY`-th
solve, so a machine that becomes busy or quiet is followed within a few solves.

Only the speed depends on the choice: every operation of the solver gives the same result for
any thread count (tests/routing/test_solver_threads.py checks it).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from contextlib import contextmanager

import torch

__all__ = ["adaptive_threads", "solve_threads"]

PROBE_EVERY = 16  # one solve in this many runs with the choice not currently preferred
WINDOW = 5  # times kept per (size, thread count)
_WARMUP = 2  # solves per choice before comparing (the first solves of a size allocate buffers)


class _Choice:
    """Per size: the recent seconds of each thread count, and the number of solves."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.times: dict[tuple, dict[int, deque]] = {}
        self.calls: dict[tuple, int] = {}
        self.enabled = True

    def pick(self, key: tuple, n: int) -> int:
        with self.lock:
            times = self.times.setdefault(key, {n: deque(maxlen=WINDOW), 1: deque(maxlen=WINDOW)})
            calls = self.calls[key] = self.calls.get(key, 0) + 1
            for threads in (n, 1):  # first a few solves of each
                if len(times[threads]) < _WARMUP:
                    return threads
            best = min((n, 1), key=lambda c: statistics.median(times[c]))
            return (1 if best == n else n) if calls % PROBE_EVERY == 0 else best

    def record(self, key: tuple, threads: int, seconds: float) -> None:
        with self.lock:
            self.times[key][threads].append(seconds)


_CHOICE = _Choice()


@contextmanager
def solve_threads(key: tuple):
    """Run the body (one CPU solve of the size ``key``) on the thread count chosen for that size,
    and record how long it took. Does nothing when torch runs on one thread or when
    `adaptive_threads(False)` is in force."""
    n = torch.get_num_threads()
    if n <= 1 or not _CHOICE.enabled:
        yield
        return
    threads = _CHOICE.pick(key, n)
    if threads != n:
        torch.set_num_threads(threads)
    start = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - start
        if threads != n:
            torch.set_num_threads(n)
        _CHOICE.record(key, threads, elapsed)


@contextmanager
def adaptive_threads(enabled: bool):
    """``with adaptive_threads(False):`` solves use torch's thread count as it is (to measure a
    fixed count, or where the time of every solve must not vary with the choice)."""
    before, _CHOICE.enabled = _CHOICE.enabled, enabled
    try:
        yield
    finally:
        _CHOICE.enabled = before
