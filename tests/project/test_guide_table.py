"""docs/reference/autoscaling-guide.md: every table row names a test that exists (its file, and a `def` or `async
def` of that name in it), or says "no test yet"; and every module it names exists. So the table cannot rot when a
test is renamed or removed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference" / "autoscaling-guide.md"
NO_TEST = "no test yet"
TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")
COLUMNS = ["what is asked", "offload", "where", "shown by"]


def rows(text: str) -> list[list[str]]:
    """The body rows of every table: cells split on `|` not escaped as `\\|`."""
    found = []
    for line in text.splitlines():
        if not line.startswith("|") or re.fullmatch(r"\|(\s*-+\s*\|)+", line):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if cells != COLUMNS:
            found.append(cells)
    return found


def has_test(path: str, name: str) -> bool:
    source = ROOT / path
    return source.is_file() and re.search(rf"^\s*(async\s+)?def {name}\(", source.read_text(), re.M) is not None


def problems(text: str) -> list[str]:
    wrong = []
    for cells in rows(text):
        if len(cells) != len(COLUMNS):
            wrong.append(f"{len(cells)} cells, not {len(COLUMNS)}: {cells}")
            continue
        shown = cells[-1]
        refs = TEST_REF.findall(shown)
        if not refs and shown != NO_TEST:
            wrong.append(f"names no test (nor says {NO_TEST!r}): {cells[0]}")
        wrong += [f"no test {p}::{n} (row: {cells[0]})" for p, n in refs if not has_test(p, n)]
        for module in re.findall(r"`([\w/]+\.(?:py|js))`", cells[2]):
            where = (
                ROOT / module
                if "/" in module and module.startswith("offload/")
                else ROOT / "offload/autoscale" / module
            )
            if not where.is_file():
                wrong.append(f"no module {module} (row: {cells[0]})")
    return wrong


def test_every_row_names_a_test_that_exists() -> None:
    text = PAGE.read_text()
    assert len(rows(text)) >= 50, "the guide's tables are missing"
    assert problems(text) == []


def test_a_renamed_test_fails_the_check() -> None:
    table = "| what is asked | offload | where | shown by |\n|---|---|---|---|\n"
    good = "| a | b | `leader.py` | `tests/project/test_guide_table.py::test_a_renamed_test_fails_the_check` |\n"
    assert problems(table + good) == []
    gone = good.replace("test_a_renamed", "test_a_vanished")
    assert problems(table + gone) == [
        "no test tests/project/test_guide_table.py::test_a_vanished_test_fails_the_check (row: a)"
    ]
    assert problems(table + "| a | b | `nowhere.py` | no test yet |\n") == ["no module nowhere.py (row: a)"]
    assert problems(table + "| a | b | `leader.py` | soon |\n") == [f"names no test (nor says {NO_TEST!r}): a"]


@pytest.mark.parametrize("link", ["../reference/autoscaling-guide.md"])
def test_the_how_to_links_the_table(link: str) -> None:
    assert link in (ROOT / "docs" / "how-to" / "autoscaling.md").read_text()
