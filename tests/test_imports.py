"""Imports point one way: no two files of moe.routing or moe.kernels import each other,
directly or around a longer loop, counting the imports made inside functions too."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "moe"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that the file at ``path`` imports, anywhere in it."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)  # `from . import workspace`
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in known and m != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop of ``graph`` (a list of modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (loop := visit(nxt, [*path, nxt])):
                return loop
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (loop := visit(node, [node])):
            return loop
    return None


@pytest.mark.parametrize("package", ["routing", "kernels"])
def test_no_import_loops(package):
    files = sorted((ROOT / package).rglob("*.py"))
    known = {_module_name(f) for f in files}
    # a package's __init__ re-exports its modules: only the modules' own imports can form a loop
    graph = {_module_name(f): _imports(f, known) for f in files if f.name != "__init__.py"}
    graph = {m: {d for d in deps if d in graph} for m, deps in graph.items()}
    assert _cycle(graph) is None, f"import loop in moe.{package}: {' -> '.join(_cycle(graph))}"


def test_the_loop_finder_sees_a_loop():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
