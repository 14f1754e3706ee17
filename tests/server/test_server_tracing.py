"""The HTTP API's enqueue routes with tracing on (offload/tracing.py): a real server (uvicorn in a thread of this
process, so its spans reach this process's in-memory exporter) and real Valkey."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from support.server_helpers import client, new_queue, server
from support.servers import ValkeyServer
from support.tracing import no_secret, spans, traced

from offload import tracing
from offload.connection import connect
from offload.queue import keyspace

PRODUCER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PRODUCER_SPAN = "00f067aa0ba902b7"
MARKER = "INPUT-SECRET-a83e1d"


@pytest.fixture
def api(valkey: ValkeyServer) -> Iterator[tuple[str, str]]:
    with traced(), server(valkey.url, settings={"tracing": {"enabled": True}}) as srv:
        yield srv


def _traceparent(url: str, job_id: str) -> str | None:
    async def read() -> str | None:
        redis = await connect(url)
        try:
            return await redis.hget(keyspace.job(job_id.split(":")[0], job_id), tracing.RECORD_FIELD)
        finally:
            await redis.aclose()

    return asyncio.run(read())


def test_an_enqueue_joins_the_trace_its_request_carries(api: tuple[str, str], valkey: ValkeyServer) -> None:
    q = new_queue("traced")
    header = {"traceparent": f"00-{PRODUCER_TRACE}-{PRODUCER_SPAN}-01"}
    with client(*api) as admin:
        one = admin.post(f"/v1/queues/{q}/jobs", json={"input": {"note": MARKER}}, headers=header)
        batch = admin.post(f"/v1/queues/{q}/jobs/batch", json={"jobs": [{"input": {"i": i}} for i in range(3)]})
    assert one.status_code == 201 and batch.status_code == 201, (one.text, batch.text)
    job_id, batch_ids = one.json()["id"], batch.json()["ids"]
    value = _traceparent(valkey.url, job_id)
    assert value is not None and value.split("-")[1] == PRODUCER_TRACE  # the producer's trace
    enqueues = {str(s.attributes[tracing.JOB_ID]): s for s in spans("offload.enqueue") if s.attributes}
    assert set(enqueues) == {job_id, *batch_ids}
    first = enqueues[job_id]  # under the request's span if the server made one, else the producer's directly
    assert first.context is not None and f"{first.context.trace_id:032x}" == PRODUCER_TRACE
    assert first.parent is not None
    # a batch: one trace per job, each the record's (linked to the request's span, when there is one)
    traces = set()
    for other in batch_ids:
        span, stored = enqueues[other], _traceparent(valkey.url, other)
        assert span.parent is None and span.context is not None and stored is not None
        assert stored.split("-")[1:3] == [f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}"]
        traces.add(span.context.trace_id)
    assert len(traces) == len(batch_ids)
    no_secret(spans(), MARKER, api[1])


@pytest.mark.parametrize(
    "hostile",
    [
        "not-a-traceparent",
        "00-" + "0" * 32 + "-" + "0" * 16 + "-01",
        f"00-{PRODUCER_TRACE}-{PRODUCER_SPAN}-01" + "x" * 8000,
        f"zz-{PRODUCER_TRACE}-{PRODUCER_SPAN}-01",
    ],
)
def test_a_malformed_traceparent_header_starts_a_fresh_trace(
    api: tuple[str, str], valkey: ValkeyServer, hostile: str
) -> None:
    q = new_queue("hostile")
    with client(*api) as admin:
        r = admin.post(f"/v1/queues/{q}/jobs", json={"input": {}}, headers={"traceparent": hostile})
    assert r.status_code == 201, r.text
    (enqueue,) = spans("offload.enqueue")
    assert enqueue.context is not None and enqueue.context.trace_id != int(PRODUCER_TRACE, 16)
    value = _traceparent(valkey.url, r.json()["id"])
    assert value is not None and value.split("-")[1] == f"{enqueue.context.trace_id:032x}"
