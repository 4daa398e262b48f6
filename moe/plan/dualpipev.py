"""DualPipeV in the planner: its live micro-batch chunks and its bubble, read from the schedule
`pipeline_llama(schedule="dualpipev")` runs (PyTorch's DualPipeV order with whole backwards,
`moe.parallel.paired.DualPipeVFullBackward`), not from a formula.

Legend: P pipeline ranks, 2P stages (rank p holds stages p and 2P-1-p), M micro-batches; a
chunk is one stage's work on one micro-batch.
"""

from __future__ import annotations

import functools

__all__ = ["bubble_fraction", "live_chunks", "rank_order"]


@functools.lru_cache(maxsize=256)
def rank_order(pp: int, microbatches: int, rank: int) -> tuple[tuple, ...]:
    """Pipeline rank ``rank``'s compute steps in order: ("F", stage, mb), ("B", stage, mb) or
    ("FB", (stage, mb), (stage, mb)) for a paired forward and backward."""
    from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD, OVERLAP_F_B

    from ..parallel.paired import DualPipeVFullBackward

    if microbatches < 2 * pp:
        raise ValueError(f"dualpipev needs microbatches ({microbatches}) >= its 2 x pp = {2 * pp} stages")
    schedule = DualPipeVFullBackward.__new__(DualPipeVFullBackward)  # its order alone: no stages, no group
    schedule.pp_group_size, schedule._n_microbatches = pp, microbatches
    kinds = {FORWARD: "F", FULL_BACKWARD: "B"}
    out = []
    for a in schedule._calculate_single_rank_operations(rank):
        if a is None:
            continue
        if a.computation_type == OVERLAP_F_B:
            f, b = a.sub_actions
            out.append(("FB", (f.stage_index, f.microbatch_index), (b.stage_index, b.microbatch_index)))
        elif a.computation_type in kinds:
            out.append((kinds[a.computation_type], a.stage_index, a.microbatch_index))
        else:
            raise ValueError(f"unexpected step {a} in the DualPipeV order")
    return tuple(out)


def live_chunks(pp: int, microbatches: int, rank: int) -> int:
    """The most chunks whose activations rank ``rank`` holds at once (a forward done, its
    backward not yet), a paired step counted with its forward's chunk before its backward's
    is freed."""
    live = peak = 0
    for step in rank_order(pp, microbatches, rank):
        if step[0] in ("F", "FB"):
            live += 1
            peak = max(peak, live)
        if step[0] in ("B", "FB"):
            live -= 1
    return peak


@functools.lru_cache(maxsize=256)
def bubble_fraction(pp: int, microbatches: int, backward_ratio: float = 2.0) -> float:
    """The step's idle time over its busy time on the busiest rank, every chunk's forward taking
    1 and its backward ``backward_ratio``, a paired step their sum (its overlap of one side's
    all-to-all behind the other's compute not counted), and no time between ranks. A list
    schedule of every rank's order: a step starts when its rank is free and its inputs are done
    (a forward after the previous stage's forward of that micro-batch, a backward after the next
    stage's backward)."""
    f, b = 1.0, backward_ratio
    orders = [list(rank_order(pp, microbatches, r)) for r in range(pp)]
    done: dict[tuple, float] = {}  # ("F" | "B", stage, mb) -> end time
    free = [0.0] * pp
    pos = [0] * pp
    last = 2 * pp - 1

    def ready(kind: str, stage: int, mb: int) -> float | None:
        """When the step's input is done (None: not yet)."""
        if kind == "F":
            return 0.0 if stage == 0 else done.get(("F", stage - 1, mb))
        return done.get(("F", stage, mb) if stage == last else ("B", stage + 1, mb))

    while any(pos[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if pos[r] == len(orders[r]):
                continue
            step = orders[r][pos[r]]
            parts = [("F", *step[1]), ("B", *step[2])] if step[0] == "FB" else [step]
            deps = [ready(*p) for p in parts]
            if any(d is None for d in deps):
                continue
            start = max(free[r], *deps)
            took = sum(f if p[0] == "F" else b for p in parts)
            free[r] = start + took
            for p in parts:
                done[p] = free[r]
            pos[r] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"the DualPipeV order at pp={pp}, M={microbatches} cannot proceed")
    busy = 2 * microbatches * (f + b)  # each rank: two stages, every micro-batch
    return (max(free) - busy) / busy
