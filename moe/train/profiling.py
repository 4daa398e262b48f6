"""``--profile STEPS``: a torch.profiler trace of STEPS training steps of this job, after one
warm-up step (the first step allocates, and under ``--compile`` compiles), written by each rank
to ``<run>/profile/trace_rank<r>.json`` (Chrome trace format: chrome://tracing, Perfetto, or
TensorBoard's profiler plugin). On a GPU the trace has the CUDA kernels too, and the same steps'
CUDA allocations go to ``<run>/profile/memory_rank<r>.pickle`` (`torch.cuda.memory` snapshot,
for https://pytorch.org/memory_viz); on CPU there is no such snapshot, and the command says so.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

__all__ = ["StepProfiler"]


class StepProfiler:
    """Call `step` after each training step and `close` at the end of the job."""

    def __init__(self, steps: int, run_dir: Path, rank: int, device: torch.device) -> None:
        self.folder = Path(run_dir) / "profile"
        self.rank, self.cuda = rank, device.type == "cuda"
        self.written: list[Path] = []
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1),
            on_trace_ready=self._write,
            profile_memory=True,
        )
        if self.cuda:  # recorded from the warm-up step on; dumped with the trace
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        elif rank == 0:
            print("profile: no CUDA device, so no CUDA memory snapshot (the trace is written)", file=sys.stderr)
        self.prof.start()

    def _write(self, prof) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"trace_rank{self.rank}.json"
        prof.export_chrome_trace(str(trace))
        self.written.append(trace)
        if self.cuda:
            snapshot = self.folder / f"memory_rank{self.rank}.pickle"
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.written.append(snapshot)

    def step(self) -> None:
        if not self.written:
            self.prof.step()

    def close(self) -> None:
        """Stop; a job that ended before its profiled steps writes what it recorded."""
        self.prof.stop()  # in the active steps this writes the trace (on_trace_ready)
        if not self.written and self.rank == 0:
            print("profile: the job ended before a profiled step; no trace written", file=sys.stderr)
        if self.cuda and not self.written:
            torch.cuda.memory._record_memory_history(enabled=None)
