"""Every fenced ```python block of README.md and docs/**/*.md runs as written, each alone in a
fresh process (so each one must carry its own imports), and a broken one fails with the
file:line of its opening fence.

An HTML comment on the line just before a fence changes how its block runs:

    <!-- doc-test: skip (reason) -->   not run: a shape of code, not a program (the reason is required)
    <!-- doc-test: nproc=2 -->          run in 2 processes by torch's launcher (torchrun), which sets
                                       RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: the block
                                       calls init_process_group("gloo") itself

The script a block runs in has the block's lines at the doc's own line numbers, so a traceback's
line numbers point into the doc. Any other ``doc-test`` comment, or one that is not followed by a
python fence, fails the test instead of being ignored.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120  # per block; a hung example (a collective waiting forever) fails instead of hanging CI
FENCE = re.compile(r"^(\s*)```\s*(\S*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*doc-test:(.*?)-->\s*$")
MARKER_START = re.compile(r"^\s*<!--\s*doc-test")  # a marker attempt; prose may quote one in backticks
PYTHON_TAGS = ("python", "py")


@dataclass(frozen=True)
class Block:
    """One fenced python block: where it is, its code, and how its marker says to run it."""

    path: str  # as shown in messages: relative to the repository root
    line: int  # 1-based line of the opening fence
    code: str  # the lines between the fences, dedented to the fence
    skip: str | None = None  # the reason, when marked skip
    nproc: int = 1  # > 1: launched in that many processes

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def parse_marker(text: str, where: str) -> tuple[str | None, int]:
    """(skip reason, nproc) of the inside of a ``<!-- doc-test: ... -->`` comment."""
    body = text.strip()
    skip = re.fullmatch(r"skip\s*(?:\((.*)\))?", body)
    if skip:
        if not (skip.group(1) or "").strip():
            raise ValueError(f"{where}: doc-test skip needs a reason: <!-- doc-test: skip (why) -->")
        return skip.group(1).strip(), 1
    nproc = re.fullmatch(r"nproc\s*=\s*(\d+)", body)
    if nproc:
        n = int(nproc.group(1))
        if n < 2:
            raise ValueError(f"{where}: doc-test nproc must be at least 2, got {n}")
        return None, n
    raise ValueError(f"{where}: unknown doc-test marker {body!r}; expected 'skip (reason)' or 'nproc=N' with N >= 2")


def extract(text: str, path: str) -> list[Block]:
    """The python blocks of one markdown text. Raises ValueError (naming path:line) on a bad
    or stray marker and on a python fence that is never closed."""
    lines = text.splitlines()
    blocks = []
    pending = None  # (line, skip, nproc) of a marker waiting for its fence
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = FENCE.match(line)
        if fence is None:
            if pending is not None:
                raise ValueError(f"{path}:{pending[0]}: doc-test marker not followed by a ```python fence")
            marker = MARKER.match(line)
            if marker:
                pending = (i + 1, *parse_marker(marker.group(1), f"{path}:{i + 1}"))
            elif MARKER_START.match(line):
                raise ValueError(f"{path}:{i + 1}: a doc-test marker must be alone on its line: <!-- doc-test: ... -->")
            i += 1
            continue
        indent, tag = fence.group(1), fence.group(2).lower()
        # a closing fence is bare (CommonMark): a ```python line inside another block is its text
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            if tag in PYTHON_TAGS:
                raise ValueError(f"{path}:{i + 1}: ```{tag} fence never closed")
            break
        if tag in PYTHON_TAGS:
            body = [ln[len(indent) :] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1 : end]]
            skip, nproc = pending[1:] if pending is not None else (None, 1)
            blocks.append(Block(path, i + 1, "\n".join(body) + "\n", skip, nproc))
        elif pending is not None:
            raise ValueError(f"{path}:{pending[0]}: doc-test marker not followed by a ```python fence")
        pending = None
        i = end + 1
    if pending is not None:
        raise ValueError(f"{path}:{pending[0]}: doc-test marker not followed by a ```python fence")
    return blocks


def doc_files(root: Path = ROOT) -> list[Path]:
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("**/*.md"))] if p.is_file()]


def run_block(block: Block, workdir: Path, *, timeout: float = TIMEOUT_S) -> None:
    """Run ``block`` in a fresh interpreter in ``workdir`` (the current directory of the
    example); raises AssertionError starting with ``file:line`` when it fails or times out."""
    script = workdir / (re.sub(r"[^\w.]+", "_", block.path) + f"_{block.line}.py")
    # the block's first line at the doc's line after the fence: tracebacks read as doc lines
    script.write_text("\n" * block.line + block.code)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    if block.nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # the launcher sets it anyway, with a warning
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={block.nproc}"]
        cmd.append(str(script))
    else:
        cmd = [sys.executable, str(script)]
    # its own process group, so a timeout ends the launcher's workers too
    proc = subprocess.Popen(
        cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{block.where}: example timed out after {timeout:.0f} s\n{out[-4000:]}") from None
    if proc.returncode != 0:
        raise AssertionError(
            f"{block.where}: example failed (exit {proc.returncode}; traceback lines of {script.name} are"
            f" lines of {block.path})\n{out[-6000:]}"
        )


def _collect() -> list:
    params = []
    for path in doc_files():
        rel = path.relative_to(ROOT).as_posix()
        try:
            blocks = extract(path.read_text(encoding="utf-8"), rel)
        except ValueError as e:  # reported by the test, not as a collection error of the whole file
            params.append(pytest.param(str(e), id=rel))
            continue
        for b in blocks:
            marks = [pytest.mark.distributed] if b.nproc > 1 else []
            params.append(pytest.param(b, id=b.where, marks=marks))
    return params


PARAMS = _collect()


@pytest.mark.parametrize("block", PARAMS)
def test_doc_example_runs(block, tmp_path):
    if isinstance(block, str):
        pytest.fail(block)
    if block.skip is not None:
        pytest.skip(f"{block.where}: marked skip ({block.skip})")
    run_block(block, tmp_path)


def test_docs_have_examples():
    blocks = [p.values[0] for p in PARAMS if isinstance(p.values[0], Block)]
    run = [b for b in blocks if b.skip is None]
    assert any(b.path == "README.md" for b in run), "the README's example is not found"
    assert any(b.nproc > 1 for b in run), "no multi-process example found"
    assert len(run) >= 3, [b.where for b in blocks]


# the machinery itself


def test_extract_reads_markers_and_lines():
    text = "\n".join(
        [
            "# t",  # 1
            "```bash",  # 2
            "<!-- doc-test: nproc=oops -->",  # 3: text of the bash block, not a marker
            "```",  # 4
            "<!-- doc-test: nproc=2 -->",  # 5
            "```python",  # 6
            "a = 1",  # 7
            "```",  # 8
            "<!-- doc-test: skip (only the shape of a call) -->",  # 9
            "```py",  # 10
            "f(...)",  # 11
            "```",  # 12
            "- item",  # 13
            "  ```python",  # 14: in a list, dedented to the fence
            "  if True:",  # 15
            "      b = 2",  # 16
            "  ```",  # 17
        ]
    )
    blocks = extract(text, "x.md")
    expected = [(6, 2, None), (10, 1, "only the shape of a call"), (14, 1, None)]
    assert [(b.line, b.nproc, b.skip) for b in blocks] == expected
    assert blocks[0].code == "a = 1\n"
    assert blocks[2].code == "if True:\n    b = 2\n"
    assert blocks[0].where == "x.md:6"
    # prose that quotes a marker is not one
    (quoted,) = extract("Write `<!-- doc-test: nproc=2 -->` before the fence.\n```python\nx = 1\n```\n", "x.md")
    assert (quoted.line, quoted.nproc, quoted.skip) == (2, 1, None)


@pytest.mark.parametrize(
    "text, message",
    [
        ("<!-- doc-test: skip -->\n```python\nx\n```", "x.md:1: doc-test skip needs a reason"),
        ("<!-- doc-test: skip () -->\n```python\nx\n```", "x.md:1: doc-test skip needs a reason"),
        ("a\n<!-- doc-test: nproc=1 -->\n```python\nx\n```", "x.md:2: doc-test nproc must be at least 2"),
        ("<!-- doc-test: run-later -->\n```python\nx\n```", "x.md:1: unknown doc-test marker 'run-later'"),
        ("<!-- doc-test: nproc=2 -->\n\n```python\nx\n```", "x.md:1: doc-test marker not followed"),
        ("<!-- doc-test: nproc=2 -->\n```bash\nx\n```", "x.md:1: doc-test marker not followed"),
        ("text\n<!-- doc-test: nproc=2 -->", "x.md:2: doc-test marker not followed"),
        ("<!-- doc-test: skip (x) --> and more\n```python\nx\n```", "x.md:1: a doc-test marker must be alone"),
        ("a\n```python\nx = 1\n", "x.md:2: ```python fence never closed"),
    ],
)
def test_extract_rejects_bad_markers(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        extract(text, "x.md")


def test_broken_example_names_file_and_line(tmp_path):
    text = "# Doc\n\nSome words.\n\n```python\nx = 1\nraise RuntimeError('broken on purpose')\n```\n"
    (block,) = extract(text, "docs/broken.md")
    with pytest.raises(AssertionError) as err:
        run_block(block, tmp_path)
    msg = str(err.value)
    assert msg.startswith("docs/broken.md:5: example failed (exit 1")
    assert "line 7" in msg and "broken on purpose" in msg  # the doc's line of the raise


def test_hung_example_times_out(tmp_path):
    (block,) = extract("```python\nimport time\ntime.sleep(60)\n```\n", "docs/hang.md")
    with pytest.raises(AssertionError, match=re.escape("docs/hang.md:1: example timed out after 1 s")):
        run_block(block, tmp_path, timeout=1)
