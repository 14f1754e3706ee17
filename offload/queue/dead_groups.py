"""The dead letter grouped by error: dead jobs whose errors differ only in the ids and numbers inside them are one
group, so 31 identical failures read as one line with a count, and can be requeued or purged together.

An error's group is its text normalised by `error_pattern`: the volatile parts are replaced by placeholders, in
this order:
- UUIDs and job ids (`<queue>:<hex>`) by `<id>`;
- the word after `job`, `id`, `worker`, `request`, `run` or `task` (the thing named, not the kind) by `<id>`;
- any other word containing a digit (hex ids, hashes, `3s`, `v2`...) and every number by `<n>`;
- runs of whitespace by one space, and the result cut to 200 characters.
So "job abc failed after 3 s" and "job def failed after 5 s" both read "job <id> failed after <n> s".

A queue's dead set is read newest first, at most `GROUP_BUDGET` jobs (search.lua in chunks): a larger dead letter
is grouped from its newest jobs, and the reply says so (`complete` false).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from offload.queue.search import JobFilter, search
from offload.redis_client import RedisClient

GROUP_BUDGET = 10_000
SAMPLES = 5
PATTERN_MAX = 200
_UUID = re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b")
_JOB_ID = re.compile(r"\b[A-Za-z0-9][A-Za-z0-9_.-]*:[0-9a-f]{12,}\b")
_NAMED = re.compile(r"\b(job|id|worker|request|run|task)([\s:=#]+)(?!<)[^\s,;)\]}'\"]+", re.IGNORECASE)
_DIGITS = re.compile(r"[\w.-]*\d[\w.-]*")
_SPACE = re.compile(r"\s+")


def error_pattern(error: str) -> str:
    """An error's group: its text with ids and numbers replaced (the module's docstring says how)."""
    text = _UUID.sub("<id>", error)
    text = _JOB_ID.sub("<id>", text)
    text = _NAMED.sub(lambda m: f"{m[1]}{m[2]}<id>", text)
    text = _DIGITS.sub("<n>", text)
    return _SPACE.sub(" ", text).strip()[:PATTERN_MAX]


@dataclass(slots=True)
class DeadGroup:
    pattern: str
    example: str  # the newest error of the group, as it was
    count: int = 0
    sample_ids: list[str] = field(default_factory=list)


async def dead_groups(redis: RedisClient, queue: str) -> tuple[list[DeadGroup], int, bool]:
    """The groups, largest first; how many dead jobs were read; whether that was every one of them."""
    found, rest = await search(redis, queue, JobFilter(state="dead"), None, GROUP_BUDGET, GROUP_BUDGET)
    groups: dict[str, DeadGroup] = {}
    for job_id, error in found:
        pattern = error_pattern(error)
        group = groups.setdefault(pattern, DeadGroup(pattern, error[:1000]))
        group.count += 1
        if len(group.sample_ids) < SAMPLES:
            group.sample_ids.append(job_id)
    ordered = sorted(groups.values(), key=lambda g: (-g.count, g.pattern))
    return ordered, len(found), rest is None


async def group_ids(redis: RedisClient, queue: str, pattern: str) -> list[str]:
    """The dead jobs of one group (among the newest `GROUP_BUDGET`, as `dead_groups` reads them)."""
    found, _ = await search(redis, queue, JobFilter(state="dead"), None, GROUP_BUDGET, GROUP_BUDGET)
    return [job_id for job_id, error in found if error_pattern(error) == pattern]


def own_ids(queue: str, ids: Sequence[str]) -> list[str]:
    """The ids of `queue` among `ids` (another queue's id can name no job here)."""
    return [i for i in ids if i.startswith(f"{queue}:")]
