"""A queue with a rented fleet (the dashboard's autoscaling page, the spend-per-kind tests of issue 40, item 3):
the server's own autoscaler rents one machine through the `mock` provider at a known price; a GPU worker registers
as that instance over HTTP (the protocol a rented machine's `offload worker --handler` speaks) and runs jobs;
another GPU worker registers with no instance (the user's own machine: no price). Real server, real Valkey."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from support.autoscale_helpers import VAULT_KEY
from support.eventually import eventually_sync
from support.server_helpers import client, make_key, server

PRICE = 0.36  # USD per hour of the mock's machine: $0.0001 a second


@contextmanager
def autoscaling_server(
    redis_url: str, extra: dict[str, Any] | None = None, **options: Any
) -> Iterator[tuple[str, str]]:
    """A server whose autoscaler wakes often (and accrues the rental at each pass); `extra`: more of offload.yaml,
    `options`: ServerOptions fields."""
    settings = {"autoscaler": {"tick": 0.2, "recent_task": 0, "drain_settle": 0}, **(extra or {})}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OFFLOAD_VAULT_MASTER_KEY", VAULT_KEY)
        mp.delenv("OFFLOAD_AUTOSCALER", raising=False)
        with server(redis_url, settings=settings, **{"max_wait_s": 5, **options}) as srv:
            yield srv


def rent(admin: httpx.Client, queue: str, *, mock: str = "", price: float = PRICE, **block: Any) -> dict[str, Any]:
    """The queue autoscaled through a mock provider (`mock`, else a fresh name) at `price`, `block` on top of its
    autoscale block; one job queued makes the autoscaler rent one machine. Returns the instance as the API lists
    it, once the provider has it."""
    mock = mock or "mock-" + secrets.token_hex(3)
    r = admin.post("/v1/autoscale/providers", json={"name": mock, "type": "mock", "config": {"price_per_hour": price}})
    assert r.status_code == 201, r.text
    block = {
        "enabled": True,
        "provider": mock,
        "max_workers": 1,
        "poll_interval": "0.2s",
        "scale_up": [{"trigger": "no_workers"}],
        "scale_down": [{"trigger": "idle", "timeout": "10m"}],
        "instance": {"gpu": "RTX 4090", "image": "img", "max_price_per_hour": 0.5},
        **block,
    }
    assert admin.put(f"/v1/autoscale/queues/{queue}", json=block).status_code == 200
    enqueue(admin, queue, {"n": 0})

    def instance() -> Any:
        rows = admin.get("/v1/autoscale/status").json()["instances"]
        return next((i for i in rows if i["queue"] == queue and i["provider_id"]), None)

    found: dict[str, Any] = eventually_sync(instance, 20, "the autoscaler to rent through the mock provider")
    return found


def enqueue(admin: httpx.Client, queue: str, *inputs: Any) -> list[str]:
    r = admin.post(f"/v1/queues/{queue}/jobs/batch", json={"jobs": [{"input": i} for i in inputs]})
    assert r.status_code == 201, r.text
    ids: list[str] = r.json()["ids"]
    return ids


def gpu_worker(url: str, admin_token: str, queue: str, instance_id: str | None) -> tuple[httpx.Client, str]:
    """A registered GPU worker (its client, with a worker key of the queue, and its id)."""
    worker = client(url, make_key(url, admin_token, "worker", [queue]))
    r = worker.post("/v1/workers/register", json={"queues": [queue], "host": "gpu-box", "instance_id": instance_id})
    assert r.status_code == 201, r.text
    return worker, str(r.json()["worker_id"])


def run_one(worker: httpx.Client, worker_id: str, queue: str) -> str:
    """Claim one job and complete it, as the worker's handler loop does; returns the job's id."""
    r = worker.post(f"/v1/workers/{worker_id}/claim", json={"queue": queue, "max": 1, "wait": 5})
    assert r.status_code == 200, r.text
    [job] = r.json()["jobs"]
    done = worker.post(f"/v1/workers/{worker_id}/jobs/{job['id']}/complete", json={"token": job["token"], "output": 1})
    assert done.status_code == 200, done.text
    return str(job["id"])
