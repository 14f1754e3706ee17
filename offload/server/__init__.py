"""The control-plane server: HTTP API, API keys, the GPU-worker protocol, SSE events and /metrics.

Nothing is imported here eagerly: other packages (the autoscaler checking a worker key, the CLI) import leaf
modules such as `offload.server.keys` without loading the FastAPI app, whose routes import them back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from offload.server.app import create_app
    from offload.server.state import ServerOptions

__all__ = ["ServerOptions", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from offload.server.app import create_app

        return create_app
    if name == "ServerOptions":
        from offload.server.state import ServerOptions

        return ServerOptions
    raise AttributeError(name)
