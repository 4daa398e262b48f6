"""Launch a test across processes: gloo over a file store (no port to race for), a timeout on
every group so a bug fails the test instead of hanging it."""

import datetime
import faulthandler
import os
import signal
import sys
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp


def _run(rank: int, fn, world: int, store: str, *args) -> None:
    # a rank stuck while another failed is stopped by spawn with SIGTERM: print where it was
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    fn(rank, world, store, *args)  # an exception propagates: spawn reports it
    # Success: leave without interpreter teardown, where a background thread of the
    # communication stack was seen, rarely, to abort the process ("terminate called without an
    # active exception") after the work was done and checked.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, store, *args)`` in ``world`` processes; re-raises a worker's error."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_run, args=(fn, world, os.path.join(tmp, "store"), *args), nprocs=world, join=True)


def init(rank: int, world: int, store: str, timeout_s: float = 60) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def check_nan_on_one_rank(layer, make_input, bad_rank: int, at: tuple[int, int] = (1, 0)) -> None:
    """``layer(make_input())`` with a NaN at ``at`` in ``bad_rank``'s input raises there ("finite")
    and on every other rank ("ranks [bad_rank] failed"), instead of leaving them waiting in the
    next collective; the group is still usable afterwards."""
    import pytest
    import torch

    x = make_input()
    if dist.get_rank() == bad_rank:
        x[at] = float("nan")
    with pytest.raises(ValueError, match="finite" if dist.get_rank() == bad_rank else rf"ranks \[{bad_rank}\] failed"):
        layer(x)
    assert torch.isfinite(layer(make_input())).all()
