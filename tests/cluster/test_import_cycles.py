"""No import cycles among the modules of ``inferlet``, ``pie_workers`` and ``pie_cluster``, none hidden inside
functions, and the dependency arrows between the three as the design states them.

A cycle between two modules is usually papered over with an import inside a function; it works, but it means
neither module can be read or tested without the other. The graph is built from the source with ``ast``: every
``import a.b``, ``from a import b`` and ``from a.b import c`` (and relative imports), wherever it appears, including
function bodies, but not ``if TYPE_CHECKING:`` blocks, which only name types for annotations and never run. A
package's ``__init__`` is a node of its own; a module's import of a package above it is left out, since
``from inferlet import runtime`` names the module ``inferlet.runtime`` and the package is already loading.
"""

from __future__ import annotations

import ast
from pathlib import Path

from support.paths import ROOT

PACKAGES = {
    "inferlet": ROOT / "sdk" / "inferlet",
    "pie_workers": ROOT / "workers" / "pie_workers",
    "pie_cluster": ROOT / "cluster" / "pie_cluster",
}


def module_files() -> dict[str, Path]:
    """Every module of the three packages by dotted name (a package by its ``__init__.py``)."""
    files = {}
    for package, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join((package, *parts[: -1 if parts[-1] == "__init__" else None]))] = path
    return files


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The modules among ``modules`` that ``name`` (at ``path``) imports anywhere in its source."""
    tree = ast.parse(path.read_text(), str(path))
    type_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for inner in ast.walk(node)
    }
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from .x import y`, `from .. import z`
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}  # `from inferlet import runtime`
    parts = name.split(".")
    above = {".".join(parts[:i]) for i in range(1, len(parts))}
    return (found & modules) - above - {name}


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    modules = set(files)
    return {name: imports_of(name, path, modules) for name, path in files.items()}


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


def test_no_import_cycles_in_the_sdk_the_workers_or_the_cluster():
    graph = import_graph()
    for package, at_least in (("inferlet", 15), ("pie_workers", 30), ("pie_cluster", 30)):
        inside = [m for m in graph if m.split(".")[0] == package]
        assert len(inside) >= at_least, f"{package}'s modules were read (the graph is not vacuously acyclic)"
    assert graph["inferlet.constraints"] and graph["pie_workers.replica"] and graph["pie_cluster.launcher.actor"]
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_dependency_arrows_point_one_way():
    """cluster -> workers -> wire types, sdk -> wire types: the SDK reaches only ``pie_workers.wire`` and never
    the cluster, and the workers never import the cluster or the SDK."""
    graph = import_graph()
    crossings = {(m, n) for m, targets in graph.items() for n in targets if m.split(".")[0] != n.split(".")[0]}
    wrong = {
        (m, n)
        for m, n in crossings
        if (m.startswith("inferlet") and not n.startswith("pie_workers.wire")) or m.startswith("pie_workers")
    }
    assert not wrong, sorted(wrong)
    assert any(m.startswith("inferlet") for m, _ in crossings), "the crossings were read"


ROOMS = [  # pie_cluster's subpackages, each importing only from layers before its own
    {"bus", "market", "programs", "stores"},  # after the modules at the top, which every room shares
    {"hosts"},
    {"launcher"},
    {"ingress", "control"},
    {"cli"},
]


def room_of(module: str) -> str:
    """A pie_cluster module's room (its subpackage), or "" for the shared modules at the package's top."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (ROOT / "cluster" / "pie_cluster" / parts[-1]).is_dir() else ""


def test_the_cluster_s_rooms_depend_one_way():
    """The README's parts, as ``pie_cluster``'s subpackages: hosts run what the launcher places, the ingress and the
    controller sit on the launcher, the CLI on everything; the shared modules at the top import no room."""
    layer = {"": 0} | {room: i + 1 for i, rooms in enumerate(ROOMS) for room in rooms}
    graph = {m: targets for m, targets in import_graph().items() if m.startswith("pie_cluster.")}
    rooms = {room_of(m) for m in graph}
    assert rooms == set(layer), "every room has a layer, and every layer's rooms exist"
    wrong = {
        (m, n)
        for m, targets in graph.items()
        for n in targets
        if n.startswith("pie_cluster.") and room_of(n) != room_of(m) and layer[room_of(n)] >= layer[room_of(m)]
    }
    assert not wrong, sorted(wrong)
    assert any(room_of(n) == "hosts" for n in graph["pie_cluster.launcher.actor"]), "the crossings were read"


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
