"""The control-plane server: HTTP API, API keys, the GPU-worker protocol, SSE events and /metrics.

The package imports nothing itself (the app factory is `offload.server.app.create_app`): other packages, such as
the autoscaler checking a worker key, import leaf modules like `offload.server.keys` without loading the FastAPI
app, whose routes import the autoscaler back.
"""
