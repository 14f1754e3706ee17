"""The `offload` CLI against a real Valkey: in-process through Typer's runner, plus real subprocesses where
the point is what a shell user sees (exit codes, one error line, no traceback)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import orjson
import pytest
from support.admin_redis import redis_admin
from support.procs import interruptible, signal_state
from support.servers import closed_port
from typer.testing import CliRunner, Result

from offload.cli.app import app
from offload.connection import connect
from offload.local.embedded import stop_embedded
from offload.queue.store import QueueStore

T = TypeVar("T")
runner = CliRunner()


def cli(url: str, *args: str, input: str | None = None, env: dict[str, str] | None = None) -> Result:
    return runner.invoke(app, [*args, "--url", url], input=input, env=env)


def ok(url: str, *args: str, input: str | None = None) -> str:
    result = cli(url, *args, input=input)
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    return result.stdout


def as_json(url: str, *args: str, input: str | None = None) -> Any:
    out = ok(url, *args, "--json", input=input)
    assert out.count("\n") == 1, "--json must print exactly one document"
    return orjson.loads(out)


def failed(result: Result, code: int = 1) -> str:
    """The exit code, and for runtime errors exactly one `error:` line on stderr and nothing on stdout."""
    assert result.exit_code == code, (result.stdout, result.stderr)
    if code == 1:
        assert result.stdout == ""
        assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.output
    return result.stderr


def with_store(url: str, fn: Callable[[QueueStore], Awaitable[T]]) -> T:
    async def go() -> T:
        client = await connect(url)
        try:
            return await fn(QueueStore(client))
        finally:
            await client.aclose()

    return asyncio.run(go())


def kill_jobs(url: str, queue: str, n: int) -> list[str]:
    """Claim n jobs and fail them permanently: the way real dead letters are made."""

    async def go(store: QueueStore) -> list[str]:
        jobs = await store.claim(queue, "w1", n)
        for job in jobs:
            assert await store.fail(job.id, job.token, "boom: bad input", retryable=False) == "dead"
        return [job.id for job in jobs]

    return with_store(url, go)


def hold_jobs(url: str, queue: str, n: int) -> list[str]:
    async def go(store: QueueStore) -> list[str]:
        jobs = await store.claim(queue, "w1", n)
        for job in jobs:
            await store.hold(job.id, job.token, "daily cap reached")
        return [job.id for job in jobs]

    return with_store(url, go)


def counts(url: str, queue: str) -> dict[str, Any]:
    """One queue's row of `queues --json`, flattened: per-state counts plus paused and workers."""
    (row,) = [q for q in as_json(url, "queues") if q["queue"] == queue]
    return {**row["counts"], "paused": row["paused"], "workers": row["workers"]}


# -- enqueue ---------------------------------------------------------------------------------------


def test_enqueue_prints_only_an_id_that_status_finds(valkey_url: str) -> None:
    out = ok(valkey_url, "enqueue", "--queue", "gpu", "--input", '{"prompt": "a cat", "steps": 20}')
    job_id = out.strip()
    assert out == job_id + "\n" and job_id.startswith("gpu:")
    record = as_json(valkey_url, "status", job_id)
    assert record["id"] == job_id
    assert record["input"] == {"prompt": "a cat", "steps": 20}
    assert record["state"] == "queued"
    assert "lease_token" not in record
    table = ok(valkey_url, "status", job_id)
    assert job_id in table and "queued" in table and "a cat" in table


def test_enqueue_options_reach_the_record(valkey_url: str) -> None:
    job_id = ok(
        valkey_url,
        "enqueue",
        "-q",
        "gpu",
        "-i",
        "[1, 2]",
        "--priority",
        "7",
        "--delay",
        "3600",
        "--max-attempts",
        "5",
        "--output-key",
        "out/x.png",
    ).strip()
    record = as_json(valkey_url, "status", job_id)
    assert (record["priority"], record["max_attempts"], record["output_key"]) == (7, 5, "out/x.png")
    assert record["state"] == "delayed" and record["run_at"] > record["created_at"]


def test_idempotency_key_returns_the_same_id(valkey_url: str) -> None:
    first = ok(valkey_url, "enqueue", "-q", "gpu", "-i", '{"n": 1}', "--idempotency-key", "order-42")
    again = ok(valkey_url, "enqueue", "-q", "gpu", "-i", '{"n": 2}', "--idempotency-key", "order-42")
    other = ok(valkey_url, "enqueue", "-q", "gpu", "-i", '{"n": 1}', "--idempotency-key", "order-43")
    assert first == again != other
    assert counts(valkey_url, "gpu")["queued"] == 2


def test_enqueue_json_output(valkey_url: str) -> None:
    doc = as_json(valkey_url, "enqueue", "-q", "gpu", "-i", "{}")
    assert as_json(valkey_url, "status", doc["id"])["state"] == "queued"


def test_bad_input_json_is_one_error_line(valkey_url: str) -> None:
    err = failed(cli(valkey_url, "enqueue", "-q", "gpu", "--input", "{not json"))
    assert err.startswith("error: --input is not valid JSON: ")
    assert with_store(valkey_url, lambda s: s.queues()) == []


@pytest.mark.parametrize(
    "args", [[], ["--input", "1", "--file", "-"], ["--file", "-", "--output-key", "same/for/all.json"]]
)
def test_enqueue_usage_errors(valkey_url: str, args: list[str]) -> None:
    failed(cli(valkey_url, "enqueue", "-q", "gpu", *args, input="2\n"), code=2)
    assert with_store(valkey_url, lambda s: s.queues()) == []


def test_bulk_file_of_1000_lines(valkey_url: str, tmp_path: Path) -> None:
    lines = [orjson.dumps({"i": i}) for i in range(990)]
    lines += [orjson.dumps({"input": {"i": i}, "priority": 9, "max_attempts": 2}) for i in range(990, 999)]
    lines += [b'{"input": "last", "idempotency_key": "k-last", "output_key": "o/last"}']
    path = tmp_path / "jobs.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n\n")  # trailing blank lines are not jobs
    assert ok(valkey_url, "enqueue", "-q", "bulk", "--file", str(path)) == "1000\n"
    assert counts(valkey_url, "bulk")["queued"] == 1000
    # Per-line options win over the command line's defaults; the first 9-priority job comes out first.
    first, _ = with_store(valkey_url, lambda s: s.list_jobs("bulk", "queued", limit=1))
    assert (first[0].input, first[0].priority, first[0].max_attempts) == ({"i": 990}, 9, 2)
    # Idempotent lines return the first id again, so a re-run of the file's last line adds nothing.
    doc = as_json(valkey_url, "enqueue", "-q", "bulk", "--file", "-", input=lines[-1].decode())
    assert doc["count"] == 1 and doc["ids"][0].startswith("bulk:")
    assert counts(valkey_url, "bulk")["queued"] == 1000
    assert as_json(valkey_url, "status", doc["ids"][0])["output_key"] == "o/last"


def test_bulk_defaults_apply_to_every_line(valkey_url: str) -> None:
    doc = as_json(
        valkey_url, "enqueue", "-q", "gpu", "--file", "-", "--priority", "-5", input='1\n{"input": 2, "priority": 3}\n'
    )
    assert [as_json(valkey_url, "status", i)["priority"] for i in doc["ids"]] == [-5, 3]


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"a": 1', "line 3: not valid JSON"),
        ('{"input": 1, "priority": 5000}', "line 3: priority must be an integer from -1000 to 1000"),
        ('{"input": 1, "max_attempt": 2}', "line 3: unknown key(s) max_attempt"),
        ('{"input": 1, "delay": -1}', "line 3: delay must be >= 0 seconds"),
        ('{"input": 1, "output_key": 7}', "line 3: output_key must be a string of 1-1024 printable characters"),
    ],
)
def test_bad_line_is_named_and_nothing_is_enqueued(valkey_url: str, bad_line: str, message: str) -> None:
    text = '{"ok": 1}\n\n' + bad_line + '\n{"ok": 2}\n'  # line 2 is blank and still counts
    err = failed(cli(valkey_url, "enqueue", "-q", "gpu", "--file", "-", input=text))
    assert err.startswith(f"error: {message}"), err
    stats = with_store(valkey_url, lambda s: s.stats("gpu"))
    assert sum(stats.counts.values()) == 0


def test_default_url_comes_from_the_environment(valkey_url: str) -> None:
    result = runner.invoke(app, ["enqueue", "-q", "envq", "-i", "1"], env={"OFFLOAD_REDIS_URL": valkey_url})
    assert result.exit_code == 0, result.stderr
    assert as_json(valkey_url, "status", result.stdout.strip())["queue"] == "envq"


# -- reading ----------------------------------------------------------------------------------------


def test_queues_json_counts(valkey_url: str) -> None:
    assert as_json(valkey_url, "queues") == []
    for i in range(4):
        ok(valkey_url, "enqueue", "-q", "a", "-i", str(i))
    ok(valkey_url, "enqueue", "-q", "b", "-i", "1", "--delay", "600")
    with_store(valkey_url, lambda s: s.claim("a", "w1", 1))
    kill_jobs(valkey_url, "a", 1)
    docs = as_json(valkey_url, "queues")
    assert [d["queue"] for d in docs] == ["a", "b"]
    a, b = docs
    assert a["counts"] == {
        "queued": 2,
        "delayed": 0,
        "active": 1,
        "submitted": 0,
        "retrying": 0,
        "held": 0,
        "succeeded": 0,
        "dead": 1,
        "cancelled": 0,
    }
    assert (a["workers"], a["paused"]) == (1, False)
    assert a["oldest_ready_age_ms"] is not None and a["oldest_ready_age_ms"] >= 0
    assert b["counts"]["delayed"] == 1 and b["oldest_ready_age_ms"] is None
    table = ok(valkey_url, "queues")
    assert "succeeded" in table and any(line.split()[:3] == ["a", "2", "0"] for line in table.splitlines())


def test_jobs_by_state_pages_with_a_cursor(valkey_url: str) -> None:
    ids = [ok(valkey_url, "enqueue", "-q", "gpu", "-i", str(i)).strip() for i in range(5)]
    page = as_json(valkey_url, "jobs", "gpu", "--state", "queued", "--limit", "2")
    assert [j["id"] for j in page["jobs"]] == ids[:2] and page["next_cursor"] == 2
    last = as_json(valkey_url, "jobs", "gpu", "--state", "queued", "--limit", "2", "--cursor", "4")
    assert [j["id"] for j in last["jobs"]] == ids[4:] and last["next_cursor"] is None
    table = cli(valkey_url, "jobs", "gpu", "--state", "queued", "--limit", "2")
    assert ids[0] in table.stdout and ids[2] not in table.stdout
    assert "--cursor 2" in table.stderr
    failed(cli(valkey_url, "jobs", "gpu", "--state", "bogus"), code=2)


@pytest.mark.parametrize(
    "args",
    [
        ["queues"],
        ["jobs", "gpu", "--state", "queued"],
        ["dead", "list", "gpu"],
        ["held", "list", "gpu"],
        ["status", "JOB"],
    ],
)
def test_every_read_command_prints_one_json_document(valkey_url: str, args: list[str]) -> None:
    job_id = ok(valkey_url, "enqueue", "-q", "gpu", "-i", '{"x": "y"}').strip()
    doc = as_json(valkey_url, *[job_id if a == "JOB" else a for a in args])
    assert isinstance(doc, dict | list) and doc != {}


def test_unknown_job_is_an_error_line(valkey_url: str) -> None:
    assert "job gpu:nope not found" in failed(cli(valkey_url, "status", "gpu:nope"))
    assert "invalid job id" in failed(cli(valkey_url, "status", "no-queue-part"))


# -- operating --------------------------------------------------------------------------------------


def test_dead_list_requeue_purge_round_trip(valkey_url: str) -> None:
    for i in range(3):
        ok(valkey_url, "enqueue", "-q", "gpu", "-i", str(i))
    dead = kill_jobs(valkey_url, "gpu", 3)
    listed = as_json(valkey_url, "dead", "list", "gpu")
    assert sorted(j["id"] for j in listed["jobs"]) == sorted(dead)
    assert {j["error"] for j in listed["jobs"]} == {"boom: bad input"}
    assert dead[0] in ok(valkey_url, "dead", "list", "gpu")

    assert ok(valkey_url, "dead", "requeue", "gpu", dead[0]) == "requeued 1\n"
    record = as_json(valkey_url, "status", dead[0])
    assert (record["state"], record["attempts"]) == ("queued", 0)
    # An id that is not dead (any more) is reported, and the exit code says so; the others still move.
    partial = cli(valkey_url, "dead", "requeue", "gpu", dead[0], dead[1])
    assert (partial.exit_code, partial.stdout) == (1, "requeued 1\n")
    assert partial.stderr == f"error: 1 job(s) not dead in queue gpu: {dead[0]}\n"
    assert counts(valkey_url, "gpu")["dead"] == 1

    assert as_json(valkey_url, "dead", "requeue", "gpu", "--all") == {"requeued": [dead[2]]}
    assert counts(valkey_url, "gpu").items() >= {"dead": 0, "queued": 3}.items()

    again = kill_jobs(valkey_url, "gpu", 2)
    assert ok(valkey_url, "dead", "purge", "gpu", "--yes") == "purged 2\n"
    assert as_json(valkey_url, "dead", "list", "gpu") == {"jobs": [], "next_cursor": None}
    failed(cli(valkey_url, "status", again[0]))
    failed(cli(valkey_url, "dead", "requeue", "gpu"), code=2)  # neither ids nor --all


def test_held_list_and_release(valkey_url: str) -> None:
    for i in range(3):
        ok(valkey_url, "enqueue", "-q", "gpu", "-i", str(i))
    held = hold_jobs(valkey_url, "gpu", 3)
    listed = as_json(valkey_url, "held", "list", "gpu", "--limit", "2")
    assert [j["id"] for j in listed["jobs"]] == held[:2] and listed["next_cursor"] == 2
    assert all(j["state"] == "held" for j in listed["jobs"])
    assert ok(valkey_url, "held", "release", "gpu", held[1]) == "released 1\n"
    assert ok(valkey_url, "held", "release", "gpu", "--all") == "released 2\n"
    assert counts(valkey_url, "gpu")["held"] == 0
    assert {as_json(valkey_url, "status", i)["state"] for i in held} == {"queued"}


def test_pause_and_resume_show_in_queues(valkey_url: str) -> None:
    ok(valkey_url, "enqueue", "-q", "gpu", "-i", "1")
    assert ok(valkey_url, "pause", "gpu") == "paused gpu\n"
    assert counts(valkey_url, "gpu")["paused"] is True
    assert "gpu (paused)" in ok(valkey_url, "queues")
    assert with_store(valkey_url, lambda s: s.claim("gpu", "w1", 1)) == []
    assert ok(valkey_url, "resume", "gpu") == "resumed gpu\n"
    assert counts(valkey_url, "gpu")["paused"] is False


def test_cancel_waiting_and_active_jobs(valkey_url: str) -> None:
    waiting = ok(valkey_url, "enqueue", "-q", "gpu", "-i", "1", "--priority", "-1").strip()
    active = ok(valkey_url, "enqueue", "-q", "gpu", "-i", "2").strip()
    (claimed,) = with_store(valkey_url, lambda s: s.claim("gpu", "w1", 1))
    assert claimed.id == active
    assert ok(valkey_url, "cancel", waiting) == "cancelled\n"
    assert as_json(valkey_url, "status", waiting)["state"] == "cancelled"
    assert ok(valkey_url, "cancel", active) == "cancel requested\n"
    assert as_json(valkey_url, "status", active)["cancel_requested"] is True


def test_cancel_a_finished_job_is_an_error(valkey_url: str) -> None:
    ok(valkey_url, "enqueue", "-q", "gpu", "-i", "1")
    (dead,) = kill_jobs(valkey_url, "gpu", 1)
    assert failed(cli(valkey_url, "cancel", dead)) == f"error: job {dead} is already dead\n"
    assert "not found" in failed(cli(valkey_url, "cancel", "gpu:missing"))


def test_cancel_twice_reports_the_second_as_an_error(valkey_url: str) -> None:
    job_id = ok(valkey_url, "enqueue", "-q", "gpu", "-i", "1").strip()
    assert ok(valkey_url, "cancel", job_id) == "cancelled\n"
    assert "already cancelled" in failed(cli(valkey_url, "cancel", job_id))


def test_purge_by_state(valkey_url: str) -> None:
    for i in range(3):
        ok(valkey_url, "enqueue", "-q", "gpu", "-i", str(i))
    ok(valkey_url, "enqueue", "-q", "gpu", "-i", "9", "--delay", "600")
    assert ok(valkey_url, "purge", "gpu", "--state", "queued", "--yes") == "purged 3\n"
    assert counts(valkey_url, "gpu").items() >= {"queued": 0, "delayed": 1}.items()
    assert "cannot purge state 'active'" in failed(cli(valkey_url, "purge", "gpu", "--state", "active"))


def test_ingest_moves_tutorial_jobs(valkey_url: str) -> None:
    entries = [orjson.dumps({"id": f"t{i}", "input": {"n": i}, "output_key": f"o/{i}"}) for i in range(3)]

    async def push(store: QueueStore) -> None:
        await redis_admin(store.redis).rpush("gpu:jobs", *entries, b"not json")

    with_store(valkey_url, push)
    assert ok(valkey_url, "ingest", "--from-list", "gpu:jobs", "--queue", "tut") == (
        "ingested 3, 1 malformed (dead-lettered)\n"
    )
    assert as_json(valkey_url, "status", "tut:t1")["output_key"] == "o/1"
    assert "malformed" in as_json(valkey_url, "dead", "list", "tut")["jobs"][0]["error"]
    with_store(valkey_url, push)
    # A re-pushed tutorial job is counted but not duplicated: its id is its idempotency key.
    assert as_json(valkey_url, "ingest", "--from-list", "gpu:jobs", "-q", "tut") == {"ingested": 3, "dead": 1}
    assert counts(valkey_url, "tut")["queued"] == 3
    assert as_json(valkey_url, "ingest", "--from-list", "gpu:jobs", "-q", "tut") == {"ingested": 0, "dead": 0}


def test_embedded_status_and_stop(tmp_home: Path) -> None:
    status = orjson.loads(runner.invoke(app, ["embedded", "status", "--json"]).stdout)
    assert status == {"running": False, "url": None, "data_dir": str(tmp_home.resolve())}
    try:
        started = runner.invoke(app, ["embedded", "start"]).stdout.strip()
        assert started.startswith("redis://127.0.0.1:")
        status = orjson.loads(runner.invoke(app, ["embedded", "status", "--json"]).stdout)
        assert status["running"] is True and status["url"] == started
        assert runner.invoke(app, ["embedded", "stop"]).stdout == "stopped\n"
    finally:
        stop_embedded()
    assert "not running" in runner.invoke(app, ["embedded", "status"]).stdout
    assert runner.invoke(app, ["embedded", "stop"]).stdout == "not running\n"


# -- real processes ---------------------------------------------------------------------------------


def offload(*args: str, timeout_env: str = "1") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OFFLOAD_REDIS_CONNECT_TIMEOUT": timeout_env}
    return subprocess.run(
        [sys.executable, "-m", "offload", *args], capture_output=True, text=True, env=env, timeout=60, check=False
    )


def test_process_bad_queue_name_is_one_line_no_traceback(valkey_url: str) -> None:
    proc = offload("enqueue", "--queue", "no spaces!", "--input", "{}", "--url", valkey_url)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("error: invalid queue name 'no spaces!'") and proc.stderr.count("\n") == 1


def test_process_unreachable_redis_is_one_line_no_traceback() -> None:
    url = f"redis://127.0.0.1:{closed_port()}/0"  # nothing listens there
    proc = offload("queues", "--url", url)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith(f"error: cannot reach Redis/Valkey at {url}"), proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_process_usage_error_exits_2() -> None:
    proc = offload("enqueue", "--queue", "gpu", "--priority", "5000", "--input", "1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def ended(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """The (stdout, stderr) of a Ctrl-C'd child, which must exit within 30 s. Fails naming both processes' signal
    masks: twice a full suite's child ignored its SIGINT, never one run alone."""
    try:
        return proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"no exit 30 s after SIGINT; child: {signal_state(proc.pid)}; this process: {signal_state()}"
        ) from None


@pytest.fixture
def watcher(valkey_url: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "offload", "queues", "--watch", "--json", "--interval", "0.1", "--url", valkey_url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=interruptible,
    )
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(60)
def test_process_watch_streams_snapshots_and_ends_cleanly_on_ctrl_c(
    valkey_url: str, watcher: subprocess.Popen[str]
) -> None:
    ok(valkey_url, "enqueue", "-q", "gpu", "-i", "1")
    assert watcher.stdout is not None
    seen: list[Any] = []
    while not (seen and seen[-1] and seen[-1][0]["counts"]["queued"] == 1):
        line = watcher.stdout.readline()
        assert line, watcher.stderr.read() if watcher.stderr else "watch exited"
        seen.append(orjson.loads(line))
    ok(valkey_url, "enqueue", "-q", "gpu", "-i", "2")
    while seen[-1][0]["counts"]["queued"] != 2:  # the stream picks up changes without a restart
        seen.append(orjson.loads(watcher.stdout.readline()))
    watcher.send_signal(signal.SIGINT)
    _, stderr = ended(watcher)
    assert watcher.returncode == 0 and "Traceback" not in stderr, stderr


@pytest.mark.timeout(60)
def test_process_ingest_follow_drains_until_ctrl_c_then_reports_totals(valkey_url: str) -> None:
    async def push(store: QueueStore, *ids: str) -> None:
        await redis_admin(store.redis).rpush("gpu:jobs", *(orjson.dumps({"id": i, "input": {"id": i}}) for i in ids))

    with_store(valkey_url, lambda s: push(s, "a", "b"))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "offload",
            "ingest",
            "--from-list",
            "gpu:jobs",
            "-q",
            "tut",
            "--follow",
            "--json",
            "--url",
            valkey_url,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=interruptible,
    )
    try:
        assert proc.stderr is not None
        assert proc.stderr.readline() == "ingested 2, malformed 0\n"
        with_store(valkey_url, lambda s: push(s, "c"))  # arrives while the command is already waiting
        assert proc.stderr.readline() == "ingested 3, malformed 0\n"
        proc.send_signal(signal.SIGINT)
        stdout, stderr = ended(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr
    assert orjson.loads(stdout) == {"ingested": 3, "dead": 0}
    assert counts(valkey_url, "tut")["queued"] == 3


# -- bad environment values and unexpected errors: one line, never a traceback --------------------------------


@pytest.mark.parametrize(
    ("name", "value", "args", "message"),
    [
        (
            "OFFLOAD_MAX_PAYLOAD",
            "lots",
            ["enqueue", "-q", "gpu", "-i", "1"],
            "error: OFFLOAD_MAX_PAYLOAD: expected an integer, got 'lots'\n",
        ),
        (
            "OFFLOAD_MAX_PAYLOAD",
            "0",
            ["enqueue", "-q", "gpu", "-i", "1"],
            "error: OFFLOAD_MAX_PAYLOAD: must be at least 1, got '0'\n",
        ),
        (
            "OFFLOAD_MAX_PAYLOAD",
            "1e6",
            ["enqueue", "-q", "gpu", "--file", "-"],
            "error: OFFLOAD_MAX_PAYLOAD: expected an integer, got '1e6'\n",
        ),
        (
            "OFFLOAD_REDIS_CONNECT_TIMEOUT",
            "soon",
            ["queues"],
            "error: OFFLOAD_REDIS_CONNECT_TIMEOUT: expected a number, got 'soon'\n",
        ),
        (
            "OFFLOAD_REDIS_CONNECT_TIMEOUT",
            "inf",
            ["status", "gpu:x"],
            "error: OFFLOAD_REDIS_CONNECT_TIMEOUT: expected a finite number, got 'inf'\n",
        ),
    ],
)
def test_a_bad_environment_value_is_one_line_naming_the_variable(
    valkey_url: str, name: str, value: str, args: list[str], message: str
) -> None:
    assert failed(cli(valkey_url, *args, input="1\n", env={name: value})) == message
    assert with_store(valkey_url, lambda s: s.queues()) == []


def test_process_bad_max_payload_is_one_line_no_traceback(valkey_url: str) -> None:
    env = {**os.environ, "OFFLOAD_MAX_PAYLOAD": "1 MiB"}
    proc = subprocess.run(
        [sys.executable, "-m", "offload", "enqueue", "-q", "gpu", "-i", "{}", "--url", valkey_url],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == "error: OFFLOAD_MAX_PAYLOAD: expected an integer, got '1 MiB'\n"


def test_a_file_that_cannot_be_written_is_one_line(valkey_url: str, tmp_path: Path) -> None:
    """`result --download` into a missing directory: an OSError, reported like every other failure."""
    (tmp_path / "offload.yaml").write_text(f"redis_url: {valkey_url}\nstorage: {{kind: local, path: {tmp_path}}}\n")
    job_id = ok(valkey_url, "enqueue", "-q", "gpu", "-i", "1").strip()

    async def finish(store: QueueStore) -> None:
        (job,) = await store.claim("gpu", "w1", 1)
        await store.complete(job.id, job.token, f"file://{tmp_path}/results/{job.id}.json")

    with_store(valkey_url, finish)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / f"{job_id}.json").write_text('{"ok": true}')
    result = runner.invoke(
        app,
        [
            "result",
            job_id,
            "--config",
            str(tmp_path / "offload.yaml"),
            "--download",
            str(tmp_path / "missing" / "out.json"),
        ],
    )
    assert "No such file or directory" in failed(result)


def test_an_unexpected_exception_still_ends_as_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bug no command maps: `main` (the console script) prints one line and exits 1, no traceback."""
    import typer

    import offload.cli.app as cli_app

    broken = typer.Typer()

    @broken.command()
    def explode() -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(cli_app, "app", broken)
    monkeypatch.setattr(sys, "argv", ["offload"])
    with pytest.raises(SystemExit) as exit_info:
        cli_app.main()
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == "error: unexpected ZeroDivisionError: a bug\n"
