"""The "did you mean" of every message naming a name that does not exist (a setting, a queue)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(given: str, known: Iterable[str]) -> str | None:
    """The known name `given` is most likely a typo of, or None when none is close."""
    found = difflib.get_close_matches(given, sorted(known), n=1, cutoff=0.6)
    return found[0] if found else None


def did_you_mean(near: str | None) -> str:
    """`; did you mean 'x'?` to append to a message, or nothing."""
    return f"; did you mean {near!r}?" if near is not None else ""
