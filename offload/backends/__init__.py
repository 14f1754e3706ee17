"""Remote GPU/model APIs behind one interface (`Backend`), and the registry that builds one from its settings.

    backend = create_backend("sdxl", RunPodSettings(endpoint_id="abc123", api_key=key), client)
    submission = await backend.submit({"prompt": "..."}, tag=job_id)

The settings are the typed model of the kind (offload.backends.settings), as offload.config validated them from
offload.yaml; a plain mapping is validated by the same model first. Pass one shared `httpx.AsyncClient` (see
`new_client`) to all backends of a process so their polls share one pool.

Only the interface and the settings are imported with the package: the backend modules (and the HTTP stack of
the `worker` extra under them) load when a backend is built, so reading offload.yaml does not need them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

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
    TooLarge,
    Transient,
)
from offload.backends.settings import KINDS, AnyBackendSettings, BackendSettings
from offload.extras import require
from offload.schema import parse

if TYPE_CHECKING:
    import httpx

    from offload.backends.fal import FalBackend
    from offload.backends.http import new_client
    from offload.backends.http_job import HttpJobBackend
    from offload.backends.openai import OpenAIBackend
    from offload.backends.replicate import ReplicateBackend
    from offload.backends.runpod import RunPodBackend


def backend_settings(name: str, settings: Mapping[str, Any]) -> AnyBackendSettings:
    """Validate one `backends.<name>` mapping (its `kind` included) by the model of its kind; a ConfigError names
    `backends.<name>.<field>`. offload.config does this for every backend of offload.yaml."""
    parsed: AnyBackendSettings = parse(BackendSettings, dict(settings), f"backends.{name}")
    return parsed


def create_backend(
    name: str, settings: AnyBackendSettings | Mapping[str, Any], client: httpx.AsyncClient | None = None
) -> Backend:
    """Build backend `name` from its typed settings (a mapping is validated first, see `backend_settings`). The
    backend, and its client when none is passed, is created only from settings already checked."""
    if isinstance(settings, Mapping):
        settings = backend_settings(name, settings)
    require("worker", "aiohttp", "dispatching to a backend")
    from offload.backends.fal import FalBackend
    from offload.backends.http_job import HttpJobBackend
    from offload.backends.openai import OpenAIBackend
    from offload.backends.replicate import ReplicateBackend
    from offload.backends.runpod import RunPodBackend
    from offload.backends.settings import (
        AnthropicBatchSettings,
        FalSettings,
        HttpJobSettings,
        OpenAIBatchSettings,
        OpenAISettings,
        ReplicateSettings,
    )

    if isinstance(settings, OpenAIBatchSettings | AnthropicBatchSettings):
        from offload.backends.batched import BatchBackend

        return BatchBackend.from_settings(name, settings, client)
    if isinstance(settings, HttpJobSettings):
        return HttpJobBackend.from_settings(name, settings, client)
    if isinstance(settings, OpenAISettings):
        return OpenAIBackend.from_settings(name, settings, client)
    if isinstance(settings, ReplicateSettings):
        return ReplicateBackend.from_settings(name, settings, client)
    if isinstance(settings, FalSettings):
        return FalBackend.from_settings(name, settings, client)
    return RunPodBackend.from_settings(name, settings, client)


_LAZY = {
    "new_client": "offload.backends.http",
    "FalBackend": "offload.backends.fal",
    "HttpJobBackend": "offload.backends.http_job",
    "OpenAIBackend": "offload.backends.openai",
    "ReplicateBackend": "offload.backends.replicate",
    "RunPodBackend": "offload.backends.runpod",
}


def __getattr__(name: str) -> Any:
    """The backend classes and `new_client`, imported on first use (see the module docstring)."""
    if name in _LAZY:
        import importlib

        require("worker", "aiohttp", "the dispatch worker")
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "KINDS",
    "TERMINAL",
    "AnyBackendSettings",
    "Backend",
    "BackendError",
    "BackendSettings",
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
    "TooLarge",
    "Transient",
    "backend_settings",
    "create_backend",
    "new_client",
]
