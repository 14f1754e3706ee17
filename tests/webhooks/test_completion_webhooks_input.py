"""Completion webhooks: what a callback URL may be (refused at enqueue with a 4xx naming the field, at config load,
by the Python client) and the outbox the store writes in the step that ends a job (real Valkey and server)."""

from __future__ import annotations

from typing import Any

import pytest
from support.server_helpers import client, new_queue, server

from offload.config import Settings, cross_checks
from offload.errors import InvalidJob
from offload.queue import keyspace
from offload.queue.outbox import Outbox
from offload.queue.specs import JobSpec, check_options
from offload.queue.store import QueueStore

ALLOWED = "https://hooks.example.com/offload"
HOSTILE = {
    "file:///etc/passwd": "must be an http:// or https:// URL, got scheme 'file'",
    "https://evil.example.net/x": "names host 'evil.example.net', which callbacks.hosts does not allow",
    "https://user:pw@hooks.example.com/x": "must not carry credentials",
    "https://hooks.example.com/a b": "must not contain spaces",
    "https://hooks.example.com.evil.net/x": "which callbacks.hosts does not allow",
    "http://169.254.169.254/latest": "which callbacks.hosts does not allow",
}


def _settings(queue: str) -> dict[str, Any]:
    return {"queues": {queue: {}}, "callbacks": {"hosts": ["hooks.example.com"]}}


def test_hostile_callback_urls_get_a_422_naming_the_field(valkey_url: str) -> None:
    queue = new_queue("cb")
    with server(valkey_url, settings=_settings(queue)) as (url, admin), client(url, admin) as c:
        for bad, why in HOSTILE.items():
            r = c.post(f"/v1/queues/{queue}/jobs", json={"input": 1, "callback_url": bad})
            assert r.status_code == 422, (bad, r.text)
            (problem,) = r.json()["detail"]
            assert problem["path"] == "body.callback_url" and why in problem["msg"], (bad, problem)
        huge = ALLOWED + "?" + "a" * 10_240
        r = c.post(f"/v1/queues/{queue}/jobs", json={"input": 1, "callback_url": huge})
        assert r.status_code == 422 and r.json()["detail"][0]["path"] == "body.callback_url"
        assert len(r.text) < 2_000  # the error names the field, it does not echo 10 KB back
        r = c.post(
            f"/v1/queues/{queue}/jobs/batch", json={"jobs": [{"input": 1}, {"input": 2, "callback_url": "ftp://x/"}]}
        )
        assert r.status_code == 422 and r.json()["detail"][0]["path"] == "body.jobs.1.callback_url"
        r = c.post(f"/v1/queues/{queue}/jobs", json={"input": 1, "callback_url": ALLOWED})
        assert r.status_code == 201
        assert c.get(f"/v1/jobs/{r.json()['id']}").json()["callback_url"] == ALLOWED
        # a token in the query is the producer's: every key that reads the job sees it masked
        r = c.post(f"/v1/queues/{queue}/jobs", json={"input": 1, "callback_url": ALLOWED + "?token=tk-s3cr3t&n=1"})
        assert r.status_code == 201
        assert c.get(f"/v1/jobs/{r.json()['id']}").json()["callback_url"] == ALLOWED + "?token=***&n=1"


def test_no_callback_host_is_allowed_until_the_operator_lists_one(valkey_url: str) -> None:
    queue = new_queue("cb")
    with server(valkey_url, settings={"queues": {queue: {}}}) as (url, admin), client(url, admin) as c:
        r = c.post(f"/v1/queues/{queue}/jobs", json={"input": 1, "callback_url": ALLOWED})
        assert r.status_code == 422
        assert "(allowed: none configured)" in r.json()["detail"][0]["msg"]


def test_the_config_refuses_a_queue_callback_url_on_a_host_it_does_not_allow() -> None:
    queues = {"gpu": {"callback_url": "https://elsewhere.example.org/h"}}
    settings = Settings.model_validate({"queues": queues, "callbacks": {"hosts": [".example.com"]}})
    (problem,) = [str(p) for p in cross_checks(settings)]
    assert problem.startswith("queues.gpu.callback_url: names host 'elsewhere.example.org'")
    with pytest.raises(ValueError, match="must be an http:// or https:// URL"):
        Settings.model_validate({"queues": {"gpu": {"callback_url": "file:///tmp/x"}}})
    with pytest.raises(ValueError, match="claim_s"):
        Settings.model_validate({"callbacks": {"timeout_s": 30, "claim_s": 10}})
    ok = Settings.model_validate({"callbacks": {"hosts": [".example.com"]}})
    assert ok.callbacks.problem("https://a.b.example.com/x") is None


def test_the_python_client_refuses_a_malformed_callback_url_before_it_reaches_the_store() -> None:
    with pytest.raises(InvalidJob, match="callback_url must be an http") as caught:
        check_options(JobSpec(input=1, callback_url="javascript:alert(1)"))
    assert caught.value.field == "callback_url"
    check_options(JobSpec(input=1, callback_url=ALLOWED))


async def test_the_step_that_ends_a_job_owes_its_webhook_and_only_then(store: QueueStore) -> None:
    """The outbox entry is written by the script that ends the job (no window for a crash between the two): a
    job with a callback URL owes one when it succeeds or is cancelled (dead: test_completion_webhooks.py); a job
    without one owes nothing, until its queue gets a callback URL of its own."""
    queue = new_queue("cb")
    outbox = Outbox(store.redis)
    due = keyspace.callback_due(queue)
    with_url = await store.enqueue(queue, JobSpec(input=1, callback_url=ALLOWED))
    plain = await store.enqueue(queue, JobSpec(input=2))
    jobs = await store.claim(queue, "w1", 2)
    assert {j.id for j in jobs} == {with_url, plain}
    for j in jobs:
        await store.complete(j.id, j.token, "results/x.json")
    assert await store.redis.zrange(due, 0, -1) == [with_url]

    await outbox.set_queue_callback(queue, True)
    waiting = await store.enqueue(queue, JobSpec(input=3))
    assert await store.cancel(waiting) == "cancelled"  # a waiting job: cancel.lua reads the record itself
    assert set(await store.redis.zrange(due, 0, -1)) == {with_url, waiting}

    claimed = await outbox.claim(queue, 10, 60_000)
    assert {c.job_id for c in claimed} == {with_url, waiting}
    assert await outbox.claim(queue, 10, 60_000) == []  # claimed: no other sender gets them meanwhile
    first = next(c for c in claimed if c.job_id == with_url)
    assert await outbox.settle(queue, first, "ok")
    assert not await outbox.settle(queue, first, "ok")  # a stale claim changes nothing
    await outbox.set_queue_callback(queue, False)
    assert await store.redis.zrange(due, 0, -1) == [waiting]
    assert await store.purge(queue, "cancelled") == 1  # a purged job takes its webhook with it
    assert await store.redis.zrange(due, 0, -1) == []
    assert await store.redis.hgetall(keyspace.callback_info(queue)) == {}
