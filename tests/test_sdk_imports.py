"""No import cycles among the SDK's modules, and none hidden inside functions.

A cycle between two modules is usually papered over with an import inside a function (``grammar`` and
``constraints`` did that, and ``runtime`` imported ``mcp`` at close time); it works, but it means neither module can
be read or tested without the other. The graph is built from the source with ``ast``: every ``import inferlet.x``,
``from inferlet import x`` and ``from inferlet.x import y``, wherever it appears, including function bodies, but
not ``if TYPE_CHECKING:`` blocks, which only name types for annotations (``forward`` names ``Context`` that way)
and never run. ``inferlet/__init__.py`` is left
out: it is the package's export list, importing every module by design, and no module imports it back for anything
but its submodules (``from inferlet import runtime`` names the module ``inferlet.runtime``).
"""

from __future__ import annotations

import ast
from pathlib import Path

SDK = Path(__file__).resolve().parent.parent / "sdk" / "inferlet"


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The SDK modules ``path`` imports anywhere in its source."""
    tree = ast.parse(path.read_text(), str(path))
    type_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for inner in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}  # `from inferlet import runtime`
        elif isinstance(node, ast.ImportFrom) and node.level == 1:  # relative: `from .x import y`
            found.add(f"inferlet.{node.module}" if node.module else "inferlet")
            found |= {f"inferlet.{alias.name}" for alias in node.names}
    return found & modules


def sdk_graph() -> dict[str, set[str]]:
    files = {f"inferlet.{p.stem}": p for p in SDK.glob("*.py") if p.name != "__init__.py"}
    modules = set(files)
    return {name: imports_of(path, modules) - {name} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle as the list of modules around it, or None (depth-first search with colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_sdk_has_no_import_cycles():
    graph = sdk_graph()
    assert len(graph) >= 15 and graph["inferlet.constraints"], "the graph was read (not vacuously acyclic)"
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
