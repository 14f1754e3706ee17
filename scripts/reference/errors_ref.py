"""docs/reference/errors.md: the exception tree drawn in offload/errors.py (tests/project/test_errors.py holds the
drawing to the code), as a nested list."""

from __future__ import annotations

import re

import offload.errors

INTRO = """# Errors

Every error offload raises on purpose is an `offload.OffloadError`; catch a branch, or `OffloadError` for all of
them. Generated from the tree drawn in `offload/errors.py` by `python -m scripts.reference`. A leaf lives beside
the code that raises it (its module in parentheses) and stays importable from there; a class that also derives
from a builtin says so, so `except KeyError` code keeps working. The CLI prints any of them as one line
(`error: ...`, exit code 1); the HTTP API answers them as JSON, `{"error": kind, "detail": ...}` (see
[Run the server and HTTP API](../how-to/server.md)).
"""


def tree_lines() -> list[str]:
    """The drawing: from `* OffloadError` to the first blank line after it."""
    doc = offload.errors.__doc__ or ""
    start = doc.index("* OffloadError")
    return doc[start : doc.index("\n\n", start)].splitlines()


def item(line: str) -> str:
    """`    - Name (Base) - what (module)` -> an indented Markdown list item, the class names in code."""
    indent = len(line) - len(line.lstrip())
    text = line.strip()[2:]
    names, _, what = text.partition(" - ")
    names = re.sub(r"\b([A-Z]\w+)\b(?![^(]*\))", r"`\1`", names)
    depth = indent // 2
    body = f"{names}: {what}" if what else names
    return "    " * depth + "- " + body


def pages() -> dict[str, str]:
    lines = [INTRO]
    current: list[str] = []
    for line in tree_lines():
        if line.strip()[:2] in ("* ", "+ ", "- "):
            if current:
                lines.append(item(" ".join(current)))
            current = [line]
        else:  # a continuation of the item above
            current.append(line.strip())
    lines.append(item(" ".join(current)))
    return {"reference/errors.md": "\n".join(lines).rstrip("\n") + "\n"}
