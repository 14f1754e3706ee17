"""Provider webhooks end to end: the simulator calls the real offload server, which verifies the delivery and
wakes the dispatch worker holding the job; forged, wrong-secret, replayed, duplicate, reordered and late
deliveries change nothing; a webhook that never comes leaves the job to the fallback poll."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import quote

import httpx
import orjson
import pytest
from support.eventually import eventually
from support.webhook_world import (
    BACKENDS,
    QUEUES,
    REPLICATE_SECRET,
    World,
    configure_sim,
    deliveries,
    sim_jobs,
    sim_requests,
    world,
)

from bench import web
from offload.backends import KINDS, create_backend
from offload.backends.base import WebhookBackend
from offload.config import WEBHOOK_KINDS
from offload.models import JobState
from offload.queue.store import QueueStore
from offload.testing.sim import running_sim

POLL_ROUTES = {"replicate": "replicate.get", "fal": "fal.status", "runpod": "runpod.status"}


@pytest.fixture(scope="module")
def sim_url() -> Iterator[str]:
    with running_sim() as base:
        yield str(base)


def replicate_signed(body: bytes, *, stamp: int | None = None, msg_id: str = "msg_test") -> dict[str, str]:
    """Sign as Replicate does (Standard Webhooks), computed here by hand so the test does not trust the library
    it checks."""
    ts = str(stamp if stamp is not None else int(time.time()))
    key = base64.b64decode(REPLICATE_SECRET.removeprefix("whsec_"))
    mac = hmac.new(key, f"{msg_id}.{ts}.".encode() + body, hashlib.sha256).digest()
    return {"webhook-id": msg_id, "webhook-timestamp": ts, "webhook-signature": "v1," + base64.b64encode(mac).decode()}


def hook_url(sim_url: str, job_id: str) -> str:
    """The webhook URL the worker sent with the job's submission, as the provider (the simulator) got it."""
    (job,) = sim_jobs(sim_url, job_id)
    return str(job["meta"]["webhook"])


@pytest.mark.parametrize("provider", ["replicate", "fal", "runpod"])
async def test_webhook_completes_the_job_without_a_single_poll(
    provider: str, valkey_url: str, sim_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """...and without reading the kept body back: the wake-up carries it (a small body), so each job's record is
    read once, up front, before its webhook came."""
    reads: list[str] = []
    real = QueueStore.hook_bodies

    async def counted(self: QueueStore, items: Sequence[tuple[str, int]]) -> list[str | None]:
        reads.extend(job_id for job_id, _ in items)
        return await real(self, items)

    monkeypatch.setattr(QueueStore, "hook_bodies", counted)
    configure_sim(sim_url, latency=0.3)
    async with world(valkey_url, sim_url, tmp_path) as w, w.worker(provider):
        ids = [await w.enqueue(provider, f"{provider}-{i}") for i in range(5)]
        jobs = [await w.finished(i) for i in ids]
    assert [j.state for j in jobs] == [JobState.SUCCEEDED] * 5
    assert sim_requests(sim_url).get(POLL_ROUTES[provider], 0) == 0  # the fallback poll is 60 s away
    sent = [d for d in deliveries(sim_url) if d["family"] == provider]
    assert len(sent) == 5 and all(d["statuses"] == [200] for d in sent), sent
    for job in jobs:
        assert job.result is not None and job.attempts == 1
    assert sorted(reads) == sorted(ids), reads


@pytest.mark.parametrize("provider", ["replicate", "fal", "runpod"])
async def test_dropped_webhook_leaves_the_job_to_the_fallback_poll(
    provider: str, valkey_url: str, sim_url: str, tmp_path: Path
) -> None:
    configure_sim(sim_url, latency=0.2, drop_rate=1.0)
    async with world(valkey_url, sim_url, tmp_path, poll_s=1.0) as w, w.worker(provider):
        job = await w.finished(await w.enqueue(provider, f"drop-{provider}"))
    assert job.state == JobState.SUCCEEDED
    assert [d["dropped"] for d in deliveries(sim_url)] == [True]
    assert sim_requests(sim_url).get(POLL_ROUTES[provider], 0) >= 1


@pytest.mark.parametrize("provider", ["replicate", "fal", "runpod"])
async def test_duplicate_and_reordered_webhooks_change_nothing(
    provider: str, valkey_url: str, sim_url: str, tmp_path: Path
) -> None:
    configure_sim(sim_url, latency=0.2, duplicate_rate=1.0, reorder_rate=1.0)
    async with world(valkey_url, sim_url, tmp_path) as w, w.worker(provider):
        job_id = await w.enqueue(provider, f"dup-{provider}")
        job = await w.finished(job_id)

        async def all_sent() -> bool:
            return bool(deliveries(sim_url))

        await eventually(all_sent, what="the deliveries")
        after = await w.store.get(job_id)
    (sent,) = deliveries(sim_url)
    assert sent["copies"] == 2 and sent["reordered"] and sent["statuses"] == [200, 200, 200], sent
    assert job.state == after.state == JobState.SUCCEEDED
    assert after.result == job.result and after.attempts == 1 and after.finished_at == job.finished_at


async def _held_job(w: World, provider: str, sim_url: str, name: str) -> tuple[str, str]:
    """A job submitted with its webhook dropped, still running at the provider side of offload (polls are
    60 s apart): (job id, its webhook URL)."""
    job_id = await w.enqueue(provider, name)

    async def submitted() -> bool:
        return bool(sim_jobs(sim_url, job_id)) and (await w.store.get(job_id)).remote_id is not None

    await eventually(submitted, what="the submission")
    return job_id, hook_url(sim_url, job_id)


async def test_forged_wrong_secret_and_replayed_deliveries_are_refused(
    valkey_url: str, sim_url: str, tmp_path: Path
) -> None:
    configure_sim(sim_url, latency=0.2, drop_rate=1.0)
    async with world(valkey_url, sim_url, tmp_path) as w, w.worker("replicate"):
        job_id, url = await _held_job(w, "replicate", sim_url, "forged")
        remote = (await w.store.get(job_id)).remote_id
        body = orjson.dumps({"id": remote, "status": "succeeded", "output": ["https://evil.example/x.png"]})
        async with web.async_client(timeout=10) as http:
            forged = await http.post(
                url, content=body, headers={**replicate_signed(body), "webhook-signature": "v1,AAAA"}
            )
            unsigned = await http.post(url, content=body)
            replayed = await http.post(url, content=body, headers=replicate_signed(body, stamp=int(time.time()) - 3600))
            wrong_secret = await http.post(
                url.rsplit("/", 1)[0] + "/" + "x" * 32, content=body, headers=replicate_signed(body)
            )
            other_run = await http.post(url.replace("/1/", "/2/"), content=body, headers=replicate_signed(body))
            foreign = await http.post(
                url, content=orjson.dumps({"id": "someone-else", "status": "succeeded", "output": 1})
            )
        assert [forged.status_code, unsigned.status_code, replayed.status_code] == [401, 401, 401]
        assert wrong_secret.status_code == 404 and other_run.status_code == 404
        assert foreign.status_code == 401
        assert forged.json()["error"] and wrong_secret.json()["error"]  # JSON bodies naming the problem
        job = await w.store.get(job_id)
        assert job.state != JobState.SUCCEEDED and job.result is None
        # a genuine delivery (signed with the account's secret) still completes it at once
        real = orjson.dumps({"id": remote, "status": "succeeded", "output": ["fine"]})
        async with web.async_client(timeout=10) as http:
            ok = await http.post(url, content=real, headers=replicate_signed(real))
        assert ok.status_code == 200 and ok.json()["verdict"] == "wake"
        done = await w.finished(job_id, timeout=5)
        assert done.state == JobState.SUCCEEDED


@pytest.mark.parametrize("provider", ["fal", "runpod"])
async def test_fal_and_runpod_forgeries_are_refused(
    provider: str, valkey_url: str, sim_url: str, tmp_path: Path
) -> None:
    configure_sim(sim_url, latency=0.2, drop_rate=1.0)
    async with world(valkey_url, sim_url, tmp_path) as w, w.worker(provider):
        job_id, url = await _held_job(w, provider, sim_url, f"forged-{provider}")
        (sim_job,) = sim_jobs(sim_url, job_id)
        if provider == "fal":
            body = orjson.dumps({"request_id": sim_job["id"], "status": "OK", "payload": {"evil": True}})
            headers = {
                "x-fal-webhook-request-id": sim_job["id"],
                "x-fal-webhook-user-id": "sim-user",
                "x-fal-webhook-timestamp": str(int(time.time())),
                "x-fal-webhook-signature": "ab" * 64,
            }
            async with web.async_client(timeout=10) as http:
                assert (await http.post(url, content=body, headers=headers)).status_code == 401
                assert (await http.post(url, content=body)).status_code == 401
        body = orjson.dumps({"id": sim_job["id"], "status": "COMPLETED", "output": {"evil": True}})
        async with web.async_client(timeout=10) as http:
            assert (await http.post(url.rsplit("/", 1)[0] + "/guess", content=body)).status_code == 404
            assert (await http.post(url.replace(QUEUES[provider], "other"), content=body)).status_code == 404
        assert (await w.store.get(job_id)).result is None


@pytest.mark.parametrize("provider", ["replicate", "fal"])
async def test_a_signed_providers_url_under_runpods_path_is_refused_and_counted(
    provider: str, valkey_url: str, sim_url: str, tmp_path: Path
) -> None:
    """The URL secret of a Replicate (or fal) submission, under the RunPod backend's path
    (whose provider signs nothing), with the same job, submission and secret and an unsigned body naming the
    real remote job as finished. Before, that path took it as RunPod's word and the job succeeded with the
    attacker's output; now the secret is bound to the backend its submission went to: 403, counted, nothing
    recorded. Under the right path the same unsigned body is still a 401 (its signature is checked)."""
    configure_sim(sim_url, latency=0.2, drop_rate=1.0)
    async with world(valkey_url, sim_url, tmp_path) as w, w.worker(provider):
        job_id, url = await _held_job(w, provider, sim_url, f"crossed-{provider}")
        remote = (await w.store.get(job_id)).remote_id
        crossed = url.replace(f"/v1/hooks/{BACKENDS[provider]}/", f"/v1/hooks/{BACKENDS['runpod']}/")
        assert crossed != url
        body = orjson.dumps({"id": remote, "status": "COMPLETED", "output": {"evil": True}})
        async with web.async_client(timeout=10) as http:
            refused = await http.post(crossed, content=body)
            unsigned = await http.post(url, content=body)
            scraped = await http.get(
                f"{w.server_url}/metrics", headers={"Authorization": "Bearer boot-admin-key-for-tests-0123456789"}
            )
        assert refused.status_code == 403, refused.text
        assert refused.json()["detail"] == "this webhook URL was issued for another backend's submission"
        assert unsigned.status_code == 401, unsigned.text
        assert 'offload_webhooks_refused_total{backend="rp",reason="backend"} 1.0' in scraped.text
        assert f'offload_webhooks_refused_total{{backend="{BACKENDS[provider]}",reason="signature"}} 1.0' in (
            scraped.text
        )
        job = await w.store.get(job_id)
        assert job.state != JobState.SUCCEEDED and job.result is None and job.remote_id == remote
        assert await w.store.hook_body(job_id, 1) is None


async def test_late_webhook_after_polling_finished_the_job_changes_nothing(
    valkey_url: str, sim_url: str, tmp_path: Path
) -> None:
    configure_sim(sim_url, latency=0.2, delay_s=3.0)  # the webhook comes 3 s late; the poll is 1 s apart
    async with world(valkey_url, sim_url, tmp_path, poll_s=1.0) as w, w.worker("replicate"):
        job_id = await w.enqueue("replicate", "late")
        job = await w.finished(job_id)

        async def delivered() -> bool:
            return bool(deliveries(sim_url))

        await eventually(delivered, what="the late delivery")
        after = await w.store.get(job_id)
    assert job.state == JobState.SUCCEEDED and deliveries(sim_url)[0]["statuses"] == [200]
    assert after.finished_at == job.finished_at and after.result == job.result


async def test_official_sdk_validates_the_simulators_replicate_signature(sim_url: str) -> None:
    """The `replicate` package's own webhook validation accepts what the simulator sends: the headers and
    the signature scheme are Replicate's, not just self-consistent."""
    from replicate.webhook import Webhooks, WebhookSigningSecret
    from standardwebhooks import Webhook

    configure_sim(sim_url)
    async with web.async_client() as http:
        answer = await http.get(f"{sim_url}/v1/webhooks/default/secret", headers={"Authorization": "Bearer k"})
    secret = answer.json()["key"]
    assert secret == REPLICATE_SECRET
    from offload.testing.sim.webhooks import HookSender

    sender = HookSender(time.time, __import__("random").Random(1))
    sender.replicate_secret = secret
    body = b'{"id":"abc","status":"succeeded"}'

    class _Job:
        family = "replicate"
        id = "abc"

    headers = sender._sign(_Job(), body, "msg_1")  # type: ignore[arg-type]
    Webhooks.validate(headers=headers, body=body.decode(), secret=WebhookSigningSecret(key=secret))
    Webhook(secret).verify(body, headers)
    with pytest.raises(Exception, match="ignature"):
        Webhooks.validate(headers=headers, body=body.decode() + " ", secret=WebhookSigningSecret(key=secret))


def test_exactly_the_webhook_kinds_implement_webhooks() -> None:
    """config.WEBHOOK_KINDS (which backends get a URL) and the backends that can read a webhook agree."""
    settings = {
        "replicate": {"version": "v"},
        "fal": {"app": "a/b"},
        "runpod": {"endpoint_id": "e"},
        "http-job": {"base_url": "http://x"},
        "openai": {"model": "m"},
        "openai-batch": {},  # batches are polled: no webhooks
        "anthropic-batch": {},
    }
    implemented = {
        kind
        for kind in KINDS
        if isinstance(create_backend("b", {"kind": kind, **settings[kind]}, client=web.async_client()), WebhookBackend)
    }
    assert implemented == WEBHOOK_KINDS == set(BACKENDS)


async def test_hostile_deliveries_get_a_4xx_with_a_json_body(valkey_url: str, sim_url: str, tmp_path: Path) -> None:
    """With the right URL secret (RunPod's only check) but a body that is too large, not JSON, or not a RunPod
    job report; and paths that name no webhook. Nothing reaches the job."""
    configure_sim(sim_url, latency=0.2, drop_rate=1.0)
    async with world(valkey_url, sim_url, tmp_path) as w, w.worker("runpod"):
        job_id, url = await _held_job(w, "runpod", sim_url, "hostile")
        base = url.split("/v1/hooks/")[0]
        async with web.async_client(timeout=10) as http:
            huge = await http.post(url, content=b"[" + b"1," * (1 << 20) + b"1]")
            garbage = await http.post(url, content=b"{not json")
            wrong_shape = await http.post(url, content=b'{"hello": "world"}')
            bad_job = await http.post(f"{base}/v1/hooks/rp/not-a-job-id/1/secret", content=b"{}")
            bad_number = await http.post(f"{base}/v1/hooks/rp/{quote(job_id, safe='')}/one/secret", content=b"{}")
            no_hooks = await http.post(f"{base}/v1/hooks/nosuch/{quote(job_id, safe='')}/1/secret", content=b"{}")
        assert (huge.status_code, garbage.status_code, wrong_shape.status_code) == (413, 400, 400)
        assert (bad_job.status_code, bad_number.status_code, no_hooks.status_code) == (404, 422, 404)
        for answer in (huge, garbage, wrong_shape, bad_job, bad_number, no_hooks):
            assert answer.headers["content-type"].startswith("application/json") and answer.json()["error"]
        job = await w.store.get(job_id)
        assert job.result is None and job.state != JobState.SUCCEEDED


async def test_a_lost_submit_answer_is_healed_by_the_webhook_that_came_first(
    valkey_url: str, sim_url: str, tmp_path: Path
) -> None:
    """The provider accepted the submission, the job ran and called back, but the submit's answer never arrived
    (connection reset): the worker takes the remote id the webhook recorded instead of retrying the submit."""
    configure_sim(sim_url, latency=0.1, behaviour={"submit_latency": 1.5, "lost_response_rate": 1.0})
    async with world(valkey_url, sim_url, tmp_path) as w, w.worker("replicate"):
        job = await w.finished(await w.enqueue("replicate", "lost-answer"))
        async with web.async_client() as http:
            stats = (await http.get(f"{sim_url}/_sim/stats")).json()
    assert job.state == JobState.SUCCEEDED and job.attempts == 1 and job.possible_duplicates == 0
    assert stats["submissions"] == 1 and stats["faults"] == {"replicate.create lost_response": 1}, stats


async def test_replicate_asks_for_start_and_a_start_neither_completes_nor_makes_the_worker_poll(
    valkey_url: str, sim_url: str, tmp_path: Path
) -> None:
    """Every submission asks for `start` and `completed`; the start delivery (the prediction as created) is
    verified and changes nothing for a job whose worker recorded the id; the result comes from `completed`
    alone, with no poll."""
    configure_sim(sim_url, latency=1.0)
    async with world(valkey_url, sim_url, tmp_path) as w, w.worker("replicate"):
        job_id = await w.enqueue("replicate", "start-1")
        job = await w.finished(job_id)
    (remote,) = sim_jobs(sim_url, job_id)
    assert remote["meta"]["webhook_events_filter"] == ["start", "completed"]
    (start,) = deliveries(sim_url, "start")
    assert start["statuses"] == [200] and start["sent_at"] < start["ended"]  # sent at once, not at the end
    assert job.state == JobState.SUCCEEDED and job.attempts == 1 and job.possible_duplicates == 0
    assert sim_requests(sim_url).get(POLL_ROUTES["replicate"], 0) == 0


async def test_forged_and_foreign_start_deliveries_cannot_adopt_an_open_submission(
    valkey_url: str, sim_url: str, tmp_path: Path
) -> None:
    """A submission whose answer has not come (the provider holds the create call): its intent is open with
    no remote id, the one moment a start could name any id. A forged signature, a wrong URL secret and an
    unsigned body are refused and record nothing; the genuine start records the id (STARTED), its duplicate
    is a no-op, and a start naming another prediction is refused as a mismatch."""
    configure_sim(sim_url, latency=30.0, behaviour={"submit_latency": 60.0}, drop_rate=1.0)
    async with world(valkey_url, sim_url, tmp_path) as w, w.worker("replicate"):
        job_id = await w.enqueue("replicate", "open")

        async def at_provider() -> bool:
            return bool(sim_jobs(sim_url, job_id))

        await eventually(at_provider, what="the submission to reach the provider")
        (remote,) = sim_jobs(sim_url, job_id)
        url = str(remote["meta"]["webhook"])
        body = orjson.dumps({"id": "attacker-run", "status": "starting"})
        genuine = orjson.dumps({"id": remote["id"], "status": "starting"})
        async with web.async_client(timeout=10) as http:
            forged = await http.post(url, content=body, headers={**replicate_signed(body), "webhook-signature": "v1,A"})
            unsigned = await http.post(url, content=body)
            guessed = await http.post(
                url.rsplit("/", 1)[0] + "/" + "y" * 32, content=body, headers=replicate_signed(body)
            )
            assert (forged.status_code, unsigned.status_code, guessed.status_code) == (401, 401, 404)
            assert await w.store.current_remote(job_id) == (None, 1)
            first = await http.post(url, content=genuine, headers=replicate_signed(genuine, msg_id="msg_a"))
            again = await http.post(url, content=genuine, headers=replicate_signed(genuine, msg_id="msg_a"))
            foreign = await http.post(url, content=body, headers=replicate_signed(body, msg_id="msg_b"))
        assert [r.json()["verdict"] for r in (first, again, foreign)] == ["started", "ok", "mismatch"]
        assert await w.store.current_remote(job_id) == (remote["id"], 1)
        job = await w.store.get(job_id)
        assert job.result is None and job.state != JobState.SUCCEEDED


async def test_a_start_arriving_after_completion_changes_nothing(valkey_url: str, sim_url: str, tmp_path: Path) -> None:
    """Reordered: every start comes after its job's completion (and after the job is stored): LATE, the
    record unchanged."""
    configure_sim(sim_url, latency=0.3, reorder_rate=1.0)
    async with world(valkey_url, sim_url, tmp_path) as w, w.worker("replicate"):
        job_id = await w.enqueue("replicate", "late-start")
        job = await w.finished(job_id)
        before = await w.store.redis.hgetall(f"offload:{{{QUEUES['replicate']}}}:job:{job_id}")

        async def start_sent() -> bool:
            return bool(deliveries(sim_url, "start"))

        await eventually(start_sent, what="the reordered start")
        after = await w.store.redis.hgetall(f"offload:{{{QUEUES['replicate']}}}:job:{job_id}")
    (start,) = deliveries(sim_url, "start")
    (done,) = deliveries(sim_url)
    assert start["reordered"] and start["statuses"] == [200] and start["sent_at"] > done["sent_at"]
    assert job.state == JobState.SUCCEEDED and after == before


async def test_a_burst_of_deliveries_at_once_gets_one_verdict_each(
    valkey_url: str, sim_url: str, tmp_path: Path
) -> None:
    """The server batches the store calls of the deliveries in flight (secret digests, hook.lua): a burst that
    mixes genuine, duplicate, wrong-secret and forged deliveries for many jobs, all sent at once, still gets each
    delivery its own answer, a bad one fails nobody else in its batch, and every job completes once."""
    configure_sim(sim_url, latency=0.2, drop_rate=1.0)
    async with world(valkey_url, sim_url, tmp_path) as w, w.worker("replicate"):
        ids = [await w.enqueue("replicate", f"burst-{i}") for i in range(30)]

        async def all_submitted() -> bool:
            return all([bool(sim_jobs(sim_url, i)) and (await w.store.get(i)).remote_id is not None for i in ids])

        await eventually(all_submitted, what="the submissions")
        sends: list[tuple[str, bytes, dict[str, str]]] = []
        for n, job_id in enumerate(ids):
            url, remote = hook_url(sim_url, job_id), (await w.store.get(job_id)).remote_id
            body = orjson.dumps({"id": remote, "status": "succeeded", "output": [f"out-{n}"]})
            sends.append((url, body, replicate_signed(body, msg_id=f"msg_{n}")))
            sends.append((url, body, replicate_signed(body, msg_id=f"msg_{n}")))  # a duplicate
            sends.append((url.rsplit("/", 1)[0] + "/" + "x" * 32, body, replicate_signed(body)))  # wrong secret
            sends.append((url, body, {**replicate_signed(body), "webhook-signature": "v1,AAAA"}))  # forged
        async with web.async_client(timeout=30, limits=httpx.Limits(max_connections=200)) as http:
            replies = await asyncio.gather(*(http.post(u, content=b, headers=h) for u, b, h in sends))
        for k in range(0, len(replies), 4):
            genuine, duplicate, wrong, forged = replies[k : k + 4]
            verdicts = {genuine.json()["verdict"], duplicate.json()["verdict"]}
            # one of the two wakes the worker; the other finds it kept (dup), or already stored (late)
            assert genuine.status_code == duplicate.status_code == 200, verdicts
            assert verdicts in ({"wake", "dup"}, {"wake", "late"}), verdicts
            assert (wrong.status_code, forged.status_code) == (404, 401)
        done = [await w.finished(i, timeout=15) for i in ids]
    assert all(j.state == JobState.SUCCEEDED and j.attempts == 1 for j in done)
