"""The control-plane server: HTTP API, API keys, the GPU-worker protocol, SSE events and /metrics.

The package imports nothing itself (the app factory is `offload.server.app.create_app`), so the CLI can import a
leaf module (the runner, the options) without loading the FastAPI app. The API keys it checks live in
offload/access/, below the server and the autoscaler alike.
"""
