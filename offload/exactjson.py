"""JSON that keeps integers exact: orjson reads an integer beyond 64 bits as a float (12345678901234567890123
becomes 1.2345678901234568e+22) and refuses to write one.

A record can hold such integers (an ingested tutorial job is stored as its producer wrote it), so what shows a
job's input reads and writes through here: orjson's fast path when the text has no integer that long, the standard
library (exact integers of any size) when it has.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

# an integer literal of 19+ digits (not a float's digits: no '.', 'e' or digit on either side) may not fit 64 bits
_LONG_INT = re.compile(rb"(?<![\d.eE])-?\d{19,}(?![\d.eE])")


def loads(text: str | bytes) -> Any:
    """Like orjson.loads, but an integer of any size stays an int."""
    raw = text.encode() if isinstance(text, str) else text
    if _LONG_INT.search(raw):
        return json.loads(raw, parse_constant=_refuse)  # NaN and Infinity are not JSON (orjson refuses them too)
    return orjson.loads(raw)


def _refuse(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def dumps(value: Any) -> bytes:
    """Compact JSON, like orjson.dumps, also for integers beyond 64 bits."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
