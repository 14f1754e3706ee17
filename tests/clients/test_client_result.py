"""A producer's first hour: `Client()` finds the store the CLI finds, `result()` returns the output
itself, `offload wait` waits and prints it, and an unreachable store is one line after a short retry."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from support.servers import closed_port
from typer.testing import CliRunner

from offload import Client, ConnectionFailed, File, JobState, NoResult
from offload.cli.app import app
from offload.connection import connect
from offload.files import REF_KEY
from offload.queue.store import QueueStore
from offload.server.runner import serve
from offload.server.state import ServerOptions
from offload.storage import create_storage

runner = CliRunner()


@pytest.fixture
def project(tmp_path: Path, tmp_home: Path, monkeypatch: pytest.MonkeyPatch, valkey_url: str) -> Path:
    """A project directory whose ./offload.yaml names the store and a local storage; no URL in the environment
    (tmp_home clears it), so only the file can say where the store is."""
    (tmp_path / "offload.yaml").write_text(
        yaml.safe_dump({"redis_url": valkey_url, "storage": {"kind": "local", "path": str(tmp_path / "results")}})
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OFFLOAD_CONFIG", raising=False)
    monkeypatch.delenv("OFFLOAD_REDIS_CONNECT_TIMEOUT", raising=False)
    return tmp_path


async def finish(url: str, queue: str, storage_root: Path, output: Any, *, error: str | None = None) -> str:
    """Do what a worker does for the next job of `queue`: store `output` at its key and complete it, or (with
    `error`) fail it for good. Returns its id."""
    redis = await connect(url)
    try:
        store = QueueStore(redis)
        (job,) = await store.claim(queue, "w-test", 1)
        if error is not None:
            await store.fail(job.id, job.token, error, retryable=False)
            return job.id
        storage = create_storage({"kind": "local", "path": str(storage_root)})
        try:
            location = await storage.put_json(job.output_key, output(job) if callable(output) else output)
        finally:
            await storage.aclose()
        await store.complete(job.id, job.token, location)
        return job.id
    finally:
        await redis.aclose()


def test_client_and_cli_find_the_store_in_offload_yaml(project: Path, valkey_url: str) -> None:
    with Client() as client:  # no URL: ./offload.yaml's redis_url, not a new embedded Valkey
        job_id = client.enqueue("yaml-q", {"n": 1})
    assert not (project / ".offload" / "valkey").exists(), "no embedded server may have been started"
    found = runner.invoke(app, ["status", job_id, "--json"])  # the CLI, also without --url, sees the same job
    assert found.exit_code == 0, found.stderr
    assert orjson.loads(found.stdout)["state"] == "queued"

    async def stored() -> str:
        redis = await connect(valkey_url)
        try:
            return (await QueueStore(redis).get(job_id)).state.value
        finally:
            await redis.aclose()

    assert asyncio.run(stored()) == "queued"


def test_the_environment_comes_before_the_file_for_both(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dead = f"redis://:hunter2@127.0.0.1:{closed_port()}/0"  # nothing listens there
    monkeypatch.setenv("OFFLOAD_REDIS_URL", dead)
    monkeypatch.setenv("OFFLOAD_REDIS_CONNECT_TIMEOUT", "0.5")
    with Client() as client, pytest.raises(ConnectionFailed) as info:
        client.stats("yaml-q")
    message = str(info.value)
    assert "127.0.0.1" in message and "hunter2" not in message and "***" in message
    cli = runner.invoke(app, ["queues"])
    assert cli.exit_code == 1 and cli.stderr.count("\n") == 1
    assert cli.stderr.startswith("error: cannot reach Redis/Valkey at redis://:***@127.0.0.1"), cli.stderr


def test_an_unreachable_store_fails_a_producer_in_seconds_not_ten(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OFFLOAD_REDIS_URL", f"redis://127.0.0.1:{closed_port()}/0")
    started = time.monotonic()
    with Client() as client, pytest.raises(ConnectionFailed, match=r"after 3s"):
        client.enqueue("q", {})
    assert 2.5 <= time.monotonic() - started < 8  # retried briefly, then gave up: a person is waiting


def test_result_returns_the_output_and_download_brings_its_files(project: Path, valkey_url: str) -> None:
    with Client() as client:
        job_id = client.enqueue("res-q", {"audio": File(b"RIFF....wave", name="talk.wav"), "lang": "en"})
        ref = client.get(job_id).input["audio"]
        out = {"text": "hello", "source": ref}
        assert asyncio.run(finish(valkey_url, "res-q", project / "results", out)) == job_id
        assert client.result(job_id) == out  # the stored content, not a location
        saved = client.download(job_id, project / "got" / "deeper")
        assert orjson.loads(saved.output.read_bytes()) == out
        assert [p.read_bytes() for p in saved.files] == [b"RIFF....wave"]
        assert saved.files[0].name == ref[REF_KEY].rsplit("/", 1)[-1] and saved.skipped == []


def test_result_of_a_job_that_did_not_succeed_says_how_it_ended(project: Path, valkey_url: str) -> None:
    with Client() as client:
        waiting = client.enqueue("res-q", {"n": 1})
        with pytest.raises(TimeoutError, match="still queued"):
            client.result(waiting, timeout=0.3)
        with pytest.raises(NoResult, match="is queued, it has no result"):
            client.result(waiting)
        asyncio.run(finish(valkey_url, "res-q", project / "results", None, error="CUDA out of memory"))
        with pytest.raises(NoResult, match="is dead, it has no result: CUDA out of memory") as info:
            client.result(waiting, timeout=5)
        assert info.value.job.state is JobState.DEAD


async def test_async_client_result_waits_for_the_job(project: Path, valkey_url: str) -> None:
    from offload import AsyncClient

    async with AsyncClient() as client:
        job_id = await client.enqueue("async-q", {"n": 2})
        pending = asyncio.create_task(client.result(job_id, timeout=30))
        await finish(valkey_url, "async-q", project / "results", lambda job: {"squared": 4, "id": job.id})
        assert await pending == {"squared": 4, "id": job_id}


def test_cli_wait_prints_the_output_and_exits_by_outcome(project: Path, valkey_url: str) -> None:
    with Client() as client:
        good, bad, slow = (client.enqueue("wait-q", {"n": i}) for i in range(3))
    asyncio.run(finish(valkey_url, "wait-q", project / "results", {"answer": 42}))
    asyncio.run(finish(valkey_url, "wait-q", project / "results", None, error="bad input\nsecond line"))

    done = runner.invoke(app, ["wait", good, "--timeout", "5"])
    assert done.exit_code == 0, done.stderr
    assert orjson.loads(done.stdout) == {"answer": 42}
    as_json = runner.invoke(app, ["wait", good, "--json"])
    assert orjson.loads(as_json.stdout) == {"job": good, "state": "succeeded", "error": None, "output": {"answer": 42}}

    dead = runner.invoke(app, ["wait", bad, "--timeout", "5"])
    assert dead.exit_code == 1 and dead.stdout == ""
    assert dead.stderr == f"error: job {bad} is dead: bad input second line\n"

    started = time.monotonic()
    late = runner.invoke(app, ["wait", slow, "--timeout", "0.5"])
    assert late.exit_code == 124 and late.stdout == "" and time.monotonic() - started < 5
    assert late.stderr == f"error: job {slow} still queued after 0.5s\n"


def test_server_that_cannot_reach_its_store_at_start_raises_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OFFLOAD_REDIS_CONNECT_TIMEOUT", "0.3")
    dead = f"redis://:hunter2@127.0.0.1:{closed_port()}/0"
    with pytest.raises(ConnectionFailed, match="cannot reach Redis/Valkey"):
        serve(ServerOptions(redis_url=dead), port=0, log_level="info")
    logged = capfd.readouterr().err
    assert "Waiting for application startup" in logged  # uvicorn's log is captured here...
    assert "Traceback" not in logged and "startup failed" not in logged and "hunter2" not in logged  # ...quiet


def test_process_server_with_an_unreachable_store_is_one_line() -> None:
    url = f"redis://:hunter2@127.0.0.1:{closed_port()}/0"
    env = {**os.environ, "OFFLOAD_REDIS_CONNECT_TIMEOUT": "0.5"}
    proc = subprocess.run(
        [sys.executable, "-m", "offload", "server", "--port", "0", "--url", url],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("error: cannot reach Redis/Valkey at redis://:***@127.0.0.1"), proc.stderr
    assert proc.stderr.count("\n") == 1 and "hunter2" not in proc.stderr
