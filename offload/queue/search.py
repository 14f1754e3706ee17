"""The job search: a queue's jobs filtered by id prefix, state, backend, error text, idempotency key and time range,
a page at a time, read in bounded chunks by search.lua.

No index covers these fields, so a search reads the state sets themselves: one state, or every state in
STATE_SETS order (finished ones newest first). One request reads at most `budget` ids, however few of them match:
its reply then carries a cursor to go on from, so a search of a large queue costs a bounded amount per page and the
client decides whether to read further. The cursor is `<state index>.<position>` (opaque to clients).
"""

from __future__ import annotations

from dataclasses import dataclass

from offload.queue import keyspace
from offload.queue.keyspace import STATE_SETS, validate_queue
from offload.queue.listing import NEWEST_FIRST
from offload.queue.scripts import SCRIPTS
from offload.redis_client import RedisClient

SCAN_CHUNK = 1_000
SCAN_BUDGET = 10_000
CURSOR_RE = r"^\d{1,2}\.\d{1,12}$"


@dataclass(frozen=True, slots=True)
class JobFilter:
    """What a search keeps; None (or '') matches everything. Times are epoch ms, both ends included."""

    id_prefix: str = ""
    state: str | None = None
    backend: str = ""
    error: str = ""
    idempotency_key: str = ""
    created_from: int | None = None
    created_to: int | None = None
    finished_from: int | None = None
    finished_to: int | None = None

    def argv(self, queue: str) -> list[str]:
        """The filter's ARGV for search.lua; an id prefix without its queue gets it (`0192` -> `gpu:0192`)."""
        pre = self.id_prefix if ":" in self.id_prefix or not self.id_prefix else f"{queue}:{self.id_prefix}"
        times = (self.created_from, self.created_to, self.finished_from, self.finished_to)
        bounds = ("" if t is None else str(t) for t in times)
        return [pre, self.backend, self.error.lower(), self.idempotency_key, *bounds]


Matches = list[tuple[str, str]]  # (job id, its error or '')


def parse_cursor(cursor: str | None) -> tuple[int, int]:
    """(state index, position); a cursor this module did not make reads as ValueError."""
    if not cursor:
        return 0, 0
    state, _, pos = cursor.partition(".")
    if not pos or int(state) >= len(STATE_SETS):
        raise ValueError(f"invalid cursor {cursor!r}")
    return int(state), int(pos)


async def search(
    redis: RedisClient, queue: str, where: JobFilter, cursor: str | None, limit: int, budget: int = SCAN_BUDGET
) -> tuple[Matches, str | None]:
    """Up to `limit` matches and the cursor after them (None: every set was read to its end)."""
    validate_queue(queue)
    names = list(STATE_SETS) if where.state is None else [where.state]
    si, pos = parse_cursor(cursor)
    found: Matches = []
    argv = where.argv(queue)
    while si < len(names) and len(found) < limit and budget > 0:
        state = names[si]
        count = min(SCAN_CHUNK, budget)
        used, ended, flat = await SCRIPTS.search(
            redis,
            [keyspace.prefix(queue)],
            ["", STATE_SETS[state], int(state in NEWEST_FIRST), pos, count, limit - len(found), *argv],
        )
        found += list(zip(flat[::2], flat[1::2], strict=True))
        pos, budget = pos + int(used), budget - int(used)
        if int(ended):
            si, pos = si + 1, 0
    return found, None if si >= len(names) else f"{si}.{pos}"
