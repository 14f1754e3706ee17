"""The control-plane server: HTTP API, API keys, the GPU-worker protocol, SSE events and /metrics."""

from offload.server.app import create_app
from offload.server.state import ServerOptions

__all__ = ["ServerOptions", "create_app"]
