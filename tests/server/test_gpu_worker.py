"""`offload worker --handler` as REAL subprocesses against a real server (uvicorn on TCP), real Valkey and real S3
(rclone). The worker process gets only the server URL and a worker key: its environment is checked for Redis
and S3 settings. Leases are short (1.5 s) so a SIGKILLed worker's job comes back quickly."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from support.eventually import eventually_sync
from support.procs import die_with_parent
from support.s3server import RcloneS3
from support.server_helpers import BUCKET, client, make_key, new_queue, server
from support.servers import ValkeyServer

from bench import web
from offload.storage.inputs import outputs_prefix

OFFLOAD = str(Path(sys.executable).with_name("offload"))
REPO = Path(__file__).resolve().parents[2]
_live: list[subprocess.Popen[bytes]] = []


@pytest.fixture(scope="module")
def api(valkey: ValkeyServer, s3: RcloneS3) -> Iterator[tuple[str, str]]:
    with server(valkey.url, s3.settings(BUCKET), worker_lease_ms=1500, max_wait_s=2) as srv:
        yield srv


@pytest.fixture(autouse=True)
def _reap() -> Iterator[None]:
    yield
    while _live:
        proc = _live.pop()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def spawn_worker(
    url: str, token: str, queue: str, handler: str, tmp: Path, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Only what a rented GPU machine would get: PATH, the server URL and a worker key."""
    full_env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        "OFFLOAD_TOKEN": token,
        **(env or {}),
    }
    log = open(tmp / f"worker-{len(_live)}.log", "ab")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [
            OFFLOAD,
            "worker",
            "--queue",
            queue,
            "--handler",
            f"tests.support.handlers:{handler}",
            "--server",
            url,
            "--grace",
            "20",
            *extra,
        ],
        env=full_env,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    log.close()
    _live.append(proc)
    return proc


def workers(url: str, token: str) -> list[dict[str, Any]]:
    with client(url, token) as c:
        listed: list[dict[str, Any]] = c.get("/v1/workers").json()
        return listed


def job(url: str, token: str, job_id: str) -> dict[str, Any]:
    with client(url, token) as c:
        doc: dict[str, Any] = c.get(f"/v1/jobs/{job_id}").json()
        return doc


def enqueue(url: str, token: str, queue: str, inputs: list[Any], **options: Any) -> list[str]:
    with client(url, token) as c:
        r = c.post(f"/v1/queues/{queue}/jobs/batch", json={"jobs": [{"input": i, **options} for i in inputs]})
        assert r.status_code == 201, r.text
        ids: list[str] = r.json()["ids"]
        return ids


def wait_state(url: str, token: str, job_id: str, state: str, timeout: float = 45) -> dict[str, Any]:
    result: dict[str, Any] = eventually_sync(
        lambda: (d := job(url, token, job_id))["state"] == state and d, timeout, f"{job_id} to be {state}"
    )
    return result


def copied_output(s3: RcloneS3, job_id: str) -> Any:
    """The output at the job's `output_key`: the server copies it there for readers of the bucket right after the
    job is marked succeeded (its own copy, the record's `result`, was written before), so a loaded run may look
    first (a CI run read it before the copy: NoSuchKey)."""
    bucket = s3.client()

    def read() -> Any:
        with contextlib.suppress(bucket.exceptions.NoSuchKey):
            return orjson.loads(bucket.get_object(Bucket=BUCKET, Key=f"results/{job_id}.json")["Body"].read())
        return None

    return eventually_sync(read, 10, f"the copy of {job_id}'s output")


def test_handler_worker_end_to_end(api: tuple[str, str], s3: RcloneS3, tmp_path: Path) -> None:
    url, boot = api
    q = new_queue("gpu")
    token = make_key(url, boot, "worker", [q])
    fake_bin = tmp_path / "bin"  # an nvidia-smi that answers like one with a single A100
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text("#!/bin/sh\necho '0, NVIDIA A100-SXM4-80GB, 81920, GPU-1234'\n")
    (fake_bin / "nvidia-smi").chmod(0o755)
    proc = spawn_worker(
        url,
        token,
        q,
        "echo",
        tmp_path,
        "--load",
        "tests.support.handlers:load",
        "--concurrency",
        "2",
        env={
            "OFFLOAD_INSTANCE_ID": "i-0abc",
            "OFFLOAD_PROTECTED": "1",
            "PATH": f"{fake_bin}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        },
    )
    ids = enqueue(url, boot, q, [{"n": i} for i in range(4)])
    done = [wait_state(url, boot, j, "succeeded") for j in ids]
    outputs = [copied_output(s3, j) for j in ids]
    assert [o["echo"] for o in outputs] == [{"n": i} for i in range(4)]
    assert {o["pid"] for o in outputs} == {proc.pid}
    assert {o["load_calls"] for o in outputs} == {1} and {o["loads"] for o in outputs} == {1}  # load ran once
    # the record names the object of the run whose complete was fenced; its output key holds a copy (read above)
    assert all(d["result"].startswith(f"s3://{BUCKET}/{outputs_prefix(d['id'])}run-") for d in done)
    assert web.get(done[0]["result_url"]).json()["echo"] == {"n": 0}

    (me,) = [w for w in workers(url, boot) if q in w["queues"]]
    assert me["kind"] == "remote" and me["instance_id"] == "i-0abc" and me["protected"] is True
    assert me["host"] and me["version"] and me["concurrency"] == 2 and me["last_heartbeat"]
    assert me["gpus"] == [{"index": "0", "name": "NVIDIA A100-SXM4-80GB", "memory_mb": "81920", "uuid": "GPU-1234"}]

    environ = Path(f"/proc/{proc.pid}/environ").read_bytes().decode(errors="replace").split("\0")
    names = {e.split("=", 1)[0] for e in environ if e}
    assert not names & {
        "REDIS_URL",
        "OFFLOAD_REDIS_URL",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "OFFLOAD_S3_ENDPOINT",
        "S3_ENDPOINT",
        "OFFLOAD_CONFIG",
    }
    assert s3.secret_key not in "\n".join(environ)

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(40) == 0
    assert not [w for w in workers(url, boot) if q in w["queues"]]  # deregistered on the way out


def test_handler_exception_is_retried_then_dead(api: tuple[str, str], tmp_path: Path) -> None:
    url, boot = api
    q = new_queue("boom")
    spawn_worker(url, make_key(url, boot, "worker", [q]), q, "boom", tmp_path)
    (job_id,) = enqueue(url, boot, q, ["x"], max_attempts=2)
    dead = wait_state(url, boot, job_id, "dead")
    assert dead["attempts"] == 2 and "RuntimeError: boom on 'x'" in dead["error"]
    with client(url, boot) as c:
        totals = c.get(f"/v1/queues/{q}").json()["totals"]
    assert totals.get("failed") == 2 and totals.get("dead") == 1  # retried once, not dead on the first error


def test_permanent_error_is_dead_at_once(api: tuple[str, str], tmp_path: Path) -> None:
    url, boot = api
    q = new_queue("perm")
    spawn_worker(url, make_key(url, boot, "worker", [q]), q, "bad_input", tmp_path)
    (job_id,) = enqueue(url, boot, q, ["x"], max_attempts=5)
    dead = wait_state(url, boot, job_id, "dead")
    assert dead["attempts"] == 1 and "can never work" in dead["error"]


def test_sigkilled_worker_job_is_redelivered(api: tuple[str, str], tmp_path: Path) -> None:
    url, boot = api
    q = new_queue("kill")
    token = make_key(url, boot, "worker", [q])
    slow = spawn_worker(url, token, q, "echo", tmp_path, env={"OFFLOAD_TEST_SLOW": "60"})
    (job_id,) = enqueue(url, boot, q, ["precious"])
    running = wait_state(url, boot, job_id, "active")
    assert running["lease_owner"].startswith("r-")
    os.killpg(slow.pid, signal.SIGKILL)
    slow.wait(10)
    fresh = spawn_worker(url, token, q, "echo", tmp_path)
    done = wait_state(url, boot, job_id, "succeeded")
    assert done["lease_expiries"] == 1 and done["attempts"] == 1
    with client(url, boot) as c:
        assert web.get(c.get(f"/v1/jobs/{job_id}").json()["result_url"]).json()["pid"] == fresh.pid


def test_sigterm_lets_the_running_job_finish(api: tuple[str, str], tmp_path: Path) -> None:
    url, boot = api
    q = new_queue("drain")
    proc = spawn_worker(url, make_key(url, boot, "worker", [q]), q, "echo", tmp_path, env={"OFFLOAD_TEST_SLOW": "4"})
    (job_id,) = enqueue(url, boot, q, ["finish me"])
    wait_state(url, boot, job_id, "active")
    later = enqueue(url, boot, q, ["not started"])[0]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(40) == 0
    assert job(url, boot, job_id)["state"] == "succeeded"  # finished during the drain, not abandoned
    assert job(url, boot, later)["state"] == "queued"  # never claimed after the signal (or handed back)


def test_sigterm_hands_back_a_job_that_outlasts_the_grace(api: tuple[str, str], tmp_path: Path) -> None:
    url, boot = api
    q = new_queue("grace")
    proc = spawn_worker(
        url, make_key(url, boot, "worker", [q]), q, "echo", tmp_path, "--grace", "0.5", env={"OFFLOAD_TEST_SLOW": "120"}
    )
    (job_id,) = enqueue(url, boot, q, ["too slow"])
    wait_state(url, boot, job_id, "active")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(40) == 0  # a sync handler stuck in its thread does not keep the process alive
    back = job(url, boot, job_id)
    assert back["state"] == "queued" and back["attempts"] == 0 and back["lease_expiries"] == 0  # released, not lost


def test_async_handler(api: tuple[str, str], s3: RcloneS3, tmp_path: Path) -> None:
    url, boot = api
    q = new_queue("async")
    spawn_worker(url, make_key(url, boot, "worker", [q]), q, "async_echo", tmp_path, "--concurrency", "4")
    ids = enqueue(url, boot, q, list(range(6)))
    for i, j in enumerate(ids):
        wait_state(url, boot, j, "succeeded")
        out = copied_output(s3, j)
        assert out == {"async": True, "echo": i, "job": j}


def test_cancel_reaches_a_running_async_handler(api: tuple[str, str], tmp_path: Path) -> None:
    url, boot = api
    q = new_queue("cancel")
    spawn_worker(url, make_key(url, boot, "worker", [q]), q, "async_slow", tmp_path)
    (job_id,) = enqueue(url, boot, q, ["forever"])
    wait_state(url, boot, job_id, "active")
    with client(url, boot) as c:
        assert c.post(f"/v1/jobs/{job_id}/cancel").json()["result"] == "requested"
    assert wait_state(url, boot, job_id, "cancelled")["cancel_requested"] is True


def test_a_rejected_key_stops_the_worker(api: tuple[str, str], tmp_path: Path) -> None:
    url = api[0]
    q = new_queue("rej")
    proc = spawn_worker(url, "ofk_000000000000_wrong", q, "echo", tmp_path)
    assert proc.wait(60) == 1
    log = (tmp_path / "worker-0.log").read_text()
    assert "error: HTTP 401: invalid or revoked API key" in log and "Traceback" not in log
    assert "ofk_000000000000_wrong" not in log  # the key never reaches the log


def test_handler_worker_needs_server_and_key(tmp_path: Path) -> None:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    r = subprocess.run(
        [OFFLOAD, "worker", "--queue", "q", "--handler", "tests.support.handlers:echo"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and r.stderr.startswith("error: --handler needs --server")
    r = subprocess.run(
        [
            OFFLOAD,
            "worker",
            "--queue",
            "q",
            "--handler",
            "tests.nope:echo",
            "--server",
            "http://127.0.0.1:9",
            "--token",
            "t",
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "cannot load the handler" in r.stderr and "Traceback" not in r.stderr
