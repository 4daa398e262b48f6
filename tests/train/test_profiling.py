"""`moe.train.profiling.StepProfiler` on a GPU: the same steps' CUDA allocations are dumped
beside the trace. Without CUDA the memory-history calls are stood in for, so the order of the
calls (record from the warm-up step, dump with the trace, then stop) is checked here too; the
real snapshot is checked where CUDA is present."""

import pickle
from pathlib import Path
from unittest import mock

import pytest
import torch

from moe.train.profiling import StepProfiler


def _profile(run_dir: Path, device: torch.device, steps: int = 1) -> StepProfiler:
    prof = StepProfiler(steps, run_dir, 0, device)
    for _ in range(steps + 2):  # a warm-up step, the traced ones, and one more (not traced)
        x = torch.ones(64, 64, device=device)
        (x @ x).sum()
        prof.step()
    prof.close()
    return prof


def test_cuda_memory_history_is_recorded_for_the_traced_steps_and_dumped_with_the_trace(tmp_path):
    calls = []

    def dump(path):
        calls.append(("dump", Path(path).name))
        Path(path).write_bytes(b"snapshot")

    memory = torch.cuda.memory
    with (
        mock.patch.object(memory, "_record_memory_history", lambda *a, **k: calls.append(("record", k))),
        mock.patch.object(memory, "_dump_snapshot", dump),
        pytest.warns(UserWarning, match="CUDA is not available"),  # torch.profiler, asked for CUDA here
    ):
        prof = StepProfiler(1, tmp_path, 0, torch.device("cuda"))
        for _ in range(3):
            torch.ones(8).sum()
            prof.step()
        prof.close()
    stop = ("record", {"enabled": None})
    assert calls == [("record", {"max_entries": 200_000}), ("dump", "memory_rank0.pickle"), stop]
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["memory_rank0.pickle", "trace_rank0.json"]


@pytest.mark.gpu
def test_cuda_memory_snapshot_on_a_gpu(tmp_path):
    _profile(tmp_path, torch.device("cuda"))
    snapshot = pickle.loads((tmp_path / "profile" / "memory_rank0.pickle").read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"], sorted(snapshot)
    assert (tmp_path / "profile" / "trace_rank0.json").stat().st_size > 0
