"""offload's configuration for (c) and the SIGKILL test, polling or with provider webhooks on.

Polling (the default): the real `offload worker` against the simulator's tutorial job API (`http-job`), polls
doubling from 250 ms to `poll_interval` 5 s. With webhooks: the simulator's Replicate API (the tutorial job API
has no webhooks), `server.public_url` set, and a real `offload server` on that URL receiving the simulator's
signed deliveries (Standard Webhooks, the secret below, told to the simulator) and waking the worker; the
worker's fallback poll is then 60 s away. Both write results to a local directory and fetch the output's file
from the simulator, so the two runs differ only in how the worker learns that a remote job ended.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

SECRET = "whsec_" + "YmVuY2gtcGVlcnMtd2ViaG9vay1zZWNyZXQ="
QUEUE = "bench-gpu"


def config(redis_url: str, sim_url: str, results: Path, concurrency: int, public_url: str | None) -> dict[str, Any]:
    """The `offload.yaml` of the worker (and, with `public_url`, of the server: the same file)."""
    if public_url is None:
        backend: dict[str, Any] = {"kind": "http-job", "base_url": sim_url, "api_key": "bench"}
    else:
        backend = {"kind": "replicate", "base_url": sim_url, "version": "bench", "api_key": "bench"}
        backend["webhook_secret"] = SECRET
    out: dict[str, Any] = {
        "redis_url": redis_url,
        "storage": {"kind": "local", "path": str(results)},
        "backends": {"sim": backend},
        "queues": {QUEUE: {"backend": "sim", "concurrency": concurrency, "poll_interval": 5}},
    }
    if public_url is not None:
        out["server"] = {"public_url": public_url}
    return out


def server_argv(config_path: Path, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "offload",
        "server",
        "--config",
        str(config_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--no-access-log",
        "--log-level",
        "warning",
    ]
