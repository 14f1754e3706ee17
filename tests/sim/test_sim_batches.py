"""The simulator's provider batch APIs, driven by the official `openai` and `anthropic` SDKs: if the SDKs accept
what the simulator answers (upload, create, poll, output and error files, results JSONL, cancel, list, errors),
the simulator speaks the wire format they were built for. Faults are set through `POST /_sim/config` (the
`batches` block), as a user of `offload sim serve` sets them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, cast

import anthropic
import openai
import pytest
from anthropic.types.messages.batch_create_params import Request
from support.eventually import eventually_sync

from bench import web
from offload.testing.sim import SimConfig, running_sim

KEY = "sim-key"


@pytest.fixture(scope="module")
def sim_base() -> Iterator[str]:
    with running_sim(SimConfig(seed=5, api_key=KEY)) as base:
        yield base


@pytest.fixture
def sim(sim_base: str) -> str:
    """A clean simulator with fast batches; a test changes `batches` through the control API."""
    config = {"seed": 5, "api_key": KEY, "batches": {"seconds": 0.4}}
    web.post(f"{sim_base}/_sim/config", json=config).raise_for_status()
    web.post(f"{sim_base}/_sim/reset").raise_for_status()
    return sim_base


def configure(base: str, **batches: Any) -> None:
    web.post(f"{base}/_sim/config?merge=true", json={"batches": batches}).raise_for_status()


def submissions(base: str) -> dict[str, int]:
    counts: dict[str, int] = web.get(f"{base}/_sim/stats").json()["submissions_by_input_id"]
    return counts


# OpenAI's Batch API ------------------------------------------------------------------------------------------


def oai(base: str) -> openai.OpenAI:
    return openai.OpenAI(api_key=KEY, base_url=f"{base}/v1", max_retries=0)


def chat_line(custom_id: str, body: dict[str, Any] | None = None, **over: Any) -> dict[str, Any]:
    line: dict[str, Any] = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions"}
    line["body"] = (
        body if body is not None else {"model": "sim-model", "messages": [{"role": "user", "content": custom_id}]}
    )
    return {**line, **over}


def upload(client: openai.OpenAI, lines: list[dict[str, Any]]) -> str:
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("batch.jsonl", data), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(data) and uploaded.status == "processed"
    return uploaded.id


def run_batch(client: openai.OpenAI, lines: list[dict[str, Any]]) -> openai.types.Batch:
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status in ("validating", "in_progress", "failed") and batch.output_file_id is None
    return batch


def wait_status(client: openai.OpenAI, batch_id: str, *status: str) -> openai.types.Batch:
    def ended() -> openai.types.Batch | None:
        got = client.batches.retrieve(batch_id)
        return got if got.status in status else None

    found: openai.types.Batch = eventually_sync(ended, 20, f"batch {batch_id} {status}")
    return found


def jsonl(client: openai.OpenAI, file_id: str | None) -> dict[str, dict[str, Any]]:
    """A result file's lines by custom_id (empty for no file)."""
    if file_id is None:
        return {}
    rows = [json.loads(line) for line in client.files.content(file_id).text.splitlines()]
    return {row["custom_id"]: row for row in rows}


def test_openai_batch_completes_with_an_output_file(sim: str) -> None:
    client = oai(sim)
    batch = run_batch(client, [chat_line(f"job-{i}") for i in range(3)])
    done = wait_status(client, batch.id, "completed")
    assert done.request_counts is not None and done.request_counts.model_dump() == {
        "completed": 3,
        "failed": 0,
        "total": 3,
    }
    assert done.completed_at is not None and done.in_progress_at is not None and done.error_file_id is None
    output = jsonl(client, done.output_file_id)
    assert sorted(output) == ["job-0", "job-1", "job-2"]
    response = output["job-1"]["response"]
    assert response["status_code"] == 200 and output["job-1"]["error"] is None
    completion = openai.types.chat.ChatCompletion.model_validate(response["body"])
    content = json.loads(completion.choices[0].message.content or "")
    assert content["echo"]["messages"] == [{"role": "user", "content": "job-1"}]
    assert client.files.retrieve(done.output_file_id or "").purpose == "batch_output"
    assert batch.id in [b.id for b in client.batches.list(limit=1)]  # the SDK pages through the cursor
    assert submissions(sim) == {"job-0": 1, "job-1": 1, "job-2": 1}


def test_openai_partial_failure_fills_the_error_file(sim: str) -> None:
    configure(sim, fail_rate=0.5)
    client = oai(sim)
    lines = [chat_line(f"job-{i}") for i in range(8)] + [chat_line("bad", {"messages": []})]
    done = wait_status(client, run_batch(client, lines).id, "completed")
    output, errors = jsonl(client, done.output_file_id), jsonl(client, done.error_file_id)
    assert set(output) | set(errors) == {line["custom_id"] for line in lines} and not set(output) & set(errors)
    assert output and len(errors) > 1, "seed 5 fails some lines, not all"
    assert errors["bad"]["response"]["status_code"] == 400
    assert errors["bad"]["response"]["body"]["error"]["param"] == "model"
    failed = [row["response"] for cid, row in errors.items() if cid != "bad"]
    assert all(r["status_code"] == 500 and r["body"]["error"]["type"] == "server_error" for r in failed)
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (len(output), len(errors))


def test_openai_batch_expires_with_its_unfinished_lines(sim: str) -> None:
    configure(sim, seconds=2.0, expire_after=1.2)  # lines finish at 0.5, 1, 1.5, 2 s: two expire
    client = oai(sim)
    done = wait_status(client, run_batch(client, [chat_line(f"job-{i}") for i in range(4)]).id, "expired")
    assert done.expired_at is not None and done.completed_at is None
    assert sorted(jsonl(client, done.output_file_id)) == ["job-0", "job-1"]
    errors = jsonl(client, done.error_file_id)
    assert sorted(errors) == ["job-2", "job-3"]
    assert all(row["error"]["code"] == "batch_expired" and row["response"] is None for row in errors.values())


def test_openai_batch_cancelled_mid_way(sim: str) -> None:
    configure(sim, seconds=4.0, cancel_seconds=0.3)  # lines finish at 2 and 4 s
    client = oai(sim)
    batch = run_batch(client, [chat_line("first"), chat_line("second")])

    def one_done() -> bool:
        counts = client.batches.retrieve(batch.id).request_counts
        return counts is not None and counts.completed == 1

    eventually_sync(one_done, 10, "the first line done")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    done = wait_status(client, batch.id, "cancelled")
    assert done.cancelled_at is not None
    assert list(jsonl(client, done.output_file_id)) == ["first"]
    assert jsonl(client, done.error_file_id)["second"]["error"]["code"] == "batch_cancelled"
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)  # an ended batch cannot be cancelled again
    job = web.get(f"{sim}/_sim/jobs", params={"tag": "second"}).json()["jobs"][0]
    assert job["status"] == "cancelled"


def test_openai_batch_cancelled_by_the_provider(sim: str) -> None:
    configure(sim, seconds=2.0, cancel_after=1.2)  # lines finish at 0.5, 1, 1.5, 2 s; the provider cancels at 1.2
    client = oai(sim)
    batch = run_batch(client, [chat_line(f"job-{i}") for i in range(4)])
    assert batch.status == "in_progress" and batch.cancelling_at is None
    done = wait_status(client, batch.id, "cancelled")
    assert done.cancelling_at is not None and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 2)
    assert sorted(jsonl(client, done.output_file_id)) == ["job-0", "job-1"]
    errors = jsonl(client, done.error_file_id)
    assert sorted(errors) == ["job-2", "job-3"]
    assert {row["error"]["code"] for row in errors.values()} == {"batch_cancelled"}


def test_openai_limits_and_validation(sim: str) -> None:
    configure(sim, openai_max_requests=2, openai_max_file_bytes=600)
    client = oai(sim)
    too_many = run_batch(client, [chat_line(f"job-{i}") for i in range(3)])
    failed = wait_status(client, too_many.id, "failed")
    assert failed.errors is not None and [e.code for e in failed.errors.data or []] == ["too_many_requests"]
    assert failed.failed_at is not None and failed.output_file_id is None
    with pytest.raises(openai.BadRequestError) as too_big:
        upload(client, [chat_line(f"job-{i}") for i in range(6)])
    assert too_big.value.status_code == 400 and too_big.value.param == "file"
    odd = run_batch(client, [chat_line("a"), chat_line("a"), chat_line("c", url="/v1/embeddings")])
    failed = wait_status(client, odd.id, "failed")
    assert failed.errors is not None
    assert [(e.code, e.line) for e in failed.errors.data or []] == [
        ("duplicate_custom_id", 2),
        ("mismatched_endpoint", 3),
    ]
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_missing")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(api_key="wrong", base_url=f"{sim}/v1", max_retries=0).batches.list()
    assert submissions(sim) == {}, "a batch that fails validation runs none of its lines"


# Anthropic's Message Batches ---------------------------------------------------------------------------------


def claude(base: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key=KEY, base_url=base, max_retries=0)


def request(custom_id: str, **params: Any) -> Request:
    body = {"model": "sim-claude", "max_tokens": 64, "messages": [{"role": "user", "content": custom_id}], **params}
    return cast(Request, {"custom_id": custom_id, "params": body})


def wait_ended(client: anthropic.Anthropic, batch_id: str) -> anthropic.types.messages.MessageBatch:
    def ended() -> anthropic.types.messages.MessageBatch | None:
        got = client.messages.batches.retrieve(batch_id)
        return got if got.processing_status == "ended" else None

    found: anthropic.types.messages.MessageBatch = eventually_sync(ended, 20, f"batch {batch_id} ended")
    return found


def results(client: anthropic.Anthropic, batch_id: str) -> dict[str, Any]:
    return {row.custom_id: row.result for row in client.messages.batches.results(batch_id)}


def test_anthropic_batch_ends_with_results(sim: str) -> None:
    client = claude(sim)
    batch = client.messages.batches.create(requests=[request(f"job-{i}") for i in range(3)])
    assert batch.processing_status == "in_progress" and batch.results_url is None
    assert batch.request_counts.processing == 3 and batch.request_counts.succeeded == 0
    done = wait_ended(client, batch.id)
    assert done.ended_at is not None and done.results_url is not None
    assert done.request_counts.model_dump() == {
        "processing": 0,
        "succeeded": 3,
        "errored": 0,
        "canceled": 0,
        "expired": 0,
    }
    out = results(client, batch.id)
    assert sorted(out) == ["job-0", "job-1", "job-2"]
    result = out["job-2"]
    assert result.type == "succeeded" and result.message.stop_reason == "end_turn"
    echo = json.loads(result.message.content[0].text)["echo"]
    assert echo["messages"] == [{"role": "user", "content": "job-2"}]
    listed = [b.id for b in client.messages.batches.list(limit=1)]  # the SDK pages with after_id
    assert listed == [batch.id]
    assert submissions(sim) == {"job-0": 1, "job-1": 1, "job-2": 1}


def test_anthropic_partial_failure_errors_its_lines_only(sim: str) -> None:
    configure(sim, fail_rate=0.5)
    client = claude(sim)
    asks = [request(f"job-{i}") for i in range(8)] + [request("bad", max_tokens=0)]
    done = wait_ended(client, client.messages.batches.create(requests=asks).id)
    out = results(client, done.id)
    kinds = {cid: r.type for cid, r in out.items()}
    assert set(kinds) == {a["custom_id"] for a in asks}
    assert kinds["bad"] == "errored" and out["bad"].error.error.type == "invalid_request_error"
    assert 1 < list(kinds.values()).count("errored") < len(asks), "seed 5 fails some lines, not all"
    counts = done.request_counts
    assert (counts.succeeded, counts.errored) == (
        list(kinds.values()).count("succeeded"),
        list(kinds.values()).count("errored"),
    )


def test_anthropic_expiry_and_cancel(sim: str) -> None:
    configure(sim, seconds=2.0, expire_after=1.2)
    client = claude(sim)
    expiring = client.messages.batches.create(requests=[request(f"job-{i}") for i in range(4)])
    done = wait_ended(client, expiring.id)
    assert {cid: r.type for cid, r in results(client, done.id).items()} == {
        "job-0": "succeeded",
        "job-1": "succeeded",
        "job-2": "expired",
        "job-3": "expired",
    }
    assert done.request_counts.expired == 2
    configure(sim, seconds=4.0, expire_after=86_400, cancel_seconds=0.3)
    batch = client.messages.batches.create(requests=[request("first"), request("second")])
    eventually_sync(
        lambda: web.get(f"{sim}/_sim/jobs", params={"tag": "first", "status": "succeeded"}).json()["count"],
        10,
        "the first line done",
    )
    canceling = client.messages.batches.cancel(batch.id)
    assert canceling.processing_status == "canceling" and canceling.cancel_initiated_at is not None
    done = wait_ended(client, batch.id)
    assert {cid: r.type for cid, r in results(client, done.id).items()} == {"first": "succeeded", "second": "canceled"}
    assert done.request_counts.canceled == 1


def test_anthropic_batch_cancelled_by_the_provider(sim: str) -> None:
    configure(sim, seconds=2.0, cancel_after=1.2)
    client = claude(sim)
    batch = client.messages.batches.create(requests=[request(f"job-{i}") for i in range(4)])
    assert batch.processing_status == "in_progress" and batch.cancel_initiated_at is None
    done = wait_ended(client, batch.id)
    assert done.cancel_initiated_at is not None and done.request_counts.canceled == 2
    assert {cid: r.type for cid, r in results(client, done.id).items()} == {
        "job-0": "succeeded",
        "job-1": "succeeded",
        "job-2": "canceled",
        "job-3": "canceled",
    }


def test_anthropic_limits_and_headers(sim: str) -> None:
    configure(sim, anthropic_max_requests=2, anthropic_max_bytes=1000)
    client = claude(sim)
    with pytest.raises(anthropic.BadRequestError) as too_many:
        client.messages.batches.create(requests=[request(f"job-{i}") for i in range(3)])
    assert too_many.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.APIStatusError) as too_big:
        client.messages.batches.create(requests=[request("big", system="x" * 2000)])
    assert too_big.value.status_code == 413
    assert too_big.value.body["error"]["type"] == "request_too_large"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve("msgbatch_missing")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(api_key="wrong", base_url=sim, max_retries=0).messages.batches.list()
    url = f"{sim}/v1/messages/batches"
    bare = web.get(url, headers={"x-api-key": KEY})
    assert bare.status_code == 400 and bare.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "anthropic-version: header is required"},
    }
    for headers in ({"x-api-key": KEY}, {"authorization": f"Bearer {KEY}"}):  # the documented one, SDK 2.x's
        assert web.get(url, headers={**headers, "anthropic-version": "2023-06-01"}).status_code == 200
    anonymous = web.get(url, headers={"anthropic-version": "2023-06-01"})
    assert anonymous.status_code == 401 and anonymous.json()["error"]["type"] == "authentication_error"
    assert submissions(sim) == {}
