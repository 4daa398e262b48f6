"""The Python floor is stated alike wherever a reader or a tool looks for it."""

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_python_floor_agrees():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    floor = re.fullmatch(r">=\s*3\.(\d+)", meta["project"]["requires-python"])
    assert floor, meta["project"]["requires-python"]
    minor = int(floor.group(1))
    assert meta["tool"]["ruff"]["target-version"] == f"py3{minor}"
    assert f"Python >= 3.{minor}" in (ROOT / "README.md").read_text()
    assert f"sys.version_info >= (3, {minor})" in (ROOT / "Makefile").read_text()
    assert sys.version_info >= (3, minor)  # this interpreter is one the package accepts
