"""Every Redis key is named in a keyspace module (offload/queue/keyspace.py, offload/autoscale/keyspace.py) only.

Read from the source with `ast`, so comments and docstrings may mention keys but code may not build one: a
string literal (or the first part of an f-string) starting with the namespace, a use of the bare namespace, or
`prefix(queue) + "suffix"` outside a keyspace module fails here. The Lua side builds its keys from the prefix it gets
as KEYS[1]: every suffix it appends must be one the queue keyspace module lists, so the layout is documented in
one place, scripts included.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from offload.autoscale import keyspace as autoscale_keys
from offload.queue import keyspace as queue_keys

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "offload"
KEYSPACE_MODULES = {PACKAGE / "queue" / "keyspace.py", PACKAGE / "autoscale" / "keyspace.py"}
LUA = PACKAGE / "queue" / "lua"


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the Constant nodes that are docstrings (module, class, function)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _strings(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, text) of every string literal that is not a docstring; an f-string gives its leading text."""
    skip = _docstrings(tree)
    inside_fstrings: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            inside_fstrings.update(id(v) for v in node.values)
            first = node.values[0] if node.values else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                yield node.lineno, first.value
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip | inside_fstrings:
            yield node.lineno, node.value


def _prefix_concatenations(tree: ast.AST) -> Iterator[int]:
    """Lines of `prefix(...) + ...`: a queue key built by hand instead of by a keyspace-module function."""
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left = node.left
            if isinstance(left, ast.Call):
                fn = left.func
                name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
                if name in ("prefix", "backend_prefix"):
                    yield node.lineno


def _namespace_uses(tree: ast.AST) -> Iterator[int]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "NAMESPACE":
            yield node.lineno
        if isinstance(node, ast.alias) and node.name == "NAMESPACE":
            yield getattr(node, "lineno", 0)


def violations(root: Path = PACKAGE, keyspace_modules: set[Path] = KEYSPACE_MODULES) -> list[str]:
    found: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if path in keyspace_modules:
            continue
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(root.parent)
        for line, text in _strings(tree):
            if text.startswith(f"{queue_keys.NAMESPACE}:"):
                found.append(f"{where}:{line}: key literal {text[:40]!r}")
        found += [f"{where}:{line}: queue key built with prefix(...) + ..." for line in _prefix_concatenations(tree)]
        found += [f"{where}:{line}: NAMESPACE used outside a keyspace module" for line in _namespace_uses(tree)]
    return found


def test_no_key_is_named_outside_the_keyspace_modules() -> None:
    assert violations() == []


@pytest.mark.parametrize(
    "source",
    [
        'KEY = "offload:rworkers"\n',
        'def k(i: str) -> str:\n    return f"offload:{{backend:{i}}}:gcra"\n',
        'from offload.queue.keyspace import prefix\nK = prefix("gpu") + "events"\n',
        'from offload.queue.keyspace import NAMESPACE\nK = f"{NAMESPACE}:apikeys"\n',
    ],
)
def test_the_check_catches_a_key_built_by_hand(tmp_path: Path, source: str) -> None:
    """The check fails on each way a key used to be built outside a keyspace module (store.py, limits.py, ...)."""
    package = tmp_path / "offload"
    package.mkdir()
    (package / "rogue.py").write_text('"""offload: docstrings may say anything."""\n' + source)
    assert len(violations(package, set())) >= 1


def test_docstrings_and_comments_may_mention_keys(tmp_path: Path) -> None:
    package = tmp_path / "offload"
    package.mkdir()
    (package / "fine.py").write_text('"""offload:{gpu}:ready holds ..."""\n# offload:{gpu}:events\nX = "gpu:jobs"\n')
    assert violations(package, set()) == []


def _lua_suffixes() -> set[str]:
    found: set[str] = set()
    for path in LUA.rglob("*.lua"):
        found.update(re.findall(r"\bP \.\. '([^']*)'", path.read_text()))
    return found


def test_every_suffix_the_scripts_append_is_listed_in_the_keyspace_module() -> None:
    suffixes = _lua_suffixes()
    assert len(suffixes) > 20  # the pattern still matches how the scripts build keys
    assert sorted(suffixes - set(queue_keys.QUEUE_SUFFIXES)) == []


def test_every_state_set_is_a_listed_suffix() -> None:
    assert set(queue_keys.STATE_SETS.values()) <= set(queue_keys.QUEUE_SUFFIXES)


def test_key_functions_give_the_layout_the_scripts_use() -> None:
    """The keyspace module and the scripts agree: what Python reads is what Lua wrote (same strings)."""
    q, job_id = "gpu", "gpu:0192ab"
    assert queue_keys.prefix(q) == "offload:{gpu}:"
    assert queue_keys.job(q, job_id) == "offload:{gpu}:job:gpu:0192ab"  # Lua: P .. 'job:' .. id
    assert queue_keys.state_set(q, "queued") == "offload:{gpu}:ready"
    assert queue_keys.owned(q, "h:1:x") == "offload:{gpu}:owned:h:1:x"
    assert queue_keys.cap(q, "day", "spend") == "offload:{gpu}:cap:day:spend"
    assert queue_keys.backend_rate("runpod") == "offload:{backend:runpod}:gcra"
    assert queue_keys.backend_cooldown("runpod") == "offload:{backend:runpod}:cooldown"
    assert autoscale_keys.mock_faults("m") == autoscale_keys.machines("mock", "m") + ":faults"


def test_keys_of_one_queue_or_backend_share_a_cluster_slot() -> None:
    """Multi-key scripts need one slot: every per-queue key hashes like the prefix, every backend key alike."""
    from redis.crc import key_slot

    q = "gpu.large_1"
    slot = key_slot(queue_keys.prefix(q).encode())
    per_queue = [
        queue_keys.job(q, f"{q}:1"),
        queue_keys.events(q),
        queue_keys.paused(q),
        queue_keys.workers(q),
        queue_keys.owned(q, "w"),
        queue_keys.cap(q, "day", "jobs"),
        queue_keys.histograms(q),
        queue_keys.duplicates(q),
        queue_keys.dead_letter_alert(q),
        *(queue_keys.state_set(q, s) for s in queue_keys.STATE_SETS),
    ]
    assert {key_slot(k.encode()) for k in per_queue} == {slot}
    b = "fal"
    assert len({key_slot(k(b).encode()) for k in (queue_keys.backend_rate, queue_keys.backend_cooldown)}) == 1
