"""Every backend over real HTTP against the simulator (no mocks): success, remote failure, outages, resets, 429s
with and without Retry-After, garbage bodies, cancel, expiry and bad credentials; then tagging/find, fal's
resumable remote ids, OpenAI cost, the registry's config errors and the shared error mapping.

One simulator per module, reset and reconfigured over HTTP for each test. Jobs take tens of milliseconds and
waiting is a short poll loop with a deadline, never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest
from support.eventually import eventually
from support.servers import closed_port

from bench import web
from offload.backends import (
    Backend,
    BackendError,
    Fatal,
    NotFound,
    RemoteResult,
    Throttled,
    TooLarge,
    Transient,
    create_backend,
    new_client,
)
from offload.backends.fal import FalBackend
from offload.backends.http import error_for_exception, error_for_response, retry_after, warn_unknown_status
from offload.backends.runpod import error_text
from offload.errors import ConfigError
from offload.redact import excerpt
from offload.testing.sim import running_sim

KEY = "sim-key-0123456789abcdef"
KINDS = ["http-job", "runpod", "replicate", "fal", "openai"]
ASYNC_KINDS = [k for k in KINDS if k != "openai"]
FAMILY = {"http-job": "jobs", "runpod": "runpod", "replicate": "replicate", "fal": "fal", "openai": "openai"}
INPUT = {"prompt": "a haiku about queues", "messages": [{"role": "user", "content": "hi"}], "job_id": "j1"}
FAST = {"latency": 0.05, "queue_delay": 0.0}

Make = Callable[..., Backend]


_control: list[httpx.Client] = []  # one client for the /_sim routes: building a client per call is slow


@pytest.fixture(scope="module")
def sim_url() -> Iterator[str]:
    with running_sim() as base, web.client(base_url=str(base), timeout=10) as control:
        _control.append(control)
        yield str(base)
        _control.clear()


def control() -> httpx.Client:
    return _control[0]


@pytest.fixture
def sim(sim_url: str) -> Callable[..., None]:
    """Reset the simulator and give it `FAST` plus the given default behaviour (and `api_key` = KEY)."""

    def configure(**default: Any) -> None:
        assert control().post("/_sim/reset").status_code == 200
        body = {"seed": 3, "api_key": KEY, "default": {**FAST, **default}}
        answer = control().post("/_sim/config", json=body)
        assert answer.status_code == 200, answer.text

    configure()
    return configure


def settings_for(kind: str, base: str) -> dict[str, Any]:
    extra: dict[str, dict[str, Any]] = {
        "http-job": {},
        "runpod": {"endpoint_id": "ep-1"},
        "replicate": {"version": "5c7d5dc6dd8bf75c"},
        "fal": {"app": "fal-ai/flux/dev"},
        "openai": {"model": "gpt-sim", "base_url": f"{base}/v1"},
    }
    return {"base_url": base, "api_key": KEY, "timeout": 5, **extra[kind]}


@pytest.fixture
async def make(sim_url: str, sim: Callable[..., None]) -> AsyncIterator[Make]:
    made: list[Backend] = []

    def build(kind: str, **overrides: Any) -> Backend:
        backend = create_backend(f"test-{kind}", {"kind": kind, **settings_for(kind, sim_url), **overrides})
        made.append(backend)
        return backend

    yield build
    for backend in made:
        await backend.aclose()


def outage(base: str, family: str, mode: str = "503") -> None:
    assert control().post("/_sim/outage", json={"family": family, "mode": mode}).status_code == 200


def stats(base: str) -> dict[str, Any]:
    body: dict[str, Any] = control().get("/_sim/stats").json()
    return body


async def settle(backend: Backend, remote_id: str, timeout: float = 5.0) -> RemoteResult:
    deadline = time.monotonic() + timeout
    while True:
        result = await backend.poll(remote_id)
        if result.terminal or time.monotonic() > deadline:
            return result
        await asyncio.sleep(0.02)


async def run(backend: Backend, job_input: Any = INPUT, tag: str = "job-1") -> RemoteResult:
    submission = await backend.submit(job_input, tag=tag)
    assert submission.remote_id
    return submission.result or await settle(backend, submission.remote_id)


def echo(kind: str, result: RemoteResult) -> Any:
    if kind == "openai":
        return orjson.loads(result.output["choices"][0]["message"]["content"])["echo"]
    return result.output["echo"]


# --- the same behaviour from every backend ------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_success_echoes_input(kind: str, make: Make) -> None:
    result = await run(make(kind))
    assert result.status == "succeeded"
    expected = {**INPUT, "model": "gpt-sim"} if kind == "openai" else INPUT
    assert echo(kind, result) == expected
    if kind in ("runpod", "replicate", "fal"):
        assert result.duration_s is not None and 0 <= result.duration_s < 1


@pytest.mark.parametrize("kind", KINDS)
async def test_remote_failure(kind: str, make: Make, sim: Callable[..., None]) -> None:
    sim(fail_rate=1.0, error_message="CUDA out of memory (simulated)")
    backend = make(kind)
    if kind == "openai":  # OpenAI reports a failed generation as HTTP 500: worth another try
        with pytest.raises(Transient) as info:
            await backend.submit(INPUT, tag="job-1")
        assert info.value.status == 500
        return
    result = await run(backend)
    assert result.status == "failed"
    assert result.error is not None and "CUDA out of memory" in result.error


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["503", "reset"])
async def test_outage_is_transient(kind: str, mode: str, make: Make, sim_url: str) -> None:
    backend = make(kind)
    remote_id = None if kind == "openai" else (await backend.submit(INPUT, tag="job-1")).remote_id
    outage(sim_url, FAMILY[kind], mode)
    with pytest.raises(Transient) as info:
        await backend.submit(INPUT, tag="job-2")
    assert info.value.status == (503 if mode == "503" else None)
    if remote_id is not None:
        with pytest.raises(Transient):
            await backend.poll(remote_id)


@pytest.mark.parametrize("kind", KINDS)
async def test_429_with_retry_after(kind: str, make: Make, sim: Callable[..., None]) -> None:
    sim(rate_429=1.0, retry_after_seconds=2)
    with pytest.raises(Throttled) as info:
        await make(kind).submit(INPUT, tag="job-1")
    assert info.value.retry_after == 2
    assert info.value.status == 429


@pytest.mark.parametrize("kind", KINDS)
async def test_429_without_retry_after(kind: str, make: Make, sim: Callable[..., None]) -> None:
    sim(rate_429=1.0, retry_after_seconds=2, retry_after_header=False)
    with pytest.raises(Throttled) as info:
        await make(kind).submit(INPUT, tag="job-1")
    # Replicate says it in the body instead: "Request was throttled. Expected available in 2 seconds."
    assert info.value.retry_after == (2 if kind == "replicate" else None)


async def test_429_retry_after_http_date(make: Make, sim: Callable[..., None]) -> None:
    sim(rate_429=1.0, retry_after_seconds=3, retry_after_format="http-date")
    with pytest.raises(Throttled) as info:
        await make("http-job").submit(INPUT, tag="job-1")
    assert info.value.retry_after is not None and 1 <= info.value.retry_after <= 3


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("garbage", ["invalid_json", "missing_fields"])
async def test_malformed_submit_answer_is_transient(
    kind: str, garbage: str, make: Make, sim: Callable[..., None]
) -> None:
    sim(malformed_rate=1.0, malformed_kind=garbage, faults_on=["submit"])
    backend = make(kind)
    if kind == "runpod" and garbage == "missing_fields":  # the sim drops `status`; the id is all we need
        assert (await backend.submit(INPUT, tag="job-1")).remote_id
        return
    with pytest.raises(Transient) as info:
        await backend.submit(INPUT, tag="job-1")
    assert "JSON" in str(info.value) or "lacks" in str(info.value)


@pytest.mark.parametrize("kind", ASYNC_KINDS)
@pytest.mark.parametrize("garbage", ["invalid_json", "missing_fields"])
async def test_malformed_status_answer_is_transient(
    kind: str, garbage: str, make: Make, sim: Callable[..., None]
) -> None:
    sim(malformed_rate=1.0, malformed_kind=garbage, faults_on=["status"])
    backend = make(kind)
    submission = await backend.submit(INPUT, tag="job-1")
    with pytest.raises(Transient):
        await backend.poll(submission.remote_id)


@pytest.mark.parametrize("kind", ASYNC_KINDS)
async def test_cancel_running_job(kind: str, make: Make, sim: Callable[..., None], sim_url: str) -> None:
    sim(latency=30)
    backend = make(kind)
    remote_id = (await backend.submit(INPUT, tag="job-1")).remote_id
    assert (await backend.poll(remote_id)).status in ("queued", "running")
    await backend.cancel(remote_id)
    assert (await settle(backend, remote_id)).status == "cancelled"
    await backend.cancel(remote_id)  # idempotent: an ended job is not an error
    assert stats(sim_url)["cancels"] == {FAMILY[kind]: 1}


async def test_openai_is_synchronous(make: Make) -> None:
    backend = make("openai")
    submission = await backend.submit(INPUT, tag="job-1")
    assert submission.result is not None and submission.remote_id.startswith("chatcmpl-")
    await backend.cancel(submission.remote_id)  # nothing to stop
    with pytest.raises(NotFound):  # a crashed worker must submit again
        await backend.poll(submission.remote_id)


@pytest.mark.parametrize("kind", ASYNC_KINDS)
async def test_expired_result_is_not_found(kind: str, make: Make, sim: Callable[..., None]) -> None:
    sim(result_ttl=0.05)
    backend = make(kind)
    remote_id = (await backend.submit(INPUT, tag="job-1")).remote_id

    async def gone() -> bool:
        try:
            await backend.poll(remote_id)
        except NotFound:
            return True
        return False

    await eventually(gone)
    await backend.cancel(remote_id)  # a vanished job leaves nothing to cancel


@pytest.mark.parametrize("kind", ["runpod", "replicate"])
async def test_the_queue_delay_the_provider_reports_is_read(kind: str, make: Make, sim: Callable[..., None]) -> None:
    """RunPod's `delayTime`, Replicate's `started_at` - `created_at`: how long the job waited before it started
    (a routed queue's expected finish, worker/job_limits.py); the others report none."""
    sim(queue_delay=0.4, latency=0.1)
    result = await run(make(kind))
    assert result.status == "succeeded"
    assert result.queue_s is not None and 0.35 <= result.queue_s <= 0.6, result.queue_s
    assert (await run(make("http-job"))).queue_s is None


async def test_replicate_data_removed_is_not_found(make: Make, sim: Callable[..., None]) -> None:
    sim(result_ttl=0.05, expiry_mode="data_removed")
    backend = make("replicate")
    remote_id = (await backend.submit(INPUT, tag="job-1")).remote_id

    async def removed() -> bool:
        try:
            await backend.poll(remote_id)
        except NotFound as exc:
            return "data_removed" in str(exc)
        return False

    await eventually(removed)


@pytest.mark.parametrize("kind", KINDS)
async def test_wrong_key_is_fatal_and_never_shown(kind: str, make: Make) -> None:
    wrong = "wrong-key-9f8e7d6c5b4a"
    with pytest.raises(Fatal) as info:
        await make(kind, api_key=wrong).submit(INPUT, tag="job-1")
    assert info.value.status == 401
    for text in (str(info.value), info.value.excerpt, repr(info.value)):
        assert wrong not in text and KEY not in text


# --- tagging, find and resumable ids ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["runpod", "replicate", "fal"])
async def test_webhook_carries_the_tag(kind: str, make: Make, sim_url: str) -> None:
    backend = make(kind, webhook_url="https://hooks.example.com/offload?src=sim")
    remote_id = (await backend.submit(INPUT, tag="job-77")).remote_id
    found = control().get("/_sim/jobs", params={"tag": "offload_tag=job-77"}).json()
    assert found["count"] == 1
    assert found["jobs"][0]["id"] in remote_id
    assert await backend.find("job-77") is None  # no listing API (replicate: no tag_input_key)


async def test_replicate_find_by_input_tag(make: Make) -> None:
    backend = make("replicate", tag_input_key="offload_job")
    ids = [(await backend.submit({"n": i}, tag=f"job-{i}")).remote_id for i in range(3)]
    assert await backend.find("job-1") == ids[1]
    assert await backend.find("job-unknown") is None
    assert echo("replicate", await settle(backend, ids[0])) == {"n": 0, "offload_job": "job-0"}


async def test_replicate_find_adopts_an_orphan_whose_answer_was_lost(make: Make, sim: Callable[..., None]) -> None:
    sim(lost_response_rate=1.0)  # the prediction is created, then the connection drops before the answer
    backend = make("replicate", tag_input_key="offload_job")
    with pytest.raises(Transient):
        await backend.submit({"n": 1}, tag="job-orphan")
    sim_jobs = control().get("/_sim/jobs", params={"family": "replicate"}).json()["jobs"]
    assert await backend.find("job-orphan") == sim_jobs[0]["id"]


async def test_timeout_is_transient(make: Make, sim: Callable[..., None]) -> None:
    sim(latency=3)
    with pytest.raises(Transient, match="timed out"):
        await make("openai", timeout=0.2).submit(INPUT, tag="job-1")


async def test_each_failure_says_whether_the_provider_may_have_accepted_the_request(
    make: Make, sim: Callable[..., None], sim_url: str
) -> None:
    """Over real HTTP: a gateway's 5xx page after the provider created the job, a timeout after sending, a reset
    connection and a garbled 2xx may all have been accepted (`maybe_accepted`); the provider's own 4xx/500 and a
    connection never made (refused) were not."""

    async def failure(backend: Backend) -> BackendError:
        with pytest.raises(BackendError) as info:
            await backend.submit(INPUT, tag="job-1")
        return info.value

    for status in (502, 504, 524):
        sim(gateway_error_rate=1.0, gateway_statuses=[status])
        err = await failure(make("http-job"))
        assert isinstance(err, Transient) and err.status == status and err.maybe_accepted, err
    sim(submit_latency=2.0)
    assert (await failure(make("http-job", timeout=0.3))).maybe_accepted
    sim(lost_response_rate=1.0)
    assert (await failure(make("http-job"))).maybe_accepted
    sim(malformed_rate=1.0, malformed_kind="invalid_json", faults_on=["submit"])
    assert (await failure(make("http-job"))).maybe_accepted
    sim(error_rate=1.0, error_statuses=[500])
    assert not (await failure(make("http-job"))).maybe_accepted
    sim()
    assert not (await failure(make("http-job", api_key="wrong-key-0123"))).maybe_accepted  # 401
    nowhere = make("http-job", base_url=f"http://127.0.0.1:{closed_port()}")
    refused = await failure(nowhere)
    assert isinstance(refused, Transient) and not refused.maybe_accepted, refused


def test_the_mapping_of_unknown_outcomes() -> None:
    """The one rule, by status and by transport error: only what a gateway answers for a provider that was slow
    or cut off (502, 503, 504, 520-527) and errors once the request was on its way may have been accepted."""
    request = httpx.Request("POST", "http://h/jobs")
    for status in (502, 503, 504, 520, 522, 524, 527):
        assert error_for_response(response(status), what="w").maybe_accepted, status
    for status in (400, 401, 404, 408, 409, 422, 429, 500, 501, 505, 519, 528):
        assert not error_for_response(response(status), what="w").maybe_accepted, status
    for sent in (httpx.ReadTimeout, httpx.WriteTimeout, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
        assert error_for_exception(sent("x", request=request), what="w").maybe_accepted, sent
    for unsent in (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout):
        assert not error_for_exception(unsent("x", request=request), what="w").maybe_accepted, unsent


@pytest.mark.parametrize("road", ["aiohttp", "httpx"])
async def test_an_answer_over_max_response_bytes_is_not_read_past_it(
    road: str, sim: Callable[..., None], sim_url: str
) -> None:
    """A 2 MiB output against a 1 MiB limit raises TooLarge naming the limit and the setting, on the worker's
    aiohttp road and on httpx's own (a client not made by `new_client`); an answer within the limit reads whole."""
    sim(output_bytes=2 * 2**20)
    settings = {"kind": "http-job", **settings_for("http-job", sim_url), "max_response_bytes": 2**20}
    async with web.async_client() as plain:
        backend = create_backend("big", settings, client=plain if road == "httpx" else None)
        try:
            remote_id = (await backend.submit(INPUT, tag="job-1")).remote_id
            with pytest.raises(TooLarge, match=r"max_response_bytes \(1048576 bytes, backends\.big\.max_resp"):
                await settle(backend, remote_id)
            sim(output_bytes=2**19)
            remote_id = (await backend.submit(INPUT, tag="job-2")).remote_id
            result = await settle(backend, remote_id)
            assert result.status == "succeeded" and len(result.output["padding"]) == 2**19
        finally:
            await backend.aclose()


@contextlib.asynccontextmanager
async def answering(body: bytes, **headers: str) -> AsyncIterator[str]:
    """A plain HTTP server (asyncio streams) that answers every request 200 with `body` and `headers`, as a
    provider (or a proxy) misbehaving in ways the simulator does not: compressing unasked."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        extra = "".join(f"{k.replace('_', '-')}: {v}\r\n" for k, v in headers.items())
        head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n{extra}"
        writer.write(f"{head}connection: close\r\n\r\n".encode() + body)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("road", ["aiohttp", "httpx"])
async def test_a_compressed_answer_is_bounded_once_decompressed_too(road: str) -> None:
    """An answer compressed although the request asked for none: 64 MiB of JSON in ~64 KiB of gzip is refused
    at the 1 MiB limit without being inflated whole; a small gzip answer decodes as usual; an encoding offload
    cannot bound (br) is an unreadable answer (Transient)."""
    big = b'{"status": "succeeded", "output": "' + b"0" * 64 * 2**20 + b'"}'
    small = orjson.dumps({"status": "succeeded", "output": {"ok": 1}})
    async with web.async_client() as plain:
        client = plain if road == "httpx" else None
        settings = {"kind": "http-job", "api_key": KEY, "max_response_bytes": 2**20}
        async with answering(gzip.compress(big), content_encoding="gzip") as url:
            backend = create_backend("bomb", {**settings, "base_url": url}, client=client)
            with pytest.raises(TooLarge, match="max_response_bytes"):
                await backend.poll("job-1")
            await backend.aclose()
        async with answering(gzip.compress(small), content_encoding="gzip") as url:
            backend = create_backend("gz", {**settings, "base_url": url}, client=client)
            assert (await backend.poll("job-1")).output == {"ok": 1}
            await backend.aclose()
        async with answering(b"\x0b\x02\x80{}\x03", content_encoding="br") as url:
            backend = create_backend("br", {**settings, "base_url": url}, client=client)
            with pytest.raises(Transient, match="Content-Encoding 'br'"):
                await backend.poll("job-1")
            await backend.aclose()


async def test_replicate_model_and_deployment_routes(make: Make, sim_url: str) -> None:
    assert (await run(make("replicate", version=None, model="acme/sdxl"))).status == "succeeded"
    assert (await run(make("replicate", version=None, deployment="acme/prod"))).status == "succeeded"
    requests = stats(sim_url)["requests"]
    assert requests["replicate.create_model"] == 1 and requests["replicate.create_deployment"] == 1


async def test_fal_remote_id_resumes_in_another_process(make: Make, sim_url: str) -> None:
    first = make("fal")
    remote_id = (await first.submit(INPUT, tag="job-1")).remote_id
    assert remote_id.startswith("fal-ai/flux/requests/")  # fal drops the subpath `dev`; we follow its URLs
    await first.aclose()
    other = make("fal")  # a different worker: new backend, new client, only the checkpointed id
    result = await settle(other, remote_id)
    assert result.status == "succeeded" and echo("fal", result) == INPUT
    assert "/fal-ai/flux/dev/requests" not in str(stats(sim_url)["requests"])


async def test_fal_unusual_urls_are_kept_verbatim_and_foreign_hosts_refused(make: Make, sim_url: str) -> None:
    backend = make("fal")
    assert isinstance(backend, FalBackend)
    rid = (await backend.submit(INPUT, tag="job-1")).remote_id
    urls = backend.decode_id(rid)
    odd = {**urls, "status_url": urls["status_url"] + "?logs=0"}
    encoded = backend.encode(odd)
    assert encoded.startswith("{") and backend.decode_id(encoded) == odd
    assert (await settle(backend, encoded)).status == "succeeded"
    foreign = orjson.dumps({**odd, "status_url": "https://evil.example.com/x/status"}).decode()
    with pytest.raises(Fatal, match="refusing"):
        await backend.poll(foreign)


# --- OpenAI specifics ---------------------------------------------------------------------------------------


async def test_openai_cost_from_usage_and_default_model(make: Make) -> None:
    backend = make("openai", price_per_million_input_tokens=2.5, price_per_million_output_tokens=10)
    result = await run(backend, {"messages": [{"role": "user", "content": "x" * 400}], "model": "gpt-own"})
    usage = result.output["usage"]
    assert result.cost == pytest.approx((usage["prompt_tokens"] * 2.5 + usage["completion_tokens"] * 10) / 1e6)
    assert result.output["model"] == "gpt-own"  # the input's model wins over the default
    assert (await run(make("openai"))).cost is None  # no prices, no cost


async def test_bad_input_is_fatal_before_any_request(make: Make, sim_url: str) -> None:
    for kind in ("openai", "replicate"):
        with pytest.raises(Fatal, match="JSON object"):
            await make(kind).submit(["not", "an", "object"], tag="job-1")
    with pytest.raises(Fatal):  # the sim's 400 for a missing body
        await make("http-job").submit(None, tag="job-1")
    with pytest.raises(Fatal, match="serialisable"):
        await make("runpod").submit({"n": 2**70}, tag="job-1")
    assert stats(sim_url)["submissions"] == 0


# --- many jobs through one pool -----------------------------------------------------------------------------


async def test_shared_client_many_concurrent_jobs(sim_url: str, sim: Callable[..., None]) -> None:
    client = new_client(max_connections=32, timeout=5)
    backends = [create_backend(f"b-{k}", {"kind": k, **settings_for(k, sim_url)}, client) for k in KINDS]
    try:
        jobs = [run(b, {**INPUT, "job_id": f"{b.name}-{i}"}) for i in range(20) for b in backends]
        results = await asyncio.gather(*jobs)
        assert all(r.status == "succeeded" for r in results)
    finally:
        for backend in backends:
            await backend.aclose()  # does not close the shared client
        assert not client.is_closed
        await client.aclose()
    assert stats(sim_url)["duplicate_input_ids"] == []


# --- registry and config errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "settings", "message"),
    [
        ("runpod", {}, "backends.x.endpoint_id: Field required"),
        ("runpod", {"endpoint_id": "e", "endpiont": 1}, "backends.x.endpiont: unknown setting"),
        ("http-job", {}, "backends.x.base_url: Field required"),
        ("http-job", {"base_url": "localhost:8000"}, "backends.x.base_url: must be an http"),
        ("fal", {"app": "a/b", "timeout": 0}, "backends.x.timeout: Input should be greater than 0"),
        ("fal", {"app": "a/b", "api_key": ""}, "backends.x.api_key: must be a non-empty string"),
        ("fal", {}, "backends.x.app: Field required"),
        ("replicate", {}, "backends.x: set exactly one of version, model, deployment"),
        ("replicate", {"version": "v", "model": "a/b"}, "exactly one of version, model, deployment"),
        ("replicate", {"model": "sdxl"}, "backends.x: model must look like owner/name"),
        ("openai", {"max_connections": 0}, "backends.x.max_connections: Input should be greater than or equal to 1"),
        ("runpod", {"endpoint_id": "e", "webhook_url": "ftp://x"}, "backends.x.webhook_url: must be an http"),
        ("runpod", {"endpoint_id": "e", "policy": "ttl"}, "backends.x.policy: Input should be a valid dictionary"),
        ("http-job", {"base_url": "http://h", "cancel": "maybe"}, "backends.x.cancel: Input should be a valid boolean"),
        (
            "vast",
            {},
            "backends.x.kind: must be one of 'http-job', 'openai', 'runpod', 'replicate', 'fal', 'openai-batch', "
            "'anthropic-batch', got 'vast'",
        ),
    ],
)
def test_config_errors_name_the_field(kind: str, settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        create_backend("x", {"kind": kind, **settings})


def test_defaults_point_at_the_providers() -> None:
    backend = create_backend("x", {"endpoint_id": "e", "kind": "runpod"})
    assert backend.name == "x" and "api.runpod.ai/v2" in repr(backend)


# --- the shared error mapping -------------------------------------------------------------------------------


def test_excerpts_are_short_and_redacted() -> None:
    key = "r8_SuperSecretKey12345"
    body = (
        '{"detail": "bad token ' + key + '", "authorization": "Bearer abc123def456ghi", '
        '"note": "sk-proj-abcdefgh12345678"}' + " filler" * 100
    )
    text = excerpt(body, [key])
    assert len(text) <= 300
    for secret in (key, "abc123def456ghi", "sk-proj-abcdefgh12345678"):
        assert secret not in text
    assert "[REDACTED]" in text


def response(status: int, body: str = "{}", **headers: str) -> httpx.Response:
    return httpx.Response(status, text=body, headers=headers, request=httpx.Request("GET", "http://h/x"))


def test_error_mapping_table() -> None:
    m = error_for_response
    assert isinstance(m(response(408), what="w"), Transient)
    assert isinstance(m(response(409), what="w"), Transient)
    assert isinstance(m(response(502), what="w"), Transient)
    assert isinstance(m(response(404), what="w", known=True), NotFound)
    assert isinstance(m(response(404), what="w"), Fatal)
    assert isinstance(m(response(422), what="w"), Fatal)
    assert isinstance(m(response(301, location="https://x"), what="w"), Fatal)
    assert retry_after(response(429, **{"retry-after-ms": "1500"})) == 1.5
    assert retry_after(response(429, **{"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"})) == 0.0
    assert retry_after(response(429, '{"detail": "Expected available in 7 seconds."}')) == 7.0


def test_runpod_error_json_string() -> None:
    raw = orjson.dumps(
        {
            "error_type": "ValueError",
            "error_message": "width must be divisible by 64",
            "error_traceback": "Traceback ...",
        }
    ).decode()
    assert error_text(raw) == "ValueError: width must be divisible by 64"
    assert error_text("plain message") == "plain message"


def test_unknown_status_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="offload.backends"):
        warn_unknown_status("test-kind", "WARMING_UP")
        warn_unknown_status("test-kind", "WARMING_UP")
    assert len([r for r in caplog.records if "WARMING_UP" in r.getMessage()]) == 1
