"""`offload worker` picks its queues from the configuration: real `offload worker` processes, each given only what
its machine would have (an offload.yaml, or a rented machine's OFFLOAD_* variables), against a real Valkey, a real
S3 (rclone), the simulator and a real server. (The tutorial's env file alone is in tests/worker/test_worker_crash.py.)

Order: --queue (repeatable or comma-separated), else OFFLOAD_QUEUE (comma-separated), else, for the dispatch
worker, every queue the configuration gives a backend. Nothing names a queue: one error line saying what to set.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.eventually import eventually, eventually_sync
from support.procs import die_with_parent
from support.s3server import RcloneS3
from support.server_helpers import BUCKET, make_key, new_queue, server
from support.servers import ValkeyServer
from test_gpu_worker import enqueue, wait_state, workers
from typer.testing import CliRunner

from bench import web
from offload.cli.app import app
from offload.connection import connect
from offload.eventloop import within
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.testing.sim.config import SimConfig
from offload.testing.sim.server import running_sim

BIN = Path(sys.executable).parent
OFFLOAD = str(BIN / "offload")
REPO = Path(__file__).resolve().parents[2]
ENTRYPOINT = REPO / "deploy" / "image" / "entrypoint.sh"
_live: list[subprocess.Popen[bytes]] = []


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    with running_sim(SimConfig.model_validate({"default": {"latency": 0.2}})) as url:
        yield str(url)


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


@pytest.fixture
async def store(valkey_url: str) -> AsyncIterator[QueueStore]:
    redis = await connect(valkey_url)
    yield QueueStore(redis)
    await redis.aclose()


def machine_env(**names: str) -> dict[str, str]:
    """What a machine's environment holds and nothing more: no REDIS_URL, OFFLOAD_* or AWS_* from this shell."""
    return {"PATH": f"{BIN}:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1", **names}


def spawn(cmd: list[str], env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
    _live.append(proc)
    return proc


def stopped(proc: subprocess.Popen[bytes], log: Path, timeout: float = 30) -> int:
    """SIGTERM, then the exit code (the drain must end within `timeout`)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"no exit {timeout}s after SIGTERM:\n{log.read_text()[-3000:]}") from None


async def wait_for(check: Callable[[], Any], timeout: float, what: str, log: Path) -> None:
    """`eventually`, with the worker's log tail in the failure."""
    await eventually(check, timeout, what, why=lambda: log.read_text()[-3000:])


# -- the GPU worker of a rented machine -------------------------------------------------------------------


def test_rented_machine_runs_the_image_entrypoint_with_its_env_alone(api: tuple[str, str], tmp_path: Path) -> None:
    """What the autoscaler gives a machine (OFFLOAD_SERVER, OFFLOAD_TOKEN, OFFLOAD_QUEUE, OFFLOAD_INSTANCE_ID),
    through the image's real entrypoint and the real `offload`: no --queue, --server or --token anywhere."""
    url, boot = api
    q = new_queue("rented")
    token = make_key(url, boot, "worker", [q])
    log = tmp_path / "worker.log"
    env = machine_env(
        OFFLOAD_HANDLER="tests.support.handlers:echo",
        OFFLOAD_SERVER=url,
        OFFLOAD_TOKEN=token,
        OFFLOAD_QUEUE=q,
        OFFLOAD_INSTANCE_ID="i-rented1",  # not an autoscaler id (as-…): no token needed,
    )
    proc = spawn(["/bin/sh", str(ENTRYPOINT)], env, REPO, log)
    ids = enqueue(url, boot, q, [{"n": 1}, {"n": 2}])
    assert [wait_state(url, boot, j, "succeeded")["attempts"] for j in ids] == [1, 1]
    (me,) = [w for w in workers(url, boot) if q in w["queues"]]
    assert (me["queues"], me["instance_id"], me["kind"]) == ([q], "i-rented1", "remote")
    cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")  # the entrypoint exec'd offload
    assert b"worker" in cmdline and token.encode() not in b" ".join(cmdline)
    assert stopped(proc, log) == 0
    # Gone once its lease lapses at the latest: a long-poll claim the server is still running when the worker
    # deregisters renews the store's liveness once more (seen under load; the server's race, not the CLI's).
    eventually_sync(lambda: not [w for w in workers(url, boot) if q in w["queues"]], 10, f"worker of {q} to be gone")


def test_one_gpu_worker_serves_every_queue_of_offload_queue(api: tuple[str, str], tmp_path: Path) -> None:
    url, boot = api
    qa, qb = new_queue("qa"), new_queue("qb")
    log = tmp_path / "worker.log"
    env = machine_env(
        OFFLOAD_SERVER=url, OFFLOAD_TOKEN=make_key(url, boot, "worker", [qa, qb]), OFFLOAD_QUEUE=f" {qa}, {qb},"
    )
    proc = spawn(
        [OFFLOAD, "worker", "--handler", "tests.support.handlers:echo", "--load", "tests.support.handlers:load"],
        env,
        REPO,
        log,
    )
    ids = enqueue(url, boot, qa, [{"a": i} for i in range(3)]) + enqueue(url, boot, qb, [{"b": i} for i in range(3)])
    done = [wait_state(url, boot, j, "succeeded") for j in ids]
    assert {d["queue"] for d in done} == {qa, qb}
    (me,) = [w for w in workers(url, boot) if qa in w["queues"]]
    assert me["queues"] == [qa, qb]  # one registration, one process, one load of the model
    results = [web.get(d["result_url"]).json() for d in done]
    assert {r["pid"] for r in results} == {proc.pid} and {r["load_calls"] for r in results} == {1}
    assert stopped(proc, log) == 0


def test_a_key_that_misses_one_of_the_queues_stops_the_worker_with_one_line(
    api: tuple[str, str], tmp_path: Path
) -> None:
    url, boot = api
    qa, qb = new_queue("qa"), new_queue("qb")
    env = machine_env(OFFLOAD_SERVER=url, OFFLOAD_TOKEN=make_key(url, boot, "worker", [qa]), OFFLOAD_QUEUE=f"{qa},{qb}")
    out = subprocess.run(
        [OFFLOAD, "worker", "--handler", "tests.support.handlers:echo"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "403" in lines[0] and qb in lines[0], out.stderr
    assert "Traceback" not in out.stderr


# -- the dispatch worker: every queue of offload.yaml -----------------------------------------------------


def write_yaml(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def two_queue_config(valkey_url: str, s3: RcloneS3, sim: str) -> dict[str, Any]:
    return {
        "redis_url": valkey_url,
        "storage": {**s3.settings(BUCKET), "secret_access_key": "${TEST_S3_SECRET}"},
        "backends": {
            "tut": {"kind": "http-job", "base_url": sim, "api_key": "k"},
            "rp": {"kind": "runpod", "endpoint_id": "sdxl", "base_url": sim, "api_key": "k"},
        },
        "queues": {
            "jobs": {"backend": "tut", "poll_interval": 0.2},
            "images": {"backend": "rp", "poll_interval": 0.2},
            "gpu": {},
        },  # served by GPU workers: no backend, so the dispatch worker leaves it alone
    }


async def sim_call(sim: str, path: str, body: dict[str, Any] | None = None) -> Any:
    async with web.async_client(base_url=sim, timeout=30) as c:
        response = await (c.get(path) if body is None else c.post(path, json=body))
        response.raise_for_status()
        return response.json()


async def test_dispatch_worker_serves_every_configured_queue_and_drains_them_together(
    valkey_url: str, s3: RcloneS3, sim: str, store: QueueStore, tmp_path: Path
) -> None:
    await sim_call(sim, "/_sim/reset", {})
    write_yaml(tmp_path / "offload.yaml", two_queue_config(valkey_url, s3, sim))  # found as ./offload.yaml
    log = tmp_path / "worker.log"
    proc = spawn([OFFLOAD, "worker", "--grace", "0.5"], machine_env(TEST_S3_SECRET=s3.secret_key), tmp_path, log)
    queues = ("jobs", "images")
    for q in queues:
        await store.enqueue_many(q, [JobSpec(input={"id": f"{q}-{i}"}) for i in range(3)])
    parked = await store.enqueue("gpu", JobSpec(input={"id": "gpu-0"}))

    async def all_done() -> bool:
        return [(await store.stats(q)).counts["succeeded"] for q in queues] == [3, 3]

    await wait_for(all_done, 30, "both queues' jobs to succeed", log)
    text = log.read_text()
    assert "serving queue jobs via tut (http-job)" in text and "serving queue images via rp (runpod)" in text
    assert [(await store.stats(q)).workers for q in (*queues, "gpu")] == [1, 1, 0]
    assert (await store.get(parked)).state.value == "queued"
    submissions = (await sim_call(sim, "/_sim/stats"))["submissions_by_input_id"]
    assert {k: v for k, v in submissions.items() if k.startswith(queues)} == {
        f"{q}-{i}": 1 for q in queues for i in range(3)
    }

    # SIGTERM with remote jobs running on both queues: one drain, every lease handed back with its remote id.
    await sim_call(sim, "/_sim/config", {"default": {"latency": 60}})
    slow = {q: await store.enqueue(q, JobSpec(input={"id": f"slow-{q}"})) for q in queues}

    async def both_submitted() -> bool:
        return None not in [(await store.get(j)).remote_id for j in slow.values()]

    await wait_for(both_submitted, 30, "both slow jobs to be submitted", log)
    assert stopped(proc, log) == 0
    for q, job_id in slow.items():
        job = await store.get(job_id)
        assert job.state.value == "queued" and job.remote_id, (q, job)
        assert (await store.stats(q)).workers == 0
    await sim_call(sim, "/_sim/config", {"default": {"latency": 0.2}})


# -- nothing names a queue, or the name is wrong -------------------------------------------------------------

runner = CliRunner()
CLEAN = {
    name: None
    for name in (  # nothing from this shell may name a queue or a server
        "OFFLOAD_QUEUE",
        "OFFLOAD_CONFIG",
        "OFFLOAD_QUEUE_KEY",
        "QUEUE_KEY",
        "OFFLOAD_API_BASE",
        "GPU_API_BASE",
        "OFFLOAD_SERVER",
        "OFFLOAD_TOKEN",
        "OFFLOAD_REDIS_URL",
        "REDIS_URL",
        "RESULT_BUCKET",
        "OFFLOAD_RESULT_BUCKET",
    )
}


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def worker_error(tmp_path: Path, *args: str, **env: str) -> str:
    """Run `offload worker ...` in `tmp_path` (OFFLOAD_HOME inside it); it must fail with exactly one line."""
    home = {"OFFLOAD_HOME": str(tmp_path / ".offload")}
    result = runner.invoke(app, ["worker", *args], env={**CLEAN, **home, **env})
    assert result.exit_code == 1, (result.stdout, result.stderr, result.exception)
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def test_no_queue_anywhere_says_what_to_set(in_tmp: Path) -> None:
    tmp_path = in_tmp
    err = worker_error(tmp_path)
    assert err.startswith("error: no queue to serve: pass --queue, set OFFLOAD_QUEUE, or configure one")
    assert "QUEUE_KEY" in err and "offload.yaml" in err


def test_a_config_whose_queues_have_no_backend_is_named(in_tmp: Path) -> None:
    tmp_path = in_tmp
    write_yaml(tmp_path / "offload.yaml", {"queues": {"gpu": {}, "llm": {}}})
    err = worker_error(tmp_path)
    assert err == (
        "error: no queue to serve: offload.yaml gives no queue a backend (gpu, llm: served by "
        "`offload worker --handler`); pass --queue or set OFFLOAD_QUEUE\n"
    )


def test_offload_queue_must_name_a_configured_queue(in_tmp: Path) -> None:
    tmp_path = in_tmp
    write_yaml(tmp_path / "offload.yaml", {"queues": {"gpu": {}}})
    assert worker_error(tmp_path, OFFLOAD_QUEUE="nope") == ("error: queue 'nope' is not configured (configured: gpu)\n")
    assert worker_error(tmp_path, OFFLOAD_QUEUE="gpu") == (
        "error: queues.gpu.backend: required to dispatch this queue (it names no backend, and no autoscale.overflow "
        "backends)\n"
    )
    assert "invalid queue name 'no spaces!'" in worker_error(tmp_path, "--queue", "ok,no spaces!")


def test_handler_worker_needs_a_queue(in_tmp: Path) -> None:
    tmp_path = in_tmp
    err = worker_error(
        tmp_path, "--handler", "tests.support.handlers:echo", OFFLOAD_SERVER="http://127.0.0.1:9", OFFLOAD_TOKEN="t"
    )
    assert err == "error: --handler needs a queue to serve: --queue, or OFFLOAD_QUEUE (comma-separated for several)\n"


def test_process_without_a_queue_exits_1_without_a_traceback(tmp_path: Path) -> None:
    out = subprocess.run(
        [OFFLOAD, "worker"],
        env=machine_env(OFFLOAD_HOME=str(tmp_path / ".offload")),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith("error: no queue to serve") and out.stderr.count("\n") == 1, out.stderr


# -- one process, several workers: the first failure stops them all ------------------------------------------


class _Loop:
    """Only the contract `_serve_all` relies on (Worker.run: serve until `stop`, then drain and return; or
    raise): the coordination is the subject here, not Redis."""

    def __init__(self, queue: str, fail_after: float | None = None) -> None:
        self.options = type("Options", (), {"queue": queue})()
        self.fail_after = fail_after
        self.drained = False

    async def run(self, stop: asyncio.Event, cut: asyncio.Event | None = None) -> None:
        if self.fail_after is not None:
            await asyncio.sleep(self.fail_after)
            raise ConnectionError(f"{self.options.queue}: Redis went away")
        await stop.wait()
        await asyncio.sleep(0.05)  # a drain takes a moment; the failure must wait for it
        self.drained = True


async def test_the_first_failing_worker_drains_the_others_then_fails_the_process() -> None:
    from offload.worker.run import _serve_all

    healthy, failing = _Loop("a"), _Loop("b", fail_after=0.05)
    stop = asyncio.Event()
    with pytest.raises(ConnectionError, match="b: Redis went away"):
        await within(_serve_all([healthy, failing], stop), 10)  # type: ignore[list-item]
    assert stop.is_set() and healthy.drained
    both = [_Loop("a"), _Loop("b")]
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, stop.set)
    await within(_serve_all(both, stop), 10)  # type: ignore[arg-type]
    assert [w.drained for w in both] == [True, True]
