"""Writing a benchmark's generated table into docs/benchmarks.md between two markers."""

from __future__ import annotations

from pathlib import Path

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
