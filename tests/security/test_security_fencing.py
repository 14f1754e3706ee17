"""A GPU worker whose lease was taken over must never overwrite the newer run's stored output.

A real server (uvicorn, in a thread), real Valkey, real S3 (rclone), the GPU-worker protocol driven by hand over
HTTP: worker A claims, its lease expires, worker B claims and completes, A then completes with another output.
The object the job's record points at, and the copy at its output key, must be B's, and A gets 409 StaleLease;
also when A passed the server's token check before B claimed and paused there, before its write.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from support.eventually import eventually_sync
from support.s3server import RcloneS3
from support.server_helpers import BUCKET, client, make_key, new_queue, server
from support.servers import ValkeyServer

from bench import web
from offload.server import file_refs, routes_workers
from offload.storage.inputs import outputs_prefix

LEASE_MS = 1000


@pytest.fixture(scope="module")
def api(valkey: ValkeyServer, s3: RcloneS3) -> Iterator[tuple[str, str]]:
    with server(valkey.url, s3.settings(BUCKET), worker_lease_ms=LEASE_MS, max_wait_s=2) as srv:
        yield srv


def _register(c: httpx.Client, queue: str) -> str:
    r = c.post("/v1/workers/register", json={"queues": [queue], "host": "t"})
    assert r.status_code == 201, r.text
    worker_id: str = r.json()["worker_id"]
    return worker_id


def _claim(c: httpx.Client, worker_id: str, queue: str) -> dict[str, Any]:
    def claimed() -> list[dict[str, Any]]:
        r = c.post(f"/v1/workers/{worker_id}/claim", json={"queue": queue, "max": 1, "wait": 1})
        assert r.status_code == 200, r.text
        jobs: list[dict[str, Any]] = r.json()["jobs"]
        return jobs

    jobs: list[dict[str, Any]] = eventually_sync(claimed, 30, f"worker {worker_id} to claim")
    (job,) = jobs
    return job


def _complete(c: httpx.Client, worker_id: str, job: dict[str, Any], output: Any) -> httpx.Response:
    return c.post(f"/v1/workers/{worker_id}/jobs/{job['id']}/complete", json={"token": job["token"], "output": output})


def _read(s3: RcloneS3, location: str) -> Any:
    bucket, _, key = location.removeprefix("s3://").partition("/")
    return orjson.loads(s3.client().get_object(Bucket=bucket, Key=key)["Body"].read())


def _world(api: tuple[str, str], tag: str) -> tuple[str, str, str, str]:
    """(queue, job id, producer key, worker key) for a fresh queue holding one job."""
    url, boot = api
    q = new_queue(tag)
    producer, worker = make_key(url, boot, "producer", [q]), make_key(url, boot, "worker", [q])
    with client(url, producer) as c:
        r = c.post(f"/v1/queues/{q}/jobs", json={"input": {"n": 1}})
        assert r.status_code == 201, r.text
        return q, r.json()["id"], producer, worker


def _assert_bs(api: tuple[str, str], s3: RcloneS3, producer: str, job_id: str, b_result: str) -> None:
    """The record points at B's object, its output key holds B's output, no object of A's run is left."""
    with client(api[0], producer) as c:
        view = c.get(f"/v1/jobs/{job_id}").json()
    assert view["state"] == "succeeded" and view["result"] == b_result
    assert _read(s3, view["result"]) == {"by": "B"}
    assert orjson.loads(web.get(view["result_url"]).content) == {"by": "B"}
    assert _read(s3, f"s3://{BUCKET}/{view['output_key']}") == {"by": "B"}
    listing = s3.client().list_objects_v2(Bucket=BUCKET, Prefix=outputs_prefix(job_id)).get("Contents", [])
    assert [f"s3://{BUCKET}/{o['Key']}" for o in listing] == [b_result]  # A's run object was deleted


def test_a_late_complete_of_a_lost_lease_is_409_and_changes_nothing(api: tuple[str, str], s3: RcloneS3) -> None:
    url, _ = api
    q, job_id, producer, worker = _world(api, "fence")
    with client(url, worker) as a, client(url, worker) as b:
        wa, wb = _register(a, q), _register(b, q)
        held_a = _claim(a, wa, q)
        held_b = _claim(b, wb, q)  # once A's lease expired (A sends no heartbeat)
        assert held_b["id"] == held_a["id"] == job_id and held_b["token"] != held_a["token"]
        done_b = _complete(b, wb, held_b, {"by": "B"})
        assert done_b.status_code == 200, done_b.text
        late_a = _complete(a, wa, held_a, {"by": "A"})
        assert late_a.status_code == 409 and late_a.json()["error"] == "conflict", late_a.text
        # the server died after the complete, before the copy at the output key: B's retry (its reply was lost)
        # answers the same and makes the copy
        with client(url, producer) as p:
            output_key = p.get(f"/v1/jobs/{job_id}").json()["output_key"]
        s3.client().delete_object(Bucket=BUCKET, Key=output_key)
        again_b = _complete(b, wb, held_b, {"by": "B"})
        assert again_b.status_code == 200 and again_b.json() == done_b.json()
    _assert_bs(api, s3, producer, job_id, done_b.json()["result"])


def test_a_worker_paused_between_the_check_and_the_write_cannot_overwrite_the_newer_run(
    api: tuple[str, str], s3: RcloneS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A's complete passes the token check while A still holds the lease, then pauses (held at the server's
    file-reference check, the step between the check and the write) until its lease expired and B completed."""
    url, _ = api
    q, job_id, producer, worker = _world(api, "pause")
    paused, resume = threading.Event(), threading.Event()
    real = file_refs.check_output_refs  # the original; the route looks it up in routes_workers

    async def pausing(state: Any, job: Any, output: Any) -> None:
        if output == {"by": "A"}:
            paused.set()
            await asyncio.to_thread(resume.wait, 60)
        await real(state, job, output)

    monkeypatch.setattr(routes_workers, "check_output_refs", pausing)
    with client(url, worker) as a, client(url, worker) as b, ThreadPoolExecutor(1) as pool:
        wa, wb = _register(a, q), _register(b, q)
        held_a = _claim(a, wa, q)
        late_a = pool.submit(_complete, a, wa, held_a, {"by": "A"})
        assert paused.wait(30), "A's complete never reached the pause"
        held_b = _claim(b, wb, q)
        done_b = _complete(b, wb, held_b, {"by": "B"})
        assert done_b.status_code == 200, done_b.text
        resume.set()
        answer = late_a.result(60)
    assert answer.status_code == 409 and answer.json()["error"] == "conflict", answer.text
    _assert_bs(api, s3, producer, job_id, done_b.json()["result"])


def test_the_run_key_is_the_jobs_own_and_a_foreign_token_is_refused(tmp_path: Path) -> None:
    """The per-lease key lies under the job's own output prefix (the sweep's and `result --download`'s rule), and
    a token without a lease number names no object."""
    from offload.storage.inputs import job_of_key, run_output_key

    key = run_output_key("q:0192ab", "rw-1/42")
    assert key == outputs_prefix("q:0192ab") + "run-42.json" and job_of_key("q", key) == "q:0192ab"
    with pytest.raises(ValueError, match="lease number"):
        run_output_key("q:0192ab", "rw-1/../x")
