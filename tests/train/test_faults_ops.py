"""`moe train` against operator faults around processes, folders and data (subprocesses):
two jobs on one run folder, data changed under a run, special files in the data, the launcher
killed with -9, a rank stopped by SIGSTOP, SIGTERM to one rank."""

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from moe.cli import main

from .run import ROOT, TINY, corpus, env, moe

LONG = [*TINY, "--steps", 1000, "--eval-every", 1000, "--checkpoint-every", 1]


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _start(tmp_path, name, *args):
    """``moe ARGS`` in the background, its output in files (a long run's bar would fill a pipe)."""
    out, err = open(tmp_path / f"{name}.out", "w"), open(tmp_path / f"{name}.err", "w")
    cmd = [sys.executable, "-m", "moe", *map(str, args)]
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env(), cwd=ROOT)
    proc.texts = lambda: ((tmp_path / f"{name}.out").read_text(), (tmp_path / f"{name}.err").read_text())
    return proc


def _last_step(run) -> int:
    """The last step in metrics.jsonl that is written whole (-1: none yet)."""
    path = run / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []  # the last piece may be partial
    return json.loads(lines[-1])["step"] if lines else -1


def _wait_for_step(proc, run, step):
    for _ in range(1200):  # until the step is logged (no time is asserted)
        if proc.poll() is not None:
            raise AssertionError("\n".join(proc.texts()))
        if _last_step(run) >= step:
            return _last_step(run)
        time.sleep(0.25)
    raise AssertionError("no progress")


def _ranks(pid) -> dict[int, int]:
    """{rank: pid} of the rank processes the launcher ``pid`` has started (from /proc)."""
    for _ in range(400):
        out = {}
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    environ = dict(v.split("=", 1) for v in (entry / "environ").read_text().split("\0") if "=" in v)
                    out[int(environ["RANK"])] = int(entry.name)
            except (OSError, KeyError, ValueError):
                continue
        if len(out) == 2:
            return out
        time.sleep(0.25)
    raise AssertionError("the ranks were not found")


def _gone(pid) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_nproc2_lock_sigterm_to_one_rank_stopped_rank_and_launcher_killed(tmp_path, data):
    """One run folder through four jobs of two ranks: (A) while the first runs, a second
    --resume is refused naming it; (E) SIGTERM to rank 1 alone stops both with a checkpoint and
    exit 143; (D) resumed with --collective-timeout 6, rank 1 stopped by SIGSTOP ends the job
    with exit 1 naming rank 1, in about the timeout; (C) resumed again, kill -9 of the launcher
    takes both ranks with it, and the lock it held does not outlive it."""
    run = tmp_path / "run"
    job = _start(tmp_path, "first", "train", *LONG, "--data", data, "--out", run, "--nproc", 2)
    _wait_for_step(job, run, 2)
    ranks = _ranks(job.pid)

    second = moe("train", "--out", run, "--resume", check=False, timeout=120)  # A
    assert second.returncode == 2, second.stderr
    assert len(second.stderr.strip().splitlines()) == 1, second.stderr
    assert f"--out {run} is in use by another moe train (pid {job.pid} on " in second.stderr
    assert "--nproc 2" in second.stderr  # the holder's command

    os.kill(ranks[1], signal.SIGTERM)  # E: one rank, not the launcher
    assert job.wait(timeout=300) == 128 + signal.SIGTERM, job.texts()
    out, err = job.texts()
    assert out.count("SIGTERM: stopped after step") == 1 and "resume with: moe train --out" in out, out + err
    assert "ranks failed" not in err, err
    k = _metrics(run)[-1]["step"]
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{k:06d}"

    job = _start(tmp_path, "stopped", "train", "--out", run, "--resume", "--collective-timeout", 6)  # D
    _wait_for_step(job, run, k + 1)
    ranks = _ranks(job.pid)
    os.kill(ranks[1], signal.SIGSTOP)
    t0 = time.monotonic()
    assert job.wait(timeout=120) == 1, job.texts()
    took = time.monotonic() - t0
    err = job.texts()[1]
    assert f"a collective timed out after 6 s (--collective-timeout); not reached by rank 1 (pid {ranks[1]}" in err
    assert took < 6 + 18, took  # the timeout, the grace for the others, the teardown; not the agent's 30 s
    assert _gone(ranks[1])

    job = _start(tmp_path, "killed", "train", "--out", run, "--resume", "--collective-timeout", 600)  # C
    _wait_for_step(job, run, _last_step(run) + 1)
    ranks = _ranks(job.pid)
    job.send_signal(signal.SIGKILL)
    job.wait(timeout=30)
    for _ in range(40):
        if all(_gone(pid) for pid in ranks.values()):
            break
        time.sleep(0.25)
    assert [pid for pid in ranks.values() if not _gone(pid)] == []  # within 10 s
    fd = os.open(run / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the lock died with its holder: a new job takes it
    finally:
        os.close(fd)


def test_a_held_lock_refuses_a_fresh_start_into_the_new_folder(tmp_path, data, capsys):
    """Two new runs into one new folder: the one that comes second finds the folder empty but
    locked (the first has not written anything yet) and exits 2 naming the first; once the
    first has ended, the lock file it leaves does not make the folder "exist"."""
    run = tmp_path / "run"
    run.mkdir()
    fd = os.open(run / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    holder = {"pid": 4242, "host": "node7", "started": "2026-01-02T03:04:05", "command": "moe train --out x"}
    os.write(fd, json.dumps(holder).encode())
    named = "in use by another moe train (pid 4242 on node7, started 2026-01-02T03:04:05: moe train --out x)"
    try:
        assert main(["train", *map(str, TINY), "--data", str(data), "--steps", "2", "--out", str(run)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and named in err, err
        # under a plain torchrun rank 0 takes the lock and tells the other rank: both exit 2
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "moe",
               "train", *map(str, TINY), "--data", str(data), "--steps", "2", "--out", str(run)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT, timeout=300)
    finally:
        os.close(fd)
    assert proc.returncode != 0 and proc.stderr.count(named) == 2, proc.stderr
    assert "exitcode  : 2" in proc.stderr, proc.stderr  # (torchrun prints its own traceback after)
    assert sorted(p.name for p in run.iterdir()) == [".lock"]

    os.mkfifo(data.parent / "pipe")  # and a FIFO named by --data is never opened
    assert main(["train", "--data", str(data.parent / "pipe"), "--out", str(tmp_path / "other")]) == 2
    assert "not a regular file or a folder" in capsys.readouterr().err


def test_resume_refuses_changed_data_unless_data_changed_ok(tmp_path, capsys, monkeypatch):
    """A relative --data is stored absolute with the corpus's fingerprint; a file changed in
    place is refused on --resume (from another directory) until --data-changed-ok, which is
    recorded and applies to that job only. A FIFO in the data folder is skipped."""
    data = corpus(tmp_path)
    os.mkfifo(data / "pipe")
    run = tmp_path / "run"
    first = moe("train", *TINY, "--data", "data", "--steps", 4, "--stop-at", 1, "--out", run, cwd=tmp_path)
    assert "skipped 1 files that are not regular files" in first.stderr
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["train"]["data"] == str(data) and sorted(cfg["data"]["fingerprint"]) == ["__init__.py", "shutil.py"]
    assert cfg["data_changes"] == []
    (data / "pipe").unlink()  # (else each later command warns again)

    (data / "__init__.py").write_bytes((data / "__init__.py").read_bytes() + b"# edited\n")
    monkeypatch.chdir(ROOT)  # another directory than the run's first job
    assert main(["train", "--out", str(run), "--resume"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "--resume: the data differ from the run's: 1 changed (__init__.py)" in err and "--data-changed-ok" in err

    moe("train", "--out", run, "--resume", "--data-changed-ok", "--stop-at", 2)
    cfg = json.loads((run / "config.json").read_text())
    assert [(c["step"], c["differs"]) for c in cfg["data_changes"]] == [(1, "1 changed (__init__.py)")]
    (data / "shutil.py").unlink()
    assert main(["train", "--out", str(run), "--resume"]) == 2  # the flag was for that job only
    assert "1 missing (shutil.py)" in capsys.readouterr().err


def test_the_stdlib_corpus_has_a_fingerprint():
    from moe.train.fingerprint import fingerprint, fingerprint_diff

    prints = fingerprint(None)
    assert len(prints) > 100 and "json/__init__.py" in prints
    size, digest = prints["json/__init__.py"].split()
    assert int(size) > 0 and len(digest) == 16
    edited = {**prints, "json/__init__.py": "1 0000000000000000"}
    assert fingerprint_diff(prints, edited) == "1 changed (json/__init__.py)"
    assert fingerprint_diff(prints, prints) is None
