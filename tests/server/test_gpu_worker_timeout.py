"""A queue's `timeout` (max run time) for jobs on GPU workers (`offload worker --handler`). Before, a hung handler was
never ended: its job stayed active for as long as the worker heartbeated, and a worker with one slot served nothing
else. Now the server fails the attempt past the timeout ("timed out after N s": retried with backoff, dead when it
was the last), the heartbeat reply tells the worker to abandon the run, the worker's slot serves the next job (the
hung thread cannot be stopped and is left behind), and a late complete from the ended run is refused.

A real server (uvicorn), real Valkey, the worker as a real subprocess with only the server URL and a worker key.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.server_helpers import client, make_key, new_queue, server
from support.servers import ValkeyServer
from test_gpu_worker import _reap, enqueue, job, spawn_worker, wait_state

from offload.errors import StaleLease
from offload.gpu_worker.server_api import ServerApi

_ = _reap  # the module's subprocesses are SIGKILLed after each test (test_gpu_worker's autouse fixture)
HUNG_Q = new_queue("hung")
FENCE_Q = new_queue("late")
TIMEOUT_S = 2


@pytest.fixture(scope="module")
def results() -> Path:
    return Path(tempfile.mkdtemp(prefix="offload-timeout-"))


@pytest.fixture(scope="module")
def api(valkey: ValkeyServer, results: Path) -> Iterator[tuple[str, str]]:
    settings = {"queues": {HUNG_Q: {"timeout": TIMEOUT_S}, FENCE_Q: {"timeout": TIMEOUT_S}}}
    storage = {"kind": "local", "path": str(results)}
    with server(valkey.url, storage, settings, worker_lease_ms=1500, max_wait_s=2) as srv:
        yield srv


def test_a_hung_handler_is_ended_at_the_timeout_and_the_worker_serves_on(api: tuple[str, str], tmp_path: Path) -> None:
    """One slot, a sync handler that hangs for good: each of the job's two attempts is ended at the timeout (the
    job ends dead with the reason), and the jobs enqueued behind it succeed on the same worker meanwhile."""
    url, boot = api
    proc = spawn_worker(url, make_key(url, boot, "worker", [HUNG_Q]), HUNG_Q, "hang_or_echo", tmp_path)
    (hung,) = enqueue(url, boot, HUNG_Q, [{"hang": True}], max_attempts=2)
    wait_state(url, boot, hung, "active")
    quick = enqueue(url, boot, HUNG_Q, [{"n": i} for i in range(3)])
    first = wait_state(url, boot, hung, "retrying")
    assert first["error"] == f"timed out after {TIMEOUT_S} s" and first["attempts"] == 1
    for job_id in quick:  # the slot was given back: the worker goes on serving
        done = wait_state(url, boot, job_id, "succeeded")
        assert done["lease_owner"] is None and done["attempts"] == 1
    dead = wait_state(url, boot, hung, "dead", timeout=60)
    assert dead["error"] == f"timed out after {TIMEOUT_S} s" and dead["attempts"] == 2
    assert proc.poll() is None  # still serving, its hung threads left behind
    (after,) = enqueue(url, boot, HUNG_Q, [{"n": "after"}])
    assert wait_state(url, boot, after, "succeeded")["attempts"] == 1
    with client(url, boot) as c:
        totals = c.get(f"/v1/queues/{HUNG_Q}").json()["totals"]
    assert totals.get("failed") == 2 and totals.get("dead") == 1
    log = (tmp_path / "worker-0.log").read_text()
    assert log.count("timed out (the queue's timeout): abandoned") == 2


def test_a_late_complete_of_a_timed_out_run_is_refused(api: tuple[str, str], results: Path) -> None:
    """The worker protocol by hand: claim, heartbeat past the timeout (the reply names the run in `timed_out`
    and in `lost`), then complete anyway with the old token: 409, and no output is written for the dead job."""
    url, boot = api
    token = make_key(url, boot, "worker", [FENCE_Q])
    (job_id,) = enqueue(url, boot, FENCE_Q, [{"slow": True}], max_attempts=1)

    async def go() -> dict[str, Any]:
        server_api = ServerApi(url, token)
        try:
            reply = await server_api.register({"queues": [FENCE_Q], "concurrency": 1}, retry_for=10)
            wid = reply["worker_id"]
            (claimed,) = await server_api.claim(wid, FENCE_Q, 1, 2)
            assert claimed["id"] == job_id
            beat: dict[str, Any] = {}
            for _ in range(200):  # heartbeats, as a live worker sends them, until the server ends the run
                beat = await server_api.heartbeat(wid, [job_id], None, None, [claimed["token"]])
                if beat.get("timed_out"):
                    break
                await asyncio.sleep(0.1)
            with pytest.raises(StaleLease):
                await server_api.complete(wid, job_id, claimed["token"], {"too": "late"})
            return beat
        finally:
            await server_api.aclose()

    beat = asyncio.run(go())
    assert beat["timed_out"] == [job_id] and job_id in beat["lost"]
    dead = job(url, boot, job_id)
    assert dead["state"] == "dead" and dead["error"] == f"timed out after {TIMEOUT_S} s" and dead["result"] is None
    assert not (results / "results" / f"{job_id}.json").exists()


def test_timeout_is_refused_on_a_dispatch_queue() -> None:
    """One meaning per name: a dispatch queue's remote jobs are bounded by poll_timeout, so `timeout` there is a
    start-up error naming the field, not a setting that silently does nothing."""
    from offload.config import Settings
    from offload.errors import ConfigError
    from offload.schema import parse

    data: dict[str, Any] = {
        "backends": {"b": {"kind": "http-job", "base_url": "http://gpu.example"}},
        "queues": {"q": {"backend": "b"}},
    }
    data["queues"]["q"]["timeout"] = 60
    with pytest.raises(ConfigError, match=r"^queues\.q\.timeout: .*poll_timeout"):
        parse(Settings, data)
    assert parse(Settings, {"queues": {"gpu": {"timeout": 60}}}).queues["gpu"].timeout == 60
