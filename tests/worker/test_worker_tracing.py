"""OpenTelemetry traces of a job (offload/tracing.py): real Valkey, the real worker, the simulator over HTTP, a real
S3 server, the spans collected in memory by the SDK's InMemorySpanExporter."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any, ClassVar

import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from support.eventually import eventually
from support.s3server import RcloneS3
from support.tracing import no_secret, parent_id, spans, traced
from test_worker import job_input

from bench import web
from offload import tracing
from offload.client import Client
from offload.config import Settings
from offload.connection import connect
from offload.queue import keyspace
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.testing.sim.config import SimConfig
from offload.testing.sim.server import running_sim
from offload.worker.run import run_worker

BUCKET = "traced-results"
API_KEY = "sk-otel-7Q2xV9mKp4LwR8sT3nB6"  # the backend's key: in the provider's error text, never in a span
INPUT_MARKER = "INPUT-SECRET-5f1c9e"  # in every input: never in a span


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    with running_sim(SimConfig.model_validate({"default": {"latency": 0.3}})) as url:
        yield str(url)


@pytest.fixture(autouse=True)
def _traced(sim: str) -> Iterator[None]:
    web.post(f"{sim}/_sim/reset").raise_for_status()
    _sim_config(sim)  # (a reset keeps the behaviour an earlier test set: a 60 s latency, failures)
    with traced():
        yield


@pytest.fixture
async def store(valkey_url: str) -> AsyncIterator[QueueStore]:
    redis = await connect(valkey_url)
    yield QueueStore(redis)
    await redis.aclose()


def _settings(valkey_url: str, s3: RcloneS3, sim: str) -> Settings:
    return Settings.model_validate(
        {
            "redis_url": valkey_url,
            "storage": s3.settings(BUCKET),
            "backends": {"gpu": {"kind": "http-job", "base_url": sim, "api_key": API_KEY}},
            "queues": {"q": {"backend": "gpu", "poll_interval": 0.2, "poll_timeout": 30, "max_attempts": 3}},
            "tracing": {"enabled": True},
        }
    )


def _sim_config(sim: str, **behaviour: Any) -> None:
    web.post(f"{sim}/_sim/config", json={"default": {"latency": 0.3, **behaviour}}).raise_for_status()


async def _serve_until(settings: Settings, done: Any, what: str) -> None:
    """A real worker serving queue `q` until `done()` holds, then drained."""
    stop = asyncio.Event()
    task = asyncio.create_task(run_worker(settings, "q", stop=stop, install_signals=False, grace_s=5))
    try:
        await eventually(done, 60, what, task=task)
    finally:
        stop.set()
        await task


async def _ended(name: str, count: int) -> list[ReadableSpan]:
    """Every finished span, once `count` spans of `name` have ended (a job's state is written before its
    attempt's task ends its span)."""
    await eventually(lambda: len(spans(name)) >= count, 10, f"{count} {name} spans to end")
    return spans()


def _named(found: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in found if s.name == name]


async def test_a_retried_job_is_one_trace(valkey_url: str, s3: RcloneS3, sim: str, store: QueueStore) -> None:
    settings = _settings(valkey_url, s3, sim)
    # the provider fails the first run, echoing the API key in its error (the backend redacts it)
    _sim_config(sim, fail_rate=1.0, error_message=f"out of memory (key {API_KEY})")
    job_id = await store.enqueue("q", JobSpec(input={**job_input("traced"), "note": INPUT_MARKER}))
    record = keyspace.job("q", job_id)
    traceparent = await store.redis.hget(record, tracing.RECORD_FIELD)
    assert traceparent is not None and traceparent.startswith("00-"), traceparent

    async def succeeded() -> bool:
        job = await store.get(job_id)
        if job.attempts == 1 and job.state.value == "retrying":  # failed once: the retry (>= 0.5 s on) succeeds
            _sim_config(sim, fail_rate=0.0)
        return job.state.value == "succeeded"

    await _serve_until(settings, succeeded, "the job to fail once and succeed on its retry")
    assert (await store.get(job_id)).attempts == 2
    found = await _ended("offload.attempt", 2)
    (enqueue,) = _named(found, "offload.enqueue")
    assert enqueue.context is not None
    trace_id = enqueue.context.trace_id
    assert traceparent.startswith(f"00-{trace_id:032x}-{enqueue.context.span_id:016x}-")  # the enqueue span's
    assert {s.context.trace_id for s in found if s.context is not None} == {trace_id}
    assert enqueue.attributes == {tracing.QUEUE: "q", tracing.JOB_ID: job_id}

    attempts = sorted(_named(found, "offload.attempt"), key=lambda s: s.start_time or 0)
    assert [parent_id(a) for a in attempts] == [enqueue.context.span_id] * 2
    first, second = (dict(a.attributes or {}) for a in attempts)
    assert first[tracing.ATTEMPT] == 1 and second[tracing.ATTEMPT] == 2
    assert first[tracing.OUTCOME] == "retrying" and second[tracing.OUTCOME] == "succeeded"
    assert first[tracing.BACKEND] == second[tracing.BACKEND] == "gpu"
    assert first[tracing.JOB_ID] == second[tracing.JOB_ID] == job_id and first[tracing.QUEUE] == "q"
    assert attempts[0].status.status_code is trace.StatusCode.ERROR
    assert "out of memory" in (attempts[0].status.description or "")
    assert attempts[1].status.status_code is trace.StatusCode.UNSET
    assert first[tracing.REMOTE_ID] != second[tracing.REMOTE_ID]  # the retry is a new remote job

    for attempt in attempts:
        assert attempt.context is not None
        children = [s for s in found if parent_id(s) == attempt.context.span_id]
        names = {s.name for s in children}
        assert {"offload.submit", "offload.poll"} <= names, names
        (submit,) = _named(children, "offload.submit")
        assert submit.attributes is not None
        assert submit.attributes[tracing.REMOTE_ID] == attempt.attributes[tracing.REMOTE_ID]  # type: ignore[index]
        assert submit.kind is trace.SpanKind.CLIENT
        polls = _named(children, "offload.poll")
        assert all(p.attributes and p.attributes[tracing.BACKEND] == "gpu" for p in polls)
    (stored,) = _named(found, "offload.store")
    assert attempts[1].context is not None and parent_id(stored) == attempts[1].context.span_id
    assert stored.attributes == {
        tracing.SUBMISSION: 2,
        tracing.LOCATION: f"s3://{BUCKET}/results/{job_id}.json",
    }
    no_secret(found, API_KEY, INPUT_MARKER)


async def test_a_cancelled_job_traces_its_remote_cancel(
    valkey_url: str, s3: RcloneS3, sim: str, store: QueueStore
) -> None:
    settings = _settings(valkey_url, s3, sim)
    _sim_config(sim, latency=60)  # still running when the cancel comes
    job_id = await store.enqueue("q", JobSpec(input=job_input("cancelled")))

    async def cancelled() -> bool:
        job = await store.get(job_id)
        if job.remote_id is not None and not job.cancel_requested:
            await store.cancel(job_id)
        return job.state.value == "cancelled"

    await _serve_until(settings, cancelled, "the running job to be cancelled")
    found = await _ended("offload.attempt", 1)
    (attempt,) = _named(found, "offload.attempt")
    assert attempt.attributes is not None and attempt.attributes[tracing.OUTCOME] == "cancelled"
    remote_id = attempt.attributes[tracing.REMOTE_ID]
    assert attempt.context is not None
    (cancel,) = [s for s in _named(found, "offload.cancel") if parent_id(s) == attempt.context.span_id]
    assert cancel.attributes == {tracing.REMOTE_ID: remote_id}
    assert cancel.status.status_code is trace.StatusCode.UNSET
    no_secret(found, API_KEY)


HOSTILE = [
    "garbage",
    "00-" + "0" * 32 + "-" + "0" * 16 + "-01",  # all zeros: invalid by the spec
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # version ff is forbidden
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\r\nx-evil: 1",
    "00-" + "a" * 32 + "-" + "b" * 16 + "-01" + "x" * 100_000,  # a valid head on a huge tail: not read
    "",
]


async def test_a_hostile_traceparent_runs_in_a_fresh_trace(
    valkey_url: str, s3: RcloneS3, sim: str, store: QueueStore
) -> None:
    settings = _settings(valkey_url, s3, sim)
    ids = await store.enqueue_many("q", [JobSpec(input=job_input(f"h{i}")) for i in range(len(HOSTILE) + 1)])
    for job_id, value in zip(ids, HOSTILE, strict=False):  # what an old or hostile producer may have written
        await store.redis.hset(keyspace.job("q", job_id), tracing.RECORD_FIELD, value)
    # one record's value is not even UTF-8 (it fails its batch's read: those jobs start fresh traces too)
    await store.redis.hset(keyspace.job("q", ids[-1]), tracing.RECORD_FIELD, b"\xff\xfe\x00")

    async def all_done() -> bool:
        return (await store.stats("q")).counts["succeeded"] == len(ids)

    await _serve_until(settings, all_done, "every job with a hostile traceparent to succeed")

    def succeeded_attempts() -> list[ReadableSpan]:
        done = [a for a in spans("offload.attempt") if a.attributes and a.attributes[tracing.OUTCOME] == "succeeded"]
        return done if len(done) == len(ids) else []

    finals = await eventually(succeeded_attempts, 10, "every job's succeeded attempt span to end")
    attempts = spans("offload.attempt")  # (a retry under load adds attempts: each starts a fresh trace as well)
    seen = [dict(a.attributes or {}) for a in attempts]
    assert sorted(str(a.attributes[tracing.JOB_ID]) for a in finals if a.attributes) == sorted(ids), seen
    assert all(a.parent is None for a in attempts), seen  # each a root: a fresh trace
    trace_ids = {a.context.trace_id for a in attempts if a.context is not None}
    assert len(trace_ids) == len(attempts), seen
    assert not trace_ids & {0x4BF92F3577B34DA6A3CE929D0E0E4736, int("a" * 32, 16)}
    found = spans()
    for attempt in finals:  # the rest of each trace hangs off its attempt
        assert attempt.context is not None
        children = [s for s in found if parent_id(s) == attempt.context.span_id]
        assert {"offload.submit", "offload.store"} <= {s.name for s in children}


async def test_a_producer_trace_carries_into_the_job(valkey_url: str, store: QueueStore) -> None:
    """An enqueue inside the application's own span is its child: the job joins the caller's trace."""
    with trace.get_tracer("app").start_as_current_span("request") as outer:
        job_id = await store.enqueue("q", JobSpec(input={"x": 1}))
    value = await store.redis.hget(keyspace.job("q", job_id), tracing.RECORD_FIELD)
    (enqueue,) = _named(spans(), "offload.enqueue")
    ctx = outer.get_span_context()
    assert enqueue.parent is not None and enqueue.parent.span_id == ctx.span_id
    assert value is not None and value.split("-")[1] == f"{ctx.trace_id:032x}"


def test_the_sync_client_carries_the_callers_span(valkey_url: str) -> None:
    """`Client` runs its calls on a loop of its own, in another thread: the caller's span still parents them."""
    with Client(valkey_url) as client, trace.get_tracer("app").start_as_current_span("request") as outer:
        job_id = client.enqueue("q", {"x": 1})
    (enqueue,) = spans("offload.enqueue")
    assert enqueue.parent is not None and enqueue.parent.span_id == outer.get_span_context().span_id
    assert enqueue.attributes is not None and enqueue.attributes[tracing.JOB_ID] == job_id


# Runs as if offload[otel] were not installed: every import of opentelemetry fails, and an attempt made by
# offload's own code is recorded (redis-py tries one at its own import, and copes).
OFF_SCRIPT = """
import asyncio, importlib.abc, json, sys

tried = []

class NoOtel(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] != "opentelemetry":
            return None
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen")):
            frame = frame.f_back
        importer = frame.f_globals.get("__name__", "") if frame is not None else ""
        if importer.startswith("offload"):
            tried.append(importer)
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoOtel())
from offload.client import AsyncClient
import offload.worker.run  # everything a worker imports (the server's FastAPI needs opentelemetry-api itself)

async def main():
    async with AsyncClient(sys.argv[1]) as client:
        try:
            job_id = await client.enqueue("q", {"x": 1})
        except Exception as exc:
            print(json.dumps({"error": str(exc)}))
            return
        store = await client.store()
        fields = await store.redis.hkeys(f"offload:{{q}}:job:{job_id}")
    print(json.dumps({"fields": sorted(fields), "tried": tried}))

asyncio.run(main())
"""


def _without_otel(valkey_url: str, **env: str) -> dict[str, Any]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OFFLOAD_TRACING", "OTEL_"))}
    out = subprocess.run(
        [sys.executable, "-c", OFF_SCRIPT, valkey_url],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    seen: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return seen


def test_tracing_off_needs_no_opentelemetry(valkey_url: str) -> None:
    seen = _without_otel(valkey_url)
    assert "input" in seen["fields"] and tracing.RECORD_FIELD not in seen["fields"], seen
    assert seen["tried"] == [], seen  # offload never even tried to import it


def test_tracing_on_without_the_extra_says_what_to_install(valkey_url: str) -> None:
    seen = _without_otel(valkey_url, OFFLOAD_TRACING="1")
    assert seen == {
        "error": "tracing needs the optional dependency 'opentelemetry.trace', which is not installed: "
        "pip install 'offload[otel]'"
    }, seen


PRODUCER_SCRIPT = """
import asyncio, sys
from offload.client import AsyncClient

async def main():
    async with AsyncClient(sys.argv[1]) as client:
        print(await client.enqueue("q", {"x": 1}))

asyncio.run(main())
"""


class _Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver: keeps each export request's body."""

    bodies: ClassVar[list[bytes]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/v1/traces":
            self.bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        return None


def test_the_otlp_exporter_sends_to_a_collector(valkey_url: str) -> None:
    """`tracing.exporter: otlp` (here OFFLOAD_TRACING_EXPORTER) in a producer: its spans reach a collector over
    OTLP/HTTP, configured by the standard OTEL_* variables alone."""
    receiver = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=receiver.serve_forever, daemon=True)
    thread.start()
    try:
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("OFFLOAD_TRACING", "OTEL_"))}
        env = {
            **clean,
            "OFFLOAD_TRACING": "1",
            "OFFLOAD_TRACING_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{receiver.server_port}/v1/traces",
            "OTEL_SERVICE_NAME": "producer-under-test",
        }
        out = subprocess.run(
            [sys.executable, "-c", PRODUCER_SCRIPT, valkey_url], env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        receiver.shutdown()
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip().splitlines()[-1]
    exported = [ExportTraceServiceRequest.FromString(body) for body in _Collector.bodies]  # (flushed at exit)
    found = [
        (resource.resource, span)
        for request in exported
        for resource in request.resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    ]
    assert [span.name for _, span in found] == ["offload.enqueue"], found
    resource, span = found[0]
    attributes = {a.key: a.value.string_value for a in span.attributes}
    assert attributes == {tracing.QUEUE: "q", tracing.JOB_ID: job_id}
    assert {a.key: a.value.string_value for a in resource.attributes}["service.name"] == "producer-under-test"
