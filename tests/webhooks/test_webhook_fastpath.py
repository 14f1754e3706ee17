"""The server's webhook fast path (routes_hooks.FastPath, answering deliveries outside FastAPI) under faults: the
job store down in the middle of a delivery, bodies that never say how long they are, providers that hang up.
Each answer is the JSON a FastAPI route would have given, and nothing about the job is lost or made up.

A real `offload server` (uvicorn, in a thread) on a Valkey of the test's own, which the test stops and starts.
RunPod deliveries: the URL's secret is their whole proof, so the test can deliver as the provider would.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import quote, urlsplit

import orjson
import pytest
from support import server_helpers
from support.servers import ValkeyServer, free_port

from bench import web
from offload.config import Settings
from offload.connection import connect
from offload.queue.keyspace import hook_digest
from offload.queue.replies import Verdict
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore

SECRET = "fast-path-secret-0123456789abcdef"


@pytest.fixture
def server(own_valkey: ValkeyServer, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    settings = Settings.model_validate(
        {
            "redis_url": own_valkey.url,
            "storage": {"kind": "local", "path": str(tmp_path / "results")},
            "server": {"public_url": f"http://127.0.0.1:{port}"},
            "backends": {"rp": {"kind": "runpod", "endpoint_id": "ep1", "api_key": "k"}},
            "queues": {"q": {"backend": "rp"}},
        }
    )
    with server_helpers.server(own_valkey.url, settings=settings, port=port) as (url, _):
        yield url


@pytest.fixture
async def store(own_valkey: ValkeyServer) -> AsyncIterator[QueueStore]:
    redis = await connect(own_valkey.url)
    try:
        yield QueueStore(redis)
    finally:
        await redis.aclose()


async def submitted_job(store: QueueStore) -> str:
    """A job whose first submission's intent is open with SECRET's digest, as a worker leaves it inside the
    submit call (no remote id yet): a delivery naming a remote job adopts it."""
    (job_id,) = await store.enqueue_many("q", [JobSpec(input={"n": 1})])
    (claimed,) = await store.claim("q", "w1", 1)
    (verdict,) = await store.begin_many("q", [(claimed.id, claimed.token, 0.0, hook_digest("rp", SECRET))])
    assert verdict.verdict is Verdict.OK, verdict
    return job_id


def hook(server: str, job_id: str, secret: str = SECRET) -> str:
    return f"{server}/v1/hooks/rp/{quote(job_id, safe='')}/1/{secret}"


def report(remote_id: str) -> bytes:
    return orjson.dumps({"id": remote_id, "status": "IN_PROGRESS"})


async def test_a_delivery_while_the_job_store_is_down_gets_503_json_then_its_retry_lands(
    own_valkey: ValkeyServer, server: str, store: QueueStore, caplog: pytest.LogCaptureFixture
) -> None:
    """The fast path hands a delivery that fails unexpectedly to FastAPI, whose error mapping answers 503 with
    Retry-After (the provider retries) and logs the path without its secret; the retry after the restart
    records the remote job, once."""
    job_id = await submitted_job(store)
    own_valkey.stop()
    async with web.async_client(timeout=30) as http:
        down = await http.post(hook(server, job_id), content=report("rp-remote-1"))
        assert down.status_code == 503, down.text
        assert down.json() == {"error": "unavailable", "detail": "the job store is unavailable; retry later"}
        assert down.headers["retry-after"] == "1"
        own_valkey.restart()
        answers = []
        for _ in range(40):  # the server's pool reconnects on its own; poll until it does
            answer = await http.post(hook(server, job_id), content=report("rp-remote-1"))
            answers.append(answer.status_code)
            if answer.status_code == 200:
                break
            await asyncio.sleep(0.25)
        assert answer.status_code == 200, answers
        assert answer.json() == {"ok": True, "verdict": "started"}
        again = await http.post(hook(server, job_id), content=report("rp-remote-1"))
        assert again.status_code == 200 and again.json()["verdict"] not in ("started", "adopted")
    assert "job store error on POST /v1/hooks/rp/" in caplog.text and SECRET not in caplog.text
    redis = await connect(own_valkey.url)
    try:
        assert await QueueStore(redis).current_remote(job_id) == ("rp-remote-1", 1)
    finally:
        await redis.aclose()


async def test_a_chunked_body_over_the_bound_gets_413_json_and_changes_nothing(server: str, store: QueueStore) -> None:
    """No Content-Length to refuse it by: the bound is counted as the chunks arrive."""
    job_id = await submitted_job(store)

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"id": "rp-big", "status": "IN_PROGRESS", "logs": "'
        for _ in range(20):
            yield b"x" * 65536
        yield b'"}'

    async with web.async_client(timeout=30) as http:
        huge = await http.post(hook(server, job_id), content=chunks())
        assert "content-length" not in {k.lower() for k in huge.request.headers}
        assert huge.status_code == 413, huge.text
        assert huge.json()["error"] == "too_large" and "limit" in huge.json()["detail"]
    assert await store.current_remote(job_id) == (None, 1)


async def test_a_provider_hanging_up_mid_body_leaves_the_server_answering(server: str, store: QueueStore) -> None:
    """Half a body, then the connection closes: nothing is recorded, and the next delivery is answered."""
    job_id = await submitted_job(store)
    parts = urlsplit(hook(server, job_id))
    body = report("rp-half")
    head = (
        f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body) + 100}\r\n\r\n"
    ).encode()
    with socket.create_connection((parts.hostname, parts.port or 80), timeout=10) as sock:
        sock.sendall(head + body[:10])
    async with web.async_client(timeout=30) as http:
        wrong = await http.post(hook(server, job_id, secret="not-the-secret"), content=body)
        assert wrong.status_code == 404 and wrong.json()["error"] == "not_found"
        assert await store.current_remote(job_id) == (None, 1)
        whole = await http.post(hook(server, job_id), content=report("rp-whole"))
        assert whole.status_code == 200 and whole.json() == {"ok": True, "verdict": "started"}
    assert await store.current_remote(job_id) == ("rp-whole", 1)


@pytest.mark.parametrize(
    ("tail", "status"),
    [
        ("1/" + "s" * 200, 404),  # a secret longer than any we issue
        ("0/" + SECRET, 404),  # submission numbers start at 1
        ("2/" + SECRET, 404),  # a submission that was never begun
        ("99999999999/" + SECRET, 404),  # past the fast path's ten digits: FastAPI's route, same answer
        ("%D9%A3/" + SECRET, 422),  # an Arabic-Indic three is no submission number for either path
        ("1/" + SECRET + "/extra", 404),  # no such route
    ],
)
async def test_hostile_webhook_paths_get_a_json_4xx_and_change_nothing(
    tail: str, status: int, server: str, store: QueueStore
) -> None:
    job_id = await submitted_job(store)
    async with web.async_client(timeout=30) as http:
        answer = await http.post(f"{server}/v1/hooks/rp/{quote(job_id, safe='')}/{tail}", content=report("rp-x"))
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"].startswith("application/json") and answer.json()["error"], answer.text
    assert await store.current_remote(job_id) == (None, 1)
