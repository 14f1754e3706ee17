"""Remote GPU/model APIs behind one interface (`Backend`), and the registry that builds one from config.

    backend = create_backend("runpod", "sdxl", {"endpoint_id": "abc123", "api_key": key}, client)
    submission = await backend.submit({"prompt": "..."}, tag=job_id)

Settings common to every kind: `base_url`, `api_key` (None: a placeholder credential, which the simulator
accepts), `timeout` (seconds per request) and `max_connections` (only used when no client is passed). Pass one
shared `httpx.AsyncClient` (see `new_client`) to all backends of a process so their polls share one pool.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import httpx

from offload.backends.base import (
    TERMINAL,
    Backend,
    BackendError,
    Fatal,
    NotFound,
    RemoteResult,
    RemoteStatus,
    Submission,
    Throttled,
    Transient,
)
from offload.backends.fal import FalBackend
from offload.backends.http import new_client
from offload.backends.http_job import HttpJobBackend
from offload.backends.openai import OpenAIBackend
from offload.backends.replicate import ReplicateBackend
from offload.backends.runpod import RunPodBackend
from offload.backends.settings import Settings
from offload.errors import ConfigError

Factory = Callable[[str, Settings, httpx.AsyncClient | None], Backend]

KINDS: dict[str, Factory] = {
    "http-job": HttpJobBackend.from_settings,
    "runpod": RunPodBackend.from_settings,
    "replicate": ReplicateBackend.from_settings,
    "fal": FalBackend.from_settings,
    "openai": OpenAIBackend.from_settings,
}


def create_backend(
    kind: str, name: str, settings: Mapping[str, Any], client: httpx.AsyncClient | None = None
) -> Backend:
    """Build backend `name` of `kind` from its settings. Raises ConfigError naming `backends.<name>.<field>` for
    an unknown kind, a missing or malformed setting, or a setting the kind does not know (a typo). Settings are
    all checked before the backend (and its client, when none is passed) is created."""
    factory = KINDS.get(kind)
    if factory is None:
        raise ConfigError(f"backends.{name}.kind: unknown backend kind {kind!r} (known: {', '.join(sorted(KINDS))})")
    return factory(name, Settings(kind, name, settings), client)


__all__ = [
    "KINDS",
    "TERMINAL",
    "Backend",
    "BackendError",
    "FalBackend",
    "Fatal",
    "HttpJobBackend",
    "NotFound",
    "OpenAIBackend",
    "RemoteResult",
    "RemoteStatus",
    "ReplicateBackend",
    "RunPodBackend",
    "Submission",
    "Throttled",
    "Transient",
    "create_backend",
    "new_client",
]
