"""A server that stops (a deploy's SIGTERM) answers its long polls and ends its event streams at once.

uvicorn waits `GRACEFUL_SHUTDOWN` (3 s) for the requests in flight, then cancels them. Found by the fault
harness's graceful restarts of the server (`python -m bench.chaos --hybrid`): each stop took the whole 3 s and
logged "Exception in ASGI application" for every GPU worker's claim it cancelled, and a cancelled claim could fall
between taking jobs and answering with them. The claim now answers no jobs, a job's wait answers `timed_out`, and
an event stream ends, as the stop begins: clients come back to the next server by design.
"""

from __future__ import annotations

import logging
import secrets
import tempfile
import threading
import time
from typing import Any, cast

import pytest
from fastapi import FastAPI
from support.eventually import eventually_sync
from support.server_helpers import client, make_key, new_queue

from offload.config import Settings
from offload.server import runner
from offload.server.state import ServerOptions

HOST = "127.0.0.1"


def test_a_stopping_server_answers_its_long_polls_at_once(valkey_url: str, caplog: pytest.LogCaptureFixture) -> None:
    queue = new_queue("stop")
    answers: dict[str, Any] = {}
    admin = "boot-" + secrets.token_urlsafe(24)
    settings = Settings.model_validate({"storage": {"kind": "local", "path": tempfile.mkdtemp(prefix="offload-stop-")}})
    uv = runner._server(
        ServerOptions(redis_url=valkey_url, settings=settings, admin_key=admin), HOST, 0, "warning", False
    )
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    eventually_sync(lambda: uv.started, 30, "the server to start", every=0.01)
    url = f"http://{HOST}:{uv.servers[0].sockets[0].getsockname()[1]}"
    worker_key = make_key(url, admin, "worker", [queue])
    with client(url, admin) as c:
        job_id = c.post(f"/v1/queues/{queue}/jobs", json={"input": {"n": 1}}).json()["id"]
        c.post(f"/v1/queues/{queue}/pause").raise_for_status()  # nothing to claim: the claim long-polls
    with client(url, worker_key) as w:
        worker_id = w.post("/v1/workers/register", json={"queues": [queue]}).json()["worker_id"]

    def claim() -> None:
        with client(url, worker_key) as w:
            r = w.post(f"/v1/workers/{worker_id}/claim", json={"queue": queue, "max": 1, "wait": 60})
            answers["claim"] = (r.status_code, r.json(), time.monotonic())

    def wait() -> None:
        with client(url, admin) as c:
            r = c.get(f"/v1/jobs/{job_id}/wait", params={"timeout": 60})
            answers["wait"] = (r.status_code, r.json(), time.monotonic())

    def stream() -> None:
        with client(url, admin) as c, c.stream("GET", "/v1/events", params={"queue": queue}) as r:
            for _ in r.iter_bytes():
                pass
            answers["stream"] = (r.status_code, None, time.monotonic())

    threads = [threading.Thread(target=fn) for fn in (claim, wait, stream)]
    for t in threads:
        t.start()
    hub = cast(FastAPI, uv.config.app).state.offload.hub

    def waiting() -> bool:
        return len({s for subs in hub._subs.values() for s in subs}) == 3

    eventually_sync(waiting, 30, "the three long polls to wait", every=0.01)
    with caplog.at_level(logging.INFO):
        stop_began = time.monotonic()
        uv.should_exit = True  # what uvicorn's SIGTERM handler does
        thread.join(30)
    stopped = time.monotonic()
    for t in threads:
        t.join(10)
    assert not thread.is_alive()
    assert answers["claim"][:2] == (200, {"jobs": []}), answers
    assert answers["wait"][0] == 200 and answers["wait"][1]["timed_out"] and answers["wait"][1]["state"] == "queued"
    assert answers["stream"][0] == 200, answers
    took = {name: round(at - stop_began, 2) for name, (_, _, at) in answers.items()}
    assert all(t < runner.GRACEFUL_SHUTDOWN for t in took.values()), took  # not ended by uvicorn's cancel
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert stopped - stop_began < runner.GRACEFUL_SHUTDOWN + 10, stopped - stop_began
