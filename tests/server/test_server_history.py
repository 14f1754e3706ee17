"""The history over real HTTP against a real server and Valkey: the three ranges' axes (every bucket present, the
current one last), an empty queue's axis of zeros, the counts of jobs a GPU worker ran, the gauges the server
samples, a bad range as a one-line 422, read scope per queue, and /v1/history summed over the readable queues."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support.dashboard_helpers import HttpWorker, dead_jobs, enqueue
from support.eventually import eventually_sync
from support.server_helpers import client, make_key, new_queue, server
from support.servers import ValkeyServer

pytestmark = pytest.mark.xdist_group("server-history")


@pytest.fixture(scope="module")
def api(valkey: ValkeyServer) -> Iterator[tuple[str, str]]:
    with server(valkey.url, max_wait_s=5, history_sample_s=0.5) as srv:
        yield srv


def history(http: httpx.Client, path: str, range_: str = "hour") -> dict[str, Any]:
    r = http.get(path, params={"range": range_})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def total(body: dict[str, Any], field: str) -> int:
    return sum(int(p[field]) for p in body["points"])


@pytest.mark.parametrize(("range_", "step", "n"), [("hour", 60, 60), ("day", 3600, 24), ("week", 3600, 168)])
def test_each_range_is_a_whole_axis_of_zeros_for_an_empty_queue(
    api: tuple[str, str], admin: httpx.Client, range_: str, step: int, n: int
) -> None:
    q = new_queue("empty")
    assert admin.post(f"/v1/queues/{q}/pause").status_code == 200  # a queue with no jobs at all
    body = history(admin, f"/v1/queues/{q}/history", range_)
    assert (body["queue"], body["range"], body["step_s"], len(body["points"])) == (q, range_, step, n)
    starts = [p["t"] for p in body["points"]]
    assert starts == list(range(starts[0], starts[0] + step * n, step)) and starts[0] % step == 0
    assert starts[-1] <= time.time() < starts[-1] + step + 5  # the current bucket last (the store's clock)
    for p in body["points"]:
        assert [p[k] for k in ("enqueued", "succeeded", "failed", "dead", "cancelled")] == [0] * 5
        assert p["wait_ms"] == p["run_ms"] == {"p50": None, "p95": None, "p99": None}
        assert p["spend_usd"] == {"serverless": 0.0, "fleet": 0.0} and p["spend_by_backend"] == {}
        assert p["provider_calls"] == p["provider_errors"] == 0


def test_a_queue_that_ran_jobs_and_its_sampled_gauges(api: tuple[str, str], admin: httpx.Client) -> None:
    url, boot = api
    q = new_queue("ran")
    enqueue(admin, q, 1, 2, 3, 4)
    worker = HttpWorker(url, make_key(url, boot, "worker", [q]), q)
    try:
        jobs = worker.claim(3)
        for job in jobs[:2]:
            worker.complete(job, {"ok": True})
        worker.fail(jobs[2], "boom")
    finally:
        worker.close()
    body = history(admin, f"/v1/queues/{q}/history")
    assert (total(body, "enqueued"), total(body, "succeeded"), total(body, "dead")) == (4, 2, 1)
    ran = [p for p in body["points"] if p["succeeded"]]
    assert all(p["run_ms"]["p50"] is not None and p["wait_ms"]["p50"] is not None for p in ran)
    # the server samples each queue (here every 0.5 s): the backlog (1 queued) shows in the current minute (a
    # minute another server sampled before the jobs came reads 0 until this one's sample raises its peak)
    current = eventually_sync(
        lambda: [p for p in history(admin, f"/v1/queues/{q}/history")["points"][-1:] if (p["backlog"] or 0) >= 1],
        timeout=30,
        what="a gauge sample",
    )
    assert current[-1]["in_flight"] is not None and current[-1]["fleet_machines"] == 0
    week = history(admin, f"/v1/queues/{q}/history", "week")
    assert (total(week, "succeeded"), total(week, "dead")) == (2, 1)  # the hourly buckets hold the same


@pytest.mark.parametrize("bad", ["month", "", "HOUR", "hour;drop", "x" * 5000])
def test_a_bad_range_is_a_one_line_422(api: tuple[str, str], admin: httpx.Client, bad: str) -> None:
    q = new_queue("bad")
    enqueue(admin, q, 1)
    for path in (f"/v1/queues/{q}/history", "/v1/history"):
        r = admin.get(path, params={"range": bad})
        assert r.status_code == 422, r.text
        assert r.headers["content-type"].startswith("application/json") and "\n" not in r.text
        assert [p["path"] for p in r.json()["detail"]] == ["query.range"]
        assert "x" * 600 not in r.text  # a hostile value is not echoed back whole


def test_read_scope_per_queue_and_the_sum_over_readable_queues(api: tuple[str, str], admin: httpx.Client) -> None:
    url, boot = api
    mine, other = new_queue("mine"), new_queue("other")
    dead_jobs(api, mine, "a", "b")
    dead_jobs(api, other, "c", "d", "e")
    viewer = client(url, make_key(url, boot, "viewer", [mine]))
    worker = client(url, make_key(url, boot, "worker", [mine]))
    with viewer, worker:
        assert total(history(viewer, f"/v1/queues/{mine}/history"), "dead") == 2
        refused = viewer.get(f"/v1/queues/{other}/history")
        assert refused.status_code == 403 and other in refused.json()["detail"]
        assert worker.get(f"/v1/queues/{mine}/history").status_code == 403  # a worker key reads no queue
        assert worker.get("/v1/history").status_code == 403
        assert client(url, "not-a-key").get(f"/v1/queues/{mine}/history").status_code == 401
        summed = history(viewer, "/v1/history", "day")
        assert summed["queue"] is None and len(summed["points"]) == 24
        assert total(summed, "dead") == 2 and total(summed, "enqueued") == 2  # only the queue it may read
    everything = history(admin, "/v1/history")
    assert total(everything, "dead") >= 5 and total(everything, "enqueued") >= 5
