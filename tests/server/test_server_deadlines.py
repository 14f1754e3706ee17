"""deadline, deadline_in and max_cost through the HTTP API: accepted and returned on the job record, single and
batch; an impossible value is a 422 whose detail names the field."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from support.eventually import eventually_sync
from support.s3server import RcloneS3
from support.server_helpers import BUCKET, client, make_key, new_queue, server
from support.servers import ValkeyServer


@pytest.fixture(scope="module")
def api(valkey: ValkeyServer, s3: RcloneS3) -> Iterator[tuple[str, str]]:
    with server(valkey.url, s3.settings(BUCKET)) as srv:
        yield srv


def test_the_fields_go_in_and_come_back(admin: httpx.Client) -> None:
    q = new_queue()
    at = int(time.time()) + 3600
    r = admin.post(f"/v1/queues/{q}/jobs", json={"input": 1, "deadline": at, "max_cost": 0.05})
    assert r.status_code == 201, r.text
    job = admin.get(f"/v1/jobs/{r.json()['id']}").json()
    assert (job["deadline"], job["max_cost"]) == (at * 1000, 0.05)
    body = {"jobs": [{"input": 2, "deadline_in": 600}, {"input": 3}]}
    r = admin.post(f"/v1/queues/{q}/jobs/batch", json=body)
    assert r.status_code == 201, r.text
    relative, plain = (admin.get(f"/v1/jobs/{i}").json() for i in r.json()["ids"])
    assert relative["deadline"] - relative["created_at"] == 600_000  # from enqueue, on the store's clock
    assert (plain["deadline"], plain["max_cost"]) == (None, None)


@pytest.mark.parametrize(
    ("options", "path", "says"),
    [
        ({"deadline": 1_000_000}, "body.deadline", "is in the past"),  # 1970
        ({"deadline": "tomorrow"}, "body.deadline", "valid number"),
        ({"deadline_in": 60, "delay": 120}, "body.deadline_in", "is not after the job's start"),
        ({"deadline_in": -1}, "body.deadline_in", "greater than 0"),
        ({"max_cost": -1}, "body.max_cost", "greater than or equal to 0"),
    ],
)
def test_a_bad_value_is_a_422_naming_the_field(
    admin: httpx.Client, options: dict[str, object], path: str, says: str
) -> None:
    q = new_queue()
    r = admin.post(f"/v1/queues/{q}/jobs", json={"input": 1, **options})
    (problem,) = r.json()["detail"]
    assert r.status_code == 422 and problem["path"] == path and says in problem["msg"], r.text
    r = admin.post(f"/v1/queues/{q}/jobs/batch", json={"jobs": [{"input": 0}, {"input": 1, **options}]})
    (problem,) = r.json()["detail"]
    assert problem["path"] == path.replace("body.", "body.jobs.1.") and says in problem["msg"], r.text
    assert admin.get(f"/v1/queues/{q}/jobs").status_code == 404  # nothing went in: the queue was never made


def test_a_gpu_workers_claim_fails_a_job_past_its_deadline(valkey: ValkeyServer, s3: RcloneS3) -> None:
    """The GPU workers' claim route leases through the same script: a job whose deadline (1 ms after enqueue, on
    the store's clock) has passed is failed, not handed out; the one without a deadline is."""
    q = new_queue("gpu")
    with server(valkey.url, s3.settings(BUCKET)) as (url, boot):
        token = make_key(url, boot, "worker", [q])
        with client(url, boot) as admin, client(url, token) as c:
            body = {"jobs": [{"input": 1, "deadline_in": 0.001}, {"input": 2}]}
            late, plain = admin.post(f"/v1/queues/{q}/jobs/batch", json=body).json()["ids"]
            wid = c.post("/v1/workers/register", json={"queues": [q]}).json()["worker_id"]

            def deadline_passed() -> bool:  # 1 ms on the store's clock: at most a claim or two away
                return bool(admin.get(f"/v1/jobs/{late}").json()["deadline"] < time.time() * 1000 - 5)

            eventually_sync(deadline_passed, 5, "the deadline to pass")
            jobs = c.post(f"/v1/workers/{wid}/claim", json={"queue": q, "max": 2, "wait": 0}).json()["jobs"]
            assert [j["id"] for j in jobs] == [plain]
            doc = admin.get(f"/v1/jobs/{late}").json()
            assert (doc["state"], doc["error"]) == ("dead", "deadline passed")
