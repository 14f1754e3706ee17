"""No import cycle inside `offload/`, lazy imports included; and dependencies point one way, down the layers.

The graph is read from the source with `ast`: every `import` and `from ... import`, wherever it stands (module
level or inside a function, where a "lazy" import only hides a cycle until the function runs), except under
`if TYPE_CHECKING:`, which never runs. Importing `a.b.c` also runs the `__init__` of the packages `a.b` and `a`,
so those are edges too, unless the importer lives inside that package (its `__init__` is then already running
or done). `from pkg import name` is an edge to `pkg.name` when that is a module, else to `pkg`.

The layer contract (`LAYERS`, top first) holds on the same graph, type-only imports included: a module may import a
module of a lower layer, or of its own unit (the package or module the table names); an import sideways (another
unit of the same layer) only where `SIDEWAYS` says why; never upwards. Every module of `offload/` must be in the
table, and every entry of the table must exist, so a new module is placed on purpose
(docs/explanation/architecture.md, *Dependencies point one way*).
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


def _imports(node: ast.AST, type_checking: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under `node`, skipping the body (not the else) of `if TYPE_CHECKING:` unless
    `type_checking`."""
    for child in ast.iter_child_nodes(node):
        if not type_checking and isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _imports_in(other, type_checking)
            continue
        yield from _imports_in(child, type_checking)


def _imports_in(node: ast.AST, type_checking: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    yield from _imports(node, type_checking)


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def import_graph(package: Path = PACKAGE, type_checking: bool = False) -> dict[str, set[str]]:
    """module -> the modules of `package` whose code runs when it imports them (with `type_checking`, also
    those it imports only for the type checker)."""
    root = package.parent
    files = {module_name(p, root): p for p in sorted(package.rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path)), type_checking):
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
    assert import_graph(pkg, type_checking=True)["pkg.c"] == {"pkg.d", "pkg.e"}
    assert graph["pkg.sub"] == {"pkg.sub.leaf"}  # a package importing its own module: no edge back to itself
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
    assert _path(graph, ["pkg.a", "pkg.b"]) == "pkg.a -> pkg.b -> pkg.a"


# Top first. A module belongs to the longest entry it starts with (`offload.autoscale.settings` before
# `offload.autoscale`); the package root `offload` stands only for its own `__init__`.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("entry points", ("offload", "offload.__main__", "offload.testing.sim.__main__", "offload.cli")),
    (
        "programs",
        (
            "offload.server",
            "offload.worker",
            "offload.gpu_worker",
            "offload.autoscale",
            "offload.client",
            "offload.testing",
            "offload.testing.sim",
            "offload.local.demo",
        ),
    ),
    (
        "settings",
        (
            "offload.config",
            "offload.route_settings",
            "offload.callback_settings",
            "offload.history_settings",
            "offload.autoscale.settings",
            "offload.autoscale.alert_settings",
            "offload.autoscale.deploy",
            "offload.autoscale.vault",
        ),
    ),
    ("store and services", ("offload.queue", "offload.backends", "offload.storage", "offload.access")),
    ("connections", ("offload.connection", "offload.local", "offload.local.embedded", "offload.local.stack")),
    (
        "building blocks",
        (
            "offload.models",
            "offload.caps",
            "offload.exactjson",
            "offload.files",
            "offload.schema",
            "offload.input_maps",
            "offload.suggest",
            "offload.redis_client",
            "offload.env",
            "offload.backoff",
            "offload.clock",
            "offload.http_client",
            "offload.redact",
            "offload.egress",
            "offload.extras",
            "offload.eventloop",
            "offload.heap",
            "offload.tracing",
        ),
    ),
    ("errors", ("offload.errors",)),
]

# (importer's unit, imported unit) of one layer, and why that edge is part of the design.
SIDEWAYS: dict[tuple[str, str], str] = {
    ("offload.__main__", "offload.cli"): "`python -m offload` runs the CLI",
    ("offload.testing.sim.__main__", "offload.cli"): "`python -m offload.testing.sim` runs the CLI's sim commands",
    ("offload.server", "offload.autoscale"): "the server hosts the autoscaler: its leader runs it, routes, alerts",
    ("offload.config", "offload.autoscale.settings"): "offload.yaml's autoscale blocks, composed by config",
    ("offload.config", "offload.route_settings"): "a queue's routing settings, composed by config",
    ("offload.config", "offload.callback_settings"): "offload.yaml's callbacks block, composed by config",
    ("offload.config", "offload.history_settings"): "offload.yaml's history block, composed by config",
    ("offload.config", "offload.autoscale.alert_settings"): "offload.yaml's alerts block, composed by config",
    ("offload.autoscale.settings", "offload.autoscale.deploy"): "a queue's deployment block is its model",
    ("offload.autoscale.settings", "offload.autoscale.vault"): "instance env values are sealed with the vault",
    ("offload.autoscale.alert_settings", "offload.autoscale.settings"): "durations are read one way",
    ("offload.access", "offload.queue"): "API keys live in the job store, under its key names",
    ("offload.connection", "offload.local"): "the embedded Valkey's package (its __init__ imports nothing)",
    ("offload.connection", "offload.local.embedded"): "with no URL configured, the store is the embedded Valkey",
    ("offload.local.stack", "offload.local.embedded"): "`offload up` runs the embedded Valkey",
    ("offload.models", "offload.caps"): "a queue's status names the cap it reached",
    ("offload.models", "offload.exactjson"): "job input and output keep big integers exact",
    ("offload.schema", "offload.suggest"): "a misspelt key gets a did-you-mean",
    ("offload.eventloop", "offload.env"): "OFFLOAD_EVENT_LOOP is read where every variable is",
    ("offload.tracing", "offload.env"): "OFFLOAD_TRACING is read where every variable is",
    ("offload.tracing", "offload.redact"): "error text on a span is redacted as all text that leaves a process",
    ("offload.tracing", "offload.extras"): "tracing without offload[otel] fails in one line naming the extra",
}


def unit_of(module: str, layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> tuple[int, str] | None:
    """(layer index, the table entry) of `module`: its longest entry; None when the table does not place it."""
    best: tuple[int, str] | None = None
    for i, (_, members) in enumerate(layers):
        for m in members:
            inside = module == m or ("." in m and module.startswith(m + "."))
            if inside and (best is None or len(m) > len(best[1])):
                best = (i, m)
    return best


def layer_violations(
    graph: dict[str, set[str]],
    layers: list[tuple[str, tuple[str, ...]]] = LAYERS,
    sideways: dict[tuple[str, str], str] = SIDEWAYS,
) -> list[str]:
    """Each import the contract does not allow, named with both layers; and each module the table misses."""
    found = [f"{m} is in no layer of LAYERS: place it" for m in sorted(graph) if unit_of(m, layers) is None]
    for importer in sorted(graph):
        mine = unit_of(importer, layers)
        for target in sorted(graph[importer]):
            theirs = unit_of(target, layers)
            if mine is None or theirs is None or theirs[0] > mine[0] or theirs[1] == mine[1]:
                continue
            if theirs[0] == mine[0] and (mine[1], theirs[1]) in sideways:
                continue
            way = "sideways" if theirs[0] == mine[0] else "upwards"
            found.append(
                f"{importer} imports {target}: {way}, {layers[mine[0]][0]} ({mine[1]}) -> "
                f"{layers[theirs[0]][0]} ({theirs[1]})"
            )
    return found


def test_dependencies_point_one_way() -> None:
    graph = import_graph(type_checking=True)  # a type named from above is a dependency too
    assert not (found := layer_violations(graph)), "imports against the layers:\n" + "\n".join(found)


def test_the_layer_table_names_only_what_exists() -> None:
    graph = import_graph(type_checking=True)
    entries = [m for _, members in LAYERS for m in members]
    assert len(entries) == len(set(entries)), "an entry is in two layers"
    missing = [m for m in entries if m not in graph and not any(g.startswith(m + ".") for g in graph)]
    assert not missing, f"LAYERS names modules that do not exist: {missing}"
    stale = [pair for pair in SIDEWAYS if not set(pair) <= set(entries)]
    assert not stale, f"SIDEWAYS names units that are not in LAYERS: {stale}"
    used = {
        (mine[1], theirs[1])
        for importer, targets in graph.items()
        for target in targets
        if (mine := unit_of(importer)) and (theirs := unit_of(target)) and mine[0] == theirs[0]
    }
    assert not (unused := sorted(set(SIDEWAYS) - used)), f"SIDEWAYS allows imports nobody makes: {unused}"


def test_the_simulator_stands_alone() -> None:
    """The simulator imports only the building blocks (and its own entry point the CLI's sim commands)."""
    graph = import_graph(type_checking=True)
    floor = LAYERS.index(next(layer for layer in LAYERS if layer[0] == "building blocks"))
    found = [
        f"{m} imports {target}"
        for m, targets in graph.items()
        if (mine := unit_of(m)) and mine[1] == "offload.testing.sim"
        for target in targets
        if (theirs := unit_of(target)) and theirs[1] != "offload.testing.sim" and theirs[0] < floor
    ]
    assert not found, "the simulator leans on the product:\n" + "\n".join(found)


def test_the_layer_check_names_upward_and_sideways_imports() -> None:
    layers: list[tuple[str, tuple[str, ...]]] = [("top", ("pkg.a", "pkg.b")), ("bottom", ("pkg.c", "pkg.c.leaf"))]
    graph = {
        "pkg.a": {"pkg.c"},  # down: fine
        "pkg.b": {"pkg.a"},  # sideways, allowed below
        "pkg.a.x": {"pkg.b", "pkg.a"},  # sideways, not allowed; its own unit: fine
        "pkg.c": {"pkg.b"},  # upwards
        "pkg.c.leaf": {"pkg.c"},  # sideways into another entry of the layer
        "pkg.d": set(),  # in no layer
    }
    assert layer_violations(graph, layers, {("pkg.b", "pkg.a"): "why"}) == [
        "pkg.d is in no layer of LAYERS: place it",
        "pkg.a.x imports pkg.b: sideways, top (pkg.a) -> top (pkg.b)",
        "pkg.c imports pkg.b: upwards, bottom (pkg.c) -> top (pkg.b)",
        "pkg.c.leaf imports pkg.c: sideways, bottom (pkg.c.leaf) -> bottom (pkg.c)",
    ]
