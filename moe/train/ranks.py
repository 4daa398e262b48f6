"""The ranks of a job end together: with their launcher, and when one of them stops making
progress.

- `die_with_launcher` (in each rank the ``--nproc`` launcher starts): the kernel kills the rank
  when the launcher dies (``prctl(PR_SET_PDEATHSIG)``), so a ``kill -9`` of the launcher does
  not leave ranks training and writing checkpoints on their own.
- `KillStoppedRanks` (in the launcher): once a rank has exited, a rank stopped by SIGSTOP is
  killed. It cannot act on the agent's SIGTERM (a stopped process holds it until continued,
  and continued it would only wait on the ended ranks), so it would hold the job for the
  agent's whole shutdown wait (`moe.cli.SHUTDOWN_S`).
- `record_rank` and `name_slow_ranks` (in every rank): a collective that times out
  (``--collective-timeout``) is reported with the ranks that never reached it, read from the
  c10d store where each rank that timed out checks in.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

__all__ = [
    "LAUNCHER_ENV", "KillStoppedRanks", "collective_failure", "die_with_launcher", "name_slow_ranks", "record_rank",
    "signal_stop", "stop_message",
]  # fmt: skip

LAUNCHER_ENV = "MOE_LAUNCHER_PID"  # the --nproc launcher's pid, for the ranks it starts
_PR_SET_PDEATHSIG = 1
_GRACE_S = 3.0  # how long a rank that timed out waits for the others to check in


def die_with_launcher() -> None:
    """Have the kernel SIGKILL this rank when the launcher that started it dies."""
    pid = os.environ.get(LAUNCHER_ENV)
    if pid is None:
        return
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    else:  # no parent-death signal: a thread watches the parent instead
        threading.Thread(target=_watch_parent, args=(int(pid),), daemon=True).start()
    if os.getppid() != int(pid):  # the launcher died before the prctl
        os._exit(1)


def _watch_parent(pid: int) -> None:
    while os.getppid() == pid:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


def _children() -> dict[int, str]:
    """This process's child processes and their states (Linux /proc), zombies excluded."""
    me, out = os.getpid(), {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            out[int(entry.name)] = fields[0]
    return out


class KillStoppedRanks(threading.Thread):
    """A launcher thread: once one of its ranks has exited, SIGKILL those that are stopped."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self._done = threading.Event()

    def run(self) -> None:
        if not os.path.isdir("/proc"):
            return
        seen: set[int] = set()
        while not self._done.wait(0.25):
            alive = _children()
            if seen - alive.keys():  # a rank has exited (or been reaped)
                for pid in [pid for pid, state in alive.items() if state in "Tt"]:
                    print(f"moe train: killing rank process {pid}: it is stopped (SIGSTOP) and the job has ended",
                          file=sys.stderr)  # fmt: skip
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            seen |= alive.keys()

    def stop(self) -> None:
        self._done.set()


def _store():
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def record_rank() -> None:
    """Write this rank's host and pid to the store, for `name_slow_ranks`."""
    import torch.distributed as dist

    _store().set(f"moe/rank/{dist.get_rank()}", f"pid {os.getpid()} on {socket.gethostname()}")


def stop_message(signum: int, step: int, path, run_dir) -> str:
    """What a job stopped by SIGINT / SIGTERM prints (rank 0, or the launcher for it)."""
    name = signal.Signals(signum).name
    return f"{name}: stopped after step {step}, checkpoint {path}; resume with: moe train --out {run_dir} --resume"


def signal_stop(exits: dict[int, int]) -> int | None:
    """The signal a job's failed ranks (``{rank: exit status}``, negative: killed by that
    signal) stopped on together, or None when one of them failed otherwise."""
    signums = {code - 128 if code > 0 else -code for code in exits.values()}
    if len(signums) == 1 and signums <= {signal.SIGINT, signal.SIGTERM} and max(exits.values()) > 0:
        return signums.pop()  # at least one rank went through its handler: the checkpoint is written
    return None


def collective_failure(err: BaseException, timeout_s: int) -> str | None:
    """One line for a collective that failed on this rank (None: ``err`` is something else)."""
    import torch.distributed as dist

    text = str(err)
    if "timed out" in text.lower() or "timeout" in text.lower():  # gloo: "Timed out ...", "Application timeout ..."
        return name_slow_ranks(timeout_s)
    if "closed by peer" in text or "Connection reset" in text:
        return f"rank {dist.get_rank()}: another rank ended in a collective (its message says why)"
    return None


def name_slow_ranks(timeout_s: int) -> str:
    """On a rank whose collective timed out: check in, wait for the others that time out too,
    and return one line naming the ranks that did not (they never reached the collective)."""
    import torch.distributed as dist

    rank, world, store = dist.get_rank(), dist.get_world_size(), _store()
    store.set(f"moe/timed_out/{rank}", "1")
    deadline = time.monotonic() + _GRACE_S
    while True:
        slow = [r for r in range(world) if not store.check([f"moe/timed_out/{r}"])]
        if not slow or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    head = f"rank {rank}: a collective timed out after {timeout_s} s (--collective-timeout)"
    if not slow:
        return f"{head}; every rank was waiting in it (a collective called on some ranks only?)"
    keys = {r: f"moe/rank/{r}" for r in slow}
    where = [f"rank {r} ({store.get(k).decode() if store.check([k]) else 'not started'})" for r, k in keys.items()]
    return f"{head}; not reached by {', '.join(where)}: stopped, stuck or too slow"
