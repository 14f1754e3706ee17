"""Completion webhooks for producers, end to end: a real offload server (uvicorn, in a thread), a real Valkey and a
real receiver (tests/support/callback_receiver.py) that verifies every signature with the official
`standardwebhooks` library, as a producer's endpoint would. Jobs end the way workers end them (the store's
complete, fail and cancel), so each test watches the server's sender alone."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import httpx
import orjson
import pytest
from standardwebhooks import Webhook
from support.callback_receiver import Received, Receiver, receiver
from support.eventually import eventually_sync
from support.server_helpers import client, make_key, new_queue, server, store_call

from offload.queue.store import QueueStore

T = TypeVar("T")
VAULT_KEY = "test-master-key-0123456789abcdef"


@pytest.fixture(autouse=True)
def vault_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OFFLOAD_VAULT_MASTER_KEY", VAULT_KEY)


def callbacks(**over: Any) -> dict[str, Any]:
    """A `callbacks:` block for a receiver on this machine, with waits short enough for a test."""
    block = {
        "hosts": ["127.0.0.1"],
        "allow_private_hosts": True,
        "max_tries": 3,
        "backoff_s": 0.05,
        "backoff_cap_s": 0.2,
        "poll_s": 0.05,
        "timeout_s": 5.0,
        "claim_s": 6.0,
    }
    return block | over


def settings(queue: str, queue_url: str | None = None, **over: Any) -> dict[str, Any]:
    q = {} if queue_url is None else {"callback_url": queue_url}
    return {"queues": {queue: q}, "callbacks": callbacks(**over)}


def end_job(redis_url: str, queue: str, how: str = "succeed") -> str:
    """Claim the queue's next job as a worker would and end it: succeed, fail for good, or cancel."""

    async def go(store: QueueStore) -> str:
        (job,) = await store.claim(queue, "test-worker", 1)
        if how == "succeed":
            await store.complete(job.id, job.token, "results/out.json", cost=0.25)
        elif how == "fail":
            await store.fail(job.id, job.token, "CUDA out of memory", retryable=False)
        else:
            await store.cancel(job.id)
            await store.ack_cancel(job.id, job.token)
        return job.id

    return store_call(redis_url, go)


def enqueue(c: httpx.Client, queue: str, callback_url: str | None = None) -> str:
    body: dict[str, Any] = {"input": {"prompt": "a secret prompt"}}
    if callback_url is not None:
        body["callback_url"] = callback_url
    r = c.post(f"/v1/queues/{queue}/jobs", json=body)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def delivered(rec: Receiver, job_id: str, n: int = 1) -> list[Received]:
    got: list[Received] = eventually_sync(
        lambda: (got := rec.accepted(job_id)) and len(got) >= n and got,
        what=f"{n} accepted webhook(s) of {job_id}",
        why=lambda: repr([(r.status, r.headers.get("webhook-id")) for r in rec.received]),
    )
    return got


@contextmanager
def running(redis_url: str, config: dict[str, Any]) -> Iterator[httpx.Client]:
    with server(redis_url, settings=config) as (url, admin), client(url, admin) as c:
        yield c


def test_a_webhook_verifies_with_the_official_library_before_during_and_after_a_rotation(valkey_url: str) -> None:
    queue = new_queue("cb")
    with receiver() as rec, running(valkey_url, settings(queue)) as c:
        first = enqueue(c, queue, rec.url)
        end_job(valkey_url, queue)
        (got,) = delivered(rec, first)
        old = c.get(f"/v1/queues/{queue}/callbacks/secret").json()["secret"]
        assert old.startswith("whsec_")
        data = Webhook(old).verify(got.body, got.headers)
        assert data["type"] == "job.succeeded" and data["data"]["id"] == first
        assert data["data"]["state"] == "succeeded" and data["data"]["cost"] == 0.25
        assert data["data"]["result"] == "results/out.json" and data["data"]["attempts"] == 1
        assert b"secret prompt" not in got.body and b"whsec_" not in got.body  # never the input, never a secret
        assert got.headers["webhook-id"].startswith(first + ".")

        rotated = c.post(f"/v1/queues/{queue}/callbacks/secret/rotate", json={"grace_s": 3600}).json()
        new = rotated["secret"]
        assert new != old and rotated["previous"] == old and rotated["previous_until"] > 0
        second = enqueue(c, queue, rec.url)
        end_job(valkey_url, queue, "fail")
        (during,) = delivered(rec, second)
        assert len(during.headers["webhook-signature"].split(" ")) == 2
        for secret in (old, new):  # a receiver on either secret accepts it
            assert Webhook(secret).verify(during.body, during.headers)["data"]["state"] == "dead"
        assert orjson.loads(during.body)["data"]["error"] == "CUDA out of memory"

        c.post(f"/v1/queues/{queue}/callbacks/secret/rotate", json={"grace_s": 0})
        newest = c.get(f"/v1/queues/{queue}/callbacks/secret").json()
        assert newest["previous"] is None
        third = enqueue(c, queue, rec.url)
        end_job(valkey_url, queue, "cancel")
        (after,) = delivered(rec, third)
        assert Webhook(newest["secret"]).verify(after.body, after.headers)["type"] == "job.cancelled"
        with pytest.raises(Exception, match="No matching signature"):
            Webhook(old).verify(after.body, after.headers)


def test_only_an_admin_key_sees_or_rotates_the_secret(valkey_url: str) -> None:
    queue = new_queue("cb")
    with running(valkey_url, settings(queue)) as c:
        producer = make_key(str(c.base_url), c.headers["Authorization"].split()[1], "producer", [queue])
        with client(str(c.base_url), producer) as p:
            assert p.get(f"/v1/queues/{queue}/callbacks/secret").status_code == 403
            assert p.post(f"/v1/queues/{queue}/callbacks/secret/rotate", json={}).status_code == 403
            assert p.get(f"/v1/queues/{queue}/callbacks/failed").status_code == 200  # its queue's failures
        assert c.get(f"/v1/queues/{queue}/callbacks/secret").status_code == 200


def test_a_receiver_that_fails_twice_gets_exactly_one_accepted_delivery(valkey_url: str) -> None:
    """The queue's own callback_url (offload.yaml), no per-job one: the third try is accepted, and nothing more is
    owed after it."""
    queue = new_queue("cb")
    with receiver() as rec:
        rec.answers = [500, 503]
        with running(valkey_url, settings(queue, rec.url)) as c:
            job_id = enqueue(c, queue)
            end_job(valkey_url, queue)
            delivered(rec, job_id)
            eventually_sync(lambda: c.get(f"/v1/queues/{queue}/callbacks/failed").json()["owed"] == 0, what="none owed")
            tries = rec.of(job_id)
            assert [t.status for t in tries] == [500, 503, 200]
            assert len({t.headers["webhook-id"] for t in tries}) == 1  # one message, retried: a receiver dedupes
            assert c.get(f"/v1/queues/{queue}/callbacks/failed").json()["failed"] == []
            assert len(rec.accepted(job_id)) == 1


def test_an_always_failing_receiver_is_dead_lettered_with_its_reason_and_can_be_requeued(valkey_url: str) -> None:
    queue = new_queue("cb")
    with receiver() as rec:
        rec.otherwise = 500
        with running(valkey_url, settings(queue)) as c:
            job_id = enqueue(c, queue, rec.url)
            end_job(valkey_url, queue)
            page = eventually_sync(
                lambda: (p := c.get(f"/v1/queues/{queue}/callbacks/failed").json())["failed"] and p,
                what="a dead-lettered webhook",
            )
            (failed,) = page["failed"]
            assert failed["job_id"] == job_id and failed["tries"] == 3 and page["owed"] == 0
            assert failed["error"] == "HTTP 500: receiver says no (after 3 tries)"
            assert [r.status for r in rec.of(job_id)] == [500, 500, 500]

            rec.otherwise = 200
            r = c.post(f"/v1/queues/{queue}/callbacks/failed/requeue", json={"all": True})
            assert r.status_code == 200 and r.json()["moved"] == [job_id]
            delivered(rec, job_id)
            eventually_sync(lambda: c.get(f"/v1/queues/{queue}/callbacks/failed").json()["owed"] == 0, what="sent")
            assert c.get(f"/v1/queues/{queue}/callbacks/failed").json()["failed"] == []


def test_a_webhook_whose_sender_was_stopped_mid_post_is_delivered_by_the_next_server(valkey_url: str) -> None:
    """The first server's sender is cancelled inside its POST (the receiver never answers it), as a SIGKILL would
    leave it: its claim runs out and the next server sends the webhook; a job that ended while no server ran is
    sent too. Each is accepted exactly once."""
    queue = new_queue("cb")
    config = settings(queue, timeout_s=8.0, claim_s=9.0)
    with receiver() as rec:
        rec.hold_first = True
        with running(valkey_url, config) as c:
            first = enqueue(c, queue, rec.url)
            second = enqueue(c, queue, rec.url)
            end_job(valkey_url, queue)
            eventually_sync(lambda: rec.received, what="the first POST, held by the receiver")
        # the server is gone, its POST unanswered; this job ends with no server running at all
        end_job(valkey_url, queue)
        with running(valkey_url, config):
            delivered(rec, first)
            delivered(rec, second)
        assert [r.status for r in rec.of(first)] == ["held", 200]
        assert [r.status for r in rec.of(second)] == [200]


def test_two_servers_send_each_webhook_once(valkey_url: str) -> None:
    """Both servers' senders poll the same outbox: the claim in the store gives each webhook to one of them."""
    queue = new_queue("cb")
    with receiver() as rec, running(valkey_url, config := settings(queue, rec.url)) as c, running(valkey_url, config):
        ids = [enqueue(c, queue) for _ in range(30)]

        async def end_all(store: QueueStore) -> None:
            for job in await store.claim(queue, "test-worker", len(ids)):
                await store.complete(job.id, job.token, "results/out.json")

        store_call(valkey_url, end_all)
        eventually_sync(lambda: len(rec.accepted()) >= len(ids), what="every webhook accepted")
        eventually_sync(lambda: c.get(f"/v1/queues/{queue}/callbacks/failed").json()["owed"] == 0, what="none owed")
        assert sorted(r.job_id for r in rec.received) == sorted(ids)  # each once, by one server or the other
