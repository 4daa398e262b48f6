"""What the benchmark scripts share: timing, the run's metadata, and writing their section of
docs/benchmarks.md."""

from __future__ import annotations

import contextlib
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

DOCS = Path("docs/benchmarks.md")


def write_section(name: str, body: str, heading: str, docs: Path = DOCS) -> None:
    """Replace the text between ``<!-- name:begin -->`` and ``<!-- name:end -->`` with ``body``;
    append the markers under ``heading`` when the file has none yet. Text around them is kept."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = docs.read_text() if docs.exists() else "# Benchmarks\n"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = f"{text.rstrip()}\n\n{heading}\n\n{block}\n"
    docs.write_text(text)


def timed(fn, repeats: int, sync=None) -> tuple[float, object]:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up, and its last result.
    ``sync`` (e.g. torch.cuda.synchronize) runs after every call so GPU work is counted."""
    out = fn()
    if sync:
        sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def timed_turns(
    fns: dict, repeats: int, sync=None, before=None, warmup: int = 1, apart: bool = False
) -> dict[str, list[float]]:
    """Seconds of every run of each function, the functions taking turns within each repeat
    (after ``warmup`` untimed runs each), so drift in the machine's speed hits them alike.
    ``before`` runs, untimed, before every run (e.g. a barrier). ``apart``: each function's
    warm-up and repeats back to back instead, one function after another, so each runs as
    if alone (what the others leave in the caches and the allocator does not reach it)."""
    samples = {name: [] for name in fns}
    for group in [[name] for name in fns] if apart else [list(fns)]:
        for name in group:
            for _ in range(warmup):
                once(fns[name], sync)
        for _ in range(repeats):
            for name in group:
                if before:
                    before()
                samples[name].append(once(fns[name], sync))
    return samples


def train_step(run, module: torch.nn.Module, x: torch.Tensor, backward_range: str | None = None) -> None:
    """One forward + backward of ``run`` on a fresh leaf copy of ``x`` (the loss the outputs'
    mean square), then ``module``'s gradients cleared: the step the layer benchmarks time.
    ``backward_range``: a profiler range of that name around the backward."""
    loss = run(x.detach().requires_grad_()).square().mean()
    with torch.profiler.record_function(backward_range) if backward_range else contextlib.nullcontext():
        loss.backward()
    module.zero_grad(set_to_none=True)


def once(fn, sync=None) -> float:
    """Seconds of one call of ``fn`` (``sync`` after it, e.g. torch.cuda.synchronize)."""
    t0 = time.perf_counter()
    fn()
    if sync:
        sync()
    return time.perf_counter() - t0


def run_meta(module: str, argv: list[str] | None, device: torch.device | None = None) -> dict:
    """The command that ran (``python -m module args``), the machine, threads, torch and date."""
    cuda = device is not None and device.type == "cuda"
    return {
        "command": " ".join([f"python -m {module}", *(sys.argv[1:] if argv is None else argv)]),
        "machine": torch.cuda.get_device_name(device) if cuda else f"{platform.machine()} CPU",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }


def status_kib(field: str) -> int:
    """A field of this process's ``/proc/self/status`` in KiB (``VmRSS``, ``VmHWM``); Linux only."""
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


@contextlib.contextmanager
def count_collectives():
    """Yields a one-item list whose item counts the collectives run inside the block so far (the
    torch.distributed ones the package calls, and its functional all-to-all)."""
    import importlib
    from unittest import mock

    import torch.distributed as dist

    count = [0]

    def counted(fn):
        def run(*args, **kwargs):
            count[0] += 1
            return fn(*args, **kwargs)

        return run

    functional = importlib.import_module("moe.parallel.all_to_all")  # the module, not the function
    with contextlib.ExitStack() as stack:
        for name in ("all_reduce", "all_to_all_single", "all_gather", "all_gather_into_tensor", "broadcast"):
            stack.enter_context(mock.patch.object(dist, name, counted(getattr(dist, name))))
        fn = functional.all_to_all_single_autograd
        stack.enter_context(mock.patch.object(functional, "all_to_all_single_autograd", counted(fn)))
        yield count
