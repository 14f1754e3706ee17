"""Which storage keys belong to which queue, so no key of one queue can write or read another queue's objects.

A job id is `<queue>:<id>` and its default output key is `results/<job id>.json`, so the keys starting with
`results/<queue>:` name their queue: they are that queue's namespace, always. Queue names cannot contain a
colon, so these namespaces never overlap. A queue may own one more prefix, `output_prefix` in offload.yaml:
the tutorial's single env-configured queue gets `results/`, because its producers RPUSH jobs whose
`output_key` is `results/<their id>.json` (tutorial ids cannot contain a colon either, so such a key is never
inside another queue's `results/<name>:` namespace, which stays that queue's even under a `results/` prefix).

Layout (one bucket, under `storage.prefix`):

    results/<queue>:<id>.json                      a job's output (the default output_key)
    results/<queue>:<name>                         any other output_key a producer of the queue picks
    results/<queue>:_<...>                         reserved for offload's own objects, never an output_key:
    results/<queue>:_files/<id>~r<run>-<n>-<name>  provider files copied from job <queue>:<id>'s output
    results/<queue>:_in/<hex>/...                  input files of job <queue>:<hex> (offload.storage.inputs)
    results/<queue>:_out/<hex>/...                 files a GPU worker returned for that job
    <output_prefix><...>                           queues with an output_prefix (the tutorial queue: results/<id>.json)
    _offload/store-id                              names the job store these files belong to (the file sweep's check)

Checked at enqueue over the HTTP API (422 naming the field), before a presigned URL is issued, and by the
config loader (no two queues' prefixes may overlap). Producers with direct Redis access (the Python client,
the CLI, tutorial producers) are the operator's own and may name any safe key; an unsafe one (`..`, absolute,
control characters) fails its job permanently when a worker gets it, before anything is paid for.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from offload.errors import ConfigError
from offload.storage.base import InvalidKey, validate_key

ROOT = "results/"
STORE_MARKER = "_offload/store-id"  # outside every queue's namespace: no output key can reach it over the HTTP API
_JOB_SPACE = re.compile(r"^results/([A-Za-z0-9][A-Za-z0-9_.-]{0,99}):")


def own_prefix(queue: str) -> str:
    """The namespace every queue has: where its job ids put their outputs by default."""
    return f"{ROOT}{queue}:"


def space_of(key: str) -> str | None:
    """The queue whose own namespace (`results/<queue>:`) `key` is in; None outside every queue's."""
    m = _JOB_SPACE.match(key)
    return m[1] if m else None


def key_problem(queue: str, key: str, prefixes: Mapping[str, str | None]) -> str | None:
    """Why `key` may not be an output key of a job of `queue` (None: it may). `prefixes`: the configured
    output_prefix per queue."""
    try:
        validate_key(key)
    except InvalidKey as exc:
        return str(exc)
    if any(ord(c) < 32 or ord(c) == 127 for c in key):
        return f"storage key {key[:200]!r} has control characters"
    if m := _JOB_SPACE.match(key):
        if m[1] != queue:
            return f"storage key {key[:200]!r} is in queue {m[1]!r}'s namespace ({own_prefix(m[1])}...)"
        if key[len(m[0]) :].startswith("_"):
            return f"storage key {key[:200]!r} is reserved for offload's own objects ({m[0]}_...)"
        return None
    prefix = prefixes.get(queue)
    if prefix and key.startswith(prefix):
        return None
    allowed = " or ".join(f"{p!r}" for p in (own_prefix(queue), prefix) if p)
    return f"storage key {key[:200]!r} is outside queue {queue!r}'s namespace (keys start with {allowed})"


def check_prefixes(prefixes: Mapping[str, str | None]) -> None:
    """Config validation: each output_prefix a safe directory-like key prefix, no two overlapping, none inside
    a queue's own `results/<name>:` namespace. Raises ConfigError naming the field."""
    given = {q: p for q, p in prefixes.items() if p is not None}
    for queue, prefix in given.items():
        field = f"queues.{queue}.output_prefix"
        if not prefix.endswith("/"):
            raise ConfigError(f"{field}: must end with '/' (a directory-like prefix), got {prefix!r}")
        try:
            validate_key(prefix + "x")
        except InvalidKey as exc:
            raise ConfigError(f"{field}: {exc}") from None
        if _JOB_SPACE.match(prefix):
            raise ConfigError(f"{field}: {prefix!r} is inside a queue's own namespace (results/<queue>:...)")
    for queue, prefix in given.items():
        for other, theirs in given.items():
            if other != queue and (prefix.startswith(theirs) or theirs.startswith(prefix)) and queue < other:
                raise ConfigError(
                    f"queues.{queue}.output_prefix: {prefix!r} overlaps queue {other!r}'s "
                    f"{theirs!r}: a producer of one could overwrite the other's results"
                )
