"""`offload server` logs quietly: no access line for a GPU worker's heartbeats and claims or a long-poll
that succeeded, while other requests and failed routine ones are still logged; `--log-level` (or
OFFLOAD_LOG_LEVEL) is checked like any option."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.dashboard_helpers import HttpWorker
from support.eventually import eventually_sync
from support.procs import die_with_parent
from support.server_helpers import client, make_key, new_queue
from support.servers import free_port

ADMIN = "boot-" + secrets.token_urlsafe(32)


def start(
    valkey_url: str, log: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "offload", "server", "--port", str(port), "--url", valkey_url, *args],
        env={**os.environ, "OFFLOAD_ADMIN_KEY": ADMIN, **(env or {})},
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        preexec_fn=die_with_parent,
        cwd=log.parent,  # not the checkout: a `make demo` leaves .offload/offload.yaml there, naming its S3 server
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, log.read_text()
        try:
            with client(url) as anon:
                return anon.get("/readyz").status_code == 200
        except httpx.TransportError:
            return False

    try:
        eventually_sync(ready, timeout=60, what="the server to answer")
    except BaseException:
        stop(proc)  # a server that did not come up is not left running
        raise
    return proc, url


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


@pytest.fixture
def served(valkey_url: str, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    log = tmp_path / "server.log"
    proc, url = start(valkey_url, log)
    try:
        yield url, log
    finally:
        stop(proc)


def test_routine_worker_calls_leave_no_access_line(served: tuple[str, Path]) -> None:
    url, log = served
    q = new_queue("logs")
    worker = HttpWorker(url, make_key(url, ADMIN, "worker", [q]), q)
    with client(url, ADMIN) as admin:
        job = admin.post(f"/v1/queues/{q}/jobs", json={"input": 1}).json()["id"]
        (claimed,) = worker.claim(1)
        for _ in range(3):
            worker.heartbeat([claimed["id"]])
        worker.complete(claimed, {"ok": True})
        assert admin.get(f"/v1/jobs/{job}/wait", params={"timeout": 1}).json()["state"] == "succeeded"
        assert worker.http.post(f"/v1/workers/{worker.id}x/heartbeat", json={"jobs": []}).status_code == 404
        admin.get("/v1/queues")  # the last request: once its line is there, every earlier one was written
    worker.close()
    eventually_sync(lambda: "GET /v1/queues HTTP" in log.read_text(), 30, what="the access line of GET /v1/queues")
    text = log.read_text()
    assert f'POST /v1/queues/{q}/jobs HTTP/1.1" 201' in text and '/complete HTTP/1.1" 200' in text
    assert f"/v1/workers/{worker.id}/heartbeat" not in text and "/claim HTTP" not in text
    assert f"/v1/jobs/{job}/wait" not in text
    assert f'/v1/workers/{worker.id}x/heartbeat HTTP/1.1" 404' in text  # a failed one is still logged


def test_warning_level_has_no_access_lines(valkey_url: str, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    proc, url = start(valkey_url, log, env={"OFFLOAD_LOG_LEVEL": "WARNING"})
    try:
        with client(url, ADMIN) as admin:
            assert admin.get("/v1/queues").status_code == 200
    finally:
        stop(proc)
    assert "GET /v1/queues" not in log.read_text() and "INFO" not in log.read_text()


def test_a_bad_log_level_is_a_usage_error() -> None:
    for command in ("server", "worker"):
        proc = subprocess.run(
            [sys.executable, "-m", "offload", command, "--log-level", "loud"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 2 and "'loud' is not one of" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
