"""GET /v1/jobs/{id}/attempts over real HTTP against a real server and Valkey: each attempt as the scripts recorded
it; the token of a running lease never shown (it fences writes), an ended one's shown; a provider-console link only
where offload.yaml's backend is Replicate's own API, built from the remote id alone and escaped; the job's events;
404 for a gone job, 403 for a key of another queue."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support.dashboard_helpers import enqueue
from support.server_helpers import client, make_key, new_queue, server, store_call
from support.servers import ValkeyServer

from offload.queue.store import QueueStore

pytestmark = pytest.mark.xdist_group("server-attempts")
Q = new_queue("att")


@pytest.fixture(scope="module")
def api(valkey: ValkeyServer) -> Iterator[tuple[str, str]]:
    settings: dict[str, Any] = {
        "backends": {
            "rep": {"kind": "replicate", "model": "acme/sdxl", "api_key": "r8_secret_never_shown"},
            "proxy": {"kind": "replicate", "model": "acme/sdxl", "base_url": "https://replicate.example.com/v1"},
            "jobs": {"kind": "http-job", "base_url": "https://gpu.example.com"},
        },
        "queues": {Q: {"backend": "rep"}},
    }
    with server(valkey.url, settings=settings) as srv:
        yield srv


def test_attempts_with_tokens_console_links_and_events(
    api: tuple[str, str], admin: httpx.Client, valkey: ValkeyServer
) -> None:
    (job_id,) = enqueue(admin, Q, {"prompt": "x"})

    async def two_attempts(store: QueueStore) -> str:
        for backend, remote in (("rep", "p/../x?y=<z>"), ("proxy", "p2")):
            (job,) = await store.claim(Q, "host-a:7", 1)
            (begun,) = await store.begin_many(Q, [(job.id, job.token, 0.0)], backend=backend)
            await store.checkpoint_many(Q, [(job.id, job.token, backend, remote, begun.submission)])
            if backend == "rep":
                await store.fail(job.id, job.token, "HTTP 500", delay_ms=0, answered=True)
        return job.token

    running_token = store_call(valkey.url, two_attempts)
    reply = admin.get(f"/v1/jobs/{job_id}/attempts")
    assert reply.status_code == 200, reply.text
    story = reply.json()
    first, second = story["attempts"]
    assert story["made"] == 2 and first["outcome"] == "failed" and second["outcome"] is None
    assert first["token"] and second["token"] is None and running_token not in reply.text
    assert first["console_url"] == "https://replicate.com/p/p%2F..%2Fx%3Fy%3D%3Cz%3E"
    assert second["console_url"] is None  # a Replicate-compatible proxy: no page of Replicate's
    assert "r8_secret" not in reply.text
    states = [e["state"] for e in story["events"]]
    assert states == ["queued", "active", "submitted", "retrying", "queued", "active", "submitted"]


def test_attempts_of_a_gone_job_and_of_another_queue(api: tuple[str, str], admin: httpx.Client) -> None:
    (job_id,) = enqueue(admin, Q, {"prompt": "y"})
    assert admin.get(f"/v1/jobs/{Q}:0000/attempts").status_code == 404
    assert admin.get("/v1/jobs/no-queue-here/attempts").json()["error"]
    other = make_key(*api, "viewer", [new_queue("other")])
    with client(api[0], other) as viewer:
        refused = viewer.get(f"/v1/jobs/{job_id}/attempts")
    assert refused.status_code == 403 and refused.json()["error"]
    untouched = admin.get(f"/v1/jobs/{job_id}/attempts").json()
    assert untouched["made"] == 0 and untouched["attempts"] == []
