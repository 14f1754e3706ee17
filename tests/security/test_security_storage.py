"""Queue isolation down to storage: a key of one queue can neither write another
queue's objects (through an output_key) nor get a presigned URL to them; unsafe output keys are refused at
enqueue, and a job whose key cannot be stored fails once, permanently, on both worker paths, before anything is
paid for. Real Valkey, real S3 (rclone), a real server over TCP, the real simulator."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import orjson
import pytest
from support.admin_redis import redis_admin
from support.eventually import eventually_sync
from support.s3server import RcloneS3
from support.server_helpers import BUCKET, client, make_key, new_queue, server
from support.servers import ValkeyServer

from bench import web
from offload.config import Settings, load_settings
from offload.connection import connect
from offload.errors import ConfigError
from offload.eventloop import within
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.storage.inputs import outputs_prefix
from offload.testing.sim.config import SimConfig
from offload.testing.sim.server import running_sim
from offload.worker.run import run_worker

T = TypeVar("T")


@pytest.fixture(scope="module")
def api(valkey: ValkeyServer, s3: RcloneS3) -> Iterator[tuple[str, str]]:
    with server(valkey.url, s3.settings(BUCKET), max_wait_s=1) as srv:
        yield srv


def on_store(url: str, fn: Callable[[QueueStore], Awaitable[T]]) -> T:
    """A producer or operator with direct Redis access (trusted: the Python client, the CLI, tutorial RPUSH)."""

    async def go() -> T:
        redis = await connect(url)
        try:
            return await fn(QueueStore(redis))
        finally:
            await redis.aclose()

    return asyncio.run(go())


def gpu_worker(url: str, token: str, queue: str) -> str:
    with client(url, token) as c:
        r = c.post("/v1/workers/register", json={"queues": [queue], "host": "gpu"})
        assert r.status_code == 201, r.text
        return str(r.json()["worker_id"])


def run_one(url: str, token: str, queue: str, output: Any) -> str:
    """A GPU worker claims one job of `queue` and completes it with `output`; returns the job id."""
    wid = gpu_worker(url, token, queue)
    with client(url, token) as c:
        jobs = c.post(f"/v1/workers/{wid}/claim", json={"queue": queue, "max": 1, "wait": 1}).json()["jobs"]
        assert len(jobs) == 1
        r = c.post(
            f"/v1/workers/{wid}/jobs/{jobs[0]['id']}/complete", json={"token": jobs[0]["token"], "output": output}
        )
        assert r.status_code == 200, r.text
        return str(jobs[0]["id"])


def test_a_producer_cannot_write_or_read_another_queues_objects(
    api: tuple[str, str], s3: RcloneS3, valkey: ValkeyServer
) -> None:
    url, boot = api
    a, b = new_queue("a"), new_queue("b")
    producer_a, producer_b = make_key(url, boot, "producer", [a]), make_key(url, boot, "producer", [b])
    worker_a, worker_b = make_key(url, boot, "worker", [a]), make_key(url, boot, "worker", [b])
    with client(url, producer_b) as pb:
        assert pb.post(f"/v1/queues/{b}/jobs", json={"input": "b's"}).status_code == 201
    b_job = run_one(url, worker_b, b, {"owner": "b"})
    b_key = f"results/{b_job}.json"

    with client(url, producer_a) as pa:  # aim a's output at b's stored result: refused, naming the field
        r = pa.post(f"/v1/queues/{a}/jobs", json={"input": "forged", "output_key": b_key})
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["path"] == "body.output_key" and f"queue {b!r}" in r.json()["detail"][0]["msg"]
        r = pa.post(f"/v1/queues/{a}/jobs/batch", json={"jobs": [{"input": 1}, {"input": 2, "output_key": b_key}]})
        assert r.status_code == 422 and r.json()["detail"][0]["path"] == "body.jobs.1.output_key", r.text
        for other in (f"results/{b}:other.json", f"results/{b}/x.json", "elsewhere/x.json"):
            assert pa.post(f"/v1/queues/{a}/jobs", json={"input": 1, "output_key": other}).status_code == 422
        ok = pa.post(f"/v1/queues/{a}/jobs", json={"input": 1, "output_key": f"results/{a}:report-1.json"})
        assert ok.status_code == 201, ok.text  # inside a's own namespace
    assert orjson.loads(s3.client().get_object(Bucket=BUCKET, Key=b_key)["Body"].read()) == {"owner": "b"}

    # a record of queue a pointing at b's object (written by someone with Redis access) gets no presigned URL
    on_store(valkey.url, lambda st: st.purge(a, "queued"))
    on_store(valkey.url, lambda st: st.enqueue(a, JobSpec(input=1, output_key=b_key)))
    forged = run_one(url, worker_a, a, {"owner": "a?"})  # the trusted worker path writes where the record says
    with client(url, producer_a) as pa:
        view = pa.get(f"/v1/jobs/{forged}").json()
        # its own run object only, never b's
        assert view["state"] == "succeeded" and quote(outputs_prefix(forged)) in view["result_url"]
        assert quote(b_key) not in view["result_url"]
        with client(url, producer_a) as pa2:
            pa2.post(f"/v1/queues/{a}/jobs", json={"input": 1})
        own = run_one(url, worker_a, a, {"owner": "a"})
        own_url = pa.get(f"/v1/jobs/{own}").json()["result_url"]
        assert own_url and quote(outputs_prefix(own)) in own_url  # its own object: presigned
        assert web.get(own_url).json() == {"owner": "a"}


@pytest.mark.parametrize("bad", ["../x", "/tmp/x", "results/q:../../x", "a//b", "x\x01y", "a\\b"])
def test_unsafe_output_keys_are_refused_at_enqueue(api: tuple[str, str], bad: str) -> None:
    url, boot = api
    q = new_queue("unsafe")
    with client(url, make_key(url, boot, "producer", [q])) as c:
        r = c.post(f"/v1/queues/{q}/jobs", json={"input": 1, "output_key": bad})
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["path"] == "body.output_key"


def test_gpu_worker_path_fails_an_unstorable_job_once(api: tuple[str, str], valkey: ValkeyServer) -> None:
    """The tutorial's RPUSH (or any Redis-level producer) can still write `../x`: the job must go dead, once, with
    the reason, instead of failing at complete and being handed out again and again."""
    url, boot = api
    q = new_queue("gpu")
    token = make_key(url, boot, "worker", [q])
    job_id = on_store(
        valkey.url, lambda st: st.enqueue(q, JobSpec(input=1, output_key="../escape.json", max_attempts=2))
    )
    wid = gpu_worker(url, token, q)
    handed_out = 0
    with client(url, token) as c:
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            jobs = c.post(f"/v1/workers/{wid}/claim", json={"queue": q, "max": 1, "wait": 0.2}).json()["jobs"]
            for j in jobs:  # what an unfixed server hands out: the complete fails, the lease is released
                handed_out += 1
                c.post(f"/v1/workers/{wid}/jobs/{j['id']}/complete", json={"token": j["token"], "output": 1})
                c.post(f"/v1/workers/{wid}/heartbeat", json={"jobs": []})
    job = on_store(valkey.url, lambda st: st.get(job_id))
    assert job.state.value == "dead" and "output_key cannot be stored" in (job.error or ""), job
    assert handed_out == 0

    # a record changed under a running job: the complete fails it permanently (422), it is not re-run
    ok_id = on_store(valkey.url, lambda st: st.enqueue(q, JobSpec(input=2)))
    with client(url, token) as c:
        j = c.post(f"/v1/workers/{wid}/claim", json={"queue": q, "max": 1, "wait": 1}).json()["jobs"][0]
        assert j["id"] == ok_id
        on_store(valkey.url, lambda st: st.redis.hset(f"offload:{{{q}}}:job:{ok_id}", "output_key", "/abs"))
        r = c.post(f"/v1/workers/{wid}/jobs/{ok_id}/complete", json={"token": j["token"], "output": 1})
        assert r.status_code == 422 and "dead" in r.json()["detail"], r.text
    assert on_store(valkey.url, lambda st: st.get(ok_id)).state.value == "dead"


def test_dispatch_worker_fails_an_unstorable_job_before_paying(valkey: ValkeyServer, s3: RcloneS3) -> None:
    async def go(sim: str) -> tuple[Any, dict[str, Any]]:
        settings = Settings.model_validate(
            {
                "redis_url": valkey.url,
                "storage": s3.settings(BUCKET),
                "backends": {"gpu": {"kind": "http-job", "base_url": sim, "api_key": "sim-key"}},
                "queues": {"q": {"backend": "gpu", "poll_interval": 0.2, "max_attempts": 2}},
            }
        )
        redis = await connect(valkey.url)
        store = QueueStore(redis)
        await store.purge("q", "queued")
        job_id = await store.enqueue("q", JobSpec(input={"id": "escape"}, output_key="/etc/escape", max_attempts=2))
        stop = asyncio.Event()
        task = asyncio.create_task(run_worker(settings, "q", stop=stop, install_signals=False, grace_s=1))
        try:
            for _ in range(600):
                if (job := await store.get(job_id)).state.terminal:
                    break
                await asyncio.sleep(0.05)
        finally:
            stop.set()
            await within(task, 20)
            await redis.aclose()
        return job, await asyncio.to_thread(lambda: web.get(f"{sim}/_sim/stats").json())

    with running_sim(SimConfig()) as sim_url:
        job, stats = asyncio.run(go(str(sim_url)))
    assert job.state.value == "dead" and "output_key cannot be stored" in (job.error or ""), job
    assert stats["submissions"] == 0, stats  # nothing was paid for


def test_output_prefixes_are_namespaces_that_never_overlap(tmp_path: Path) -> None:
    from offload.storage.namespace import key_problem

    prefixes = {"tut": "results/", "team": "team-a/"}
    assert key_problem("tut", "results/abc123.json", prefixes) is None  # the tutorial's own key
    assert key_problem("tut", "results/abc123/files/0-a.png", prefixes) is None
    assert "queue 'team'" in str(key_problem("tut", "results/team:01a.json", prefixes))  # still team's
    assert key_problem("team", "team-a/x.json", prefixes) is None
    assert key_problem("team", "results/team:01a.json", prefixes) is None
    assert "reserved" in str(key_problem("team", "results/team:_uploads/x", prefixes))
    assert "outside" in str(key_problem("team", "results/other.json", prefixes))

    config = tmp_path / "offload.yaml"
    config.write_text("queues:\n  a: {output_prefix: shared/}\n  b: {output_prefix: shared/b/}\n")
    with pytest.raises(ConfigError, match=r"queues\.a\.output_prefix: 'shared/' overlaps queue 'b'"):
        load_settings(config, env={})
    config.write_text("queues:\n  a: {output_prefix: 'results/b:'}\n")
    with pytest.raises(ConfigError, match=r"queues\.a\.output_prefix"):
        load_settings(config, env={})
    # the tutorial's env file alone: its single queue owns results/, so its producers' keys keep working
    tutorial = load_settings(
        None,
        env={
            "REDIS_URL": "redis://x",
            "QUEUE_KEY": "gpu:jobs",
            "GPU_API_BASE": "http://gpu",
            "OFFLOAD_HOME": str(tmp_path / "home"),  # no local stack's config either (cwd holds no offload.yaml)
        },
    )
    assert tutorial.queues["gpu-jobs"].output_prefix == "results/"
    assert key_problem("gpu-jobs", "results/tut-42.json", tutorial.output_prefixes()) is None


def test_tutorial_results_land_at_their_exact_key_through_the_gpu_path(
    api: tuple[str, str], s3: RcloneS3, valkey: ValkeyServer
) -> None:
    """An RPUSHed tutorial job (`results/<id>.json`) completed by a GPU worker lands at exactly that key."""
    url, boot = api
    q = new_queue("tut")
    token = make_key(url, boot, "worker", [q])
    entry = orjson.dumps({"id": "t-17", "input": {"p": 1}, "output_key": "results/t-17.json", "attempt": 1})
    on_store(valkey.url, lambda st: redis_admin(st.redis).rpush(f"{q}:jobs", entry))
    assert on_store(valkey.url, lambda st: st.ingest(f"{q}:jobs", q)) == (1, 0)
    run_one(url, token, q, {"answer": 42})
    body = eventually_sync(
        lambda: s3.client().get_object(Bucket=BUCKET, Key="results/t-17.json")["Body"].read(),
        10,
        "the tutorial's result",
    )
    assert orjson.loads(body) == {"answer": 42}
