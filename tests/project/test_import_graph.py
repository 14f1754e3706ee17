"""No import cycle inside `offload/`, lazy imports included.

The graph is read from the source with `ast`: every `import` and `from ... import`, wherever it stands (module
level or inside a function, where a "lazy" import only hides a cycle until the function runs), except under
`if TYPE_CHECKING:`, which never runs. Importing `a.b.c` also runs the `__init__` of the packages `a.b` and `a`,
so those are edges too, unless the importer lives inside that package (its `__init__` is then already running
or done). `from pkg import name` is an edge to `pkg.name` when that is a module, else to `pkg`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "offload"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under `node`, skipping the body (not the else) of `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _imports_in(other)
            continue
        yield from _imports_in(child)


def _imports_in(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    yield from _imports(node)


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the modules of `package` whose code runs when it imports them."""
    root = package.parent
    files = {module_name(p, root): p for p in sorted(package.rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            else:
                base = _absolute(node, name, is_package)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in files else base)
        own = name if is_package else name.rpartition(".")[0]
        ancestors = {".".join(own.split(".")[:i]) for i in range(1, own.count(".") + 2)}
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in files and prefix not in ancestors and prefix != name:
                    graph[name].add(prefix)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path(graph: dict[str, set[str]], component: list[str]) -> str:
    """One concrete loop through the component, for the failure message."""
    members = set(component)
    start = component[0]
    trail, seen = [start], {start}
    while True:
        step = sorted(graph[trail[-1]] & members)
        nxt = next((w for w in step if w == start), None) or next((w for w in step if w not in seen), step[0])
        trail.append(nxt)
        if nxt == start or nxt in seen:
            return " -> ".join(trail)
        seen.add(nxt)


def test_offload_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "offload.cli" in graph and "offload.queue.store" in graph  # the walk found the tree
    assert not (found := cycles(graph)), "import cycles:\n" + "\n".join(_path(graph, c) for c in found)


def test_the_graph_sees_lazy_imports_and_skips_type_checking(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub import leaf\n")
    (pkg / "sub" / "leaf.py").write_text("X = 1\n")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n    return b\n")  # lazy
    (pkg / "b.py").write_text("from .sub.leaf import X\nimport pkg.a\n")  # relative; runs pkg.sub's __init__ too
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import d\nelse:\n    import pkg.e\n"
    )
    (pkg / "d.py").write_text("import pkg.c\n")
    (pkg / "e.py").write_text("")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg.sub", "pkg.sub.leaf", "pkg.a"}
    assert graph["pkg.c"] == {"pkg.e"} and graph["pkg.d"] == {"pkg.c"}
    assert graph["pkg.sub"] == {"pkg.sub.leaf"}  # a package importing its own module: no edge back to itself
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
    assert _path(graph, ["pkg.a", "pkg.b"]) == "pkg.a -> pkg.b -> pkg.a"
