"""The provider simulator over real HTTP (httpx against `running_sim`): every route family's happy path, then each
fault it can inject, the control routes, config loading and the CLI. Latencies are a few hundred ms at most."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from pydantic import ValidationError
from support.procs import die_with_parent
from typer.testing import CliRunner

from bench import web
from offload.cli.sim import build_config, sim_app
from offload.testing.sim import SimConfig, running_sim
from offload.testing.sim.store import Job, JobStore, input_key

T = TypeVar("T")
FAST = {"latency": 0.2, "queue_delay": 0.1}
AUTH = {"Authorization": "Bearer sim-key"}
FAL = {"Authorization": "Key sim-key"}
PNG = b"\x89PNG\r\n\x1a\n"


def make_config(families: dict[str, Any] | None = None, **default: Any) -> SimConfig:
    return SimConfig.model_validate({"seed": 7, "default": {**FAST, **default}, "families": families or {}})


_shared: list[Any] = []  # one server per test module (per xdist worker), reconfigured for each test


@pytest.fixture(scope="module", autouse=True)
def _shared_sim() -> Iterator[None]:
    with running_sim() as base:
        _shared.append(base)
        yield
        _shared.clear()


@contextmanager
def sim(config: SimConfig | None = None, **default: Any) -> Iterator[httpx.Client]:
    """A simulator in the given state: the shared server, reset and given the config over HTTP (as a test
    suite elsewhere would do it), or a dedicated server when the config fixes something at start (fal_prefix)."""
    config = config or make_config(**default)
    with contextlib.ExitStack() as stack:
        if config.fal_prefix:
            base = stack.enter_context(running_sim(config))
        else:
            base = _shared[0]
            assert web.post(f"{base}/_sim/reset").status_code == 200
            body = config.model_dump(mode="json", exclude_unset=True)
            assert web.post(f"{base}/_sim/config", json=body).status_code == 200
        yield stack.enter_context(web.client(base_url=base, headers=AUTH, timeout=10))


def until(fetch: Callable[[], T], done: Callable[[T], bool], timeout: float = 5.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = fetch()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.02)


def stats(client: httpx.Client) -> dict[str, Any]:
    body: dict[str, Any] = client.get("/_sim/stats").json()
    return body


# --- tutorial job API -------------------------------------------------------------------------------------------


def test_jobs_happy_path_echoes_input_and_serves_files() -> None:
    with sim() as c:
        r = c.post("/jobs", json={"id": "job-1", "prompt": "a haiku"})
        assert r.status_code == 200
        job_id = r.json()["id"]
        assert r.json()["status"] == "queued"
        assert c.get(f"/jobs/{job_id}").json()["status"] == "queued"
        seen = until(lambda: c.get(f"/jobs/{job_id}").json(), lambda b: b["status"] != "queued")
        assert seen["status"] in ("running", "succeeded")
        done = until(lambda: c.get(f"/jobs/{job_id}").json(), lambda b: b["status"] == "succeeded")
        assert done["output"]["echo"] == {"id": "job-1", "prompt": "a haiku"}
        [url] = done["output"]["files"]
        assert url.startswith(str(c.base_url))
        f = web.get(url)
        assert f.status_code == 200 and f.headers["content-type"] == "image/png" and f.content.startswith(PNG)
        s = stats(c)
        assert s["submissions_by_input_id"] == {"job-1": 1}
        assert s["requests"]["jobs.submit"] == 1 and s["requests"]["jobs.status"] >= 3


def test_jobs_auth_unknown_and_bad_body() -> None:
    with sim(SimConfig.model_validate({"api_key": "right", "default": FAST})) as c:
        assert c.post("/jobs", json={"x": 1}).status_code == 401  # wrong key
        assert c.post("/jobs", json={"x": 1}, headers={"Authorization": ""}).status_code == 401
        assert c.post("/v2/e/run", json={"input": {}}, headers={"Authorization": "right"}).status_code == 200
        assert c.post("/v2/e/run", json={"input": {}}, headers={"Authorization": "Bearer"}).status_code == 401
        ok = {"Authorization": "Bearer right"}
        assert c.get("/jobs/nope", headers=ok).status_code == 404
        assert c.post("/jobs", content=b"{not json", headers=ok).status_code == 400
        assert c.post("/jobs", headers=ok).status_code == 400
        assert stats(c)["submissions_by_family"] == {"runpod": 1}


def test_jobs_cancel_running_job() -> None:
    with sim(latency=5) as c:
        job_id = c.post("/jobs", json={"id": "c-1"}).json()["id"]
        until(lambda: c.get(f"/jobs/{job_id}").json(), lambda b: b["status"] == "running")
        r = c.post(f"/jobs/{job_id}/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelled"
        assert c.get(f"/jobs/{job_id}").json()["status"] == "cancelled"
        assert c.post(f"/jobs/{job_id}/cancel").json()["status"] == "cancelled"  # idempotent
        assert stats(c)["cancels"] == {"jobs": 1}


# --- RunPod ----------------------------------------------------------------------------------------------------


def test_runpod_lifecycle_bare_key_and_health() -> None:
    with sim() as c:
        bare = {"Authorization": "sim-key"}
        r = c.post("/v2/ep1/run", json={"input": {"id": "rp-1"}, "webhook": "https://hook/?tag=abc"}, headers=bare)
        assert r.status_code == 200 and r.json()["status"] == "IN_QUEUE"
        job_id = r.json()["id"]
        assert c.get(f"/v2/ep1/status/{job_id}").json() == {"id": job_id, "status": "IN_QUEUE"}
        running = until(lambda: c.get(f"/v2/ep1/status/{job_id}").json(), lambda b: b["status"] != "IN_QUEUE")
        if running["status"] == "IN_PROGRESS":
            assert running["delayTime"] == 100 and "workerId" in running and "output" not in running
        done = until(lambda: c.get(f"/v2/ep1/status/{job_id}").json(), lambda b: b["status"] == "COMPLETED")
        assert done["executionTime"] == 200 and done["delayTime"] == 100
        assert done["output"]["echo"] == {"id": "rp-1"}
        assert c.get(f"/v2/other-endpoint/status/{job_id}").status_code == 404
        health = c.get("/v2/ep1/health").json()
        assert health["jobs"]["completed"] == 1 and health["jobs"]["inQueue"] == 0
        assert c.post("/v2/ep1/run", json={"no_input": 1}).status_code == 400


def test_runpod_runsync_execution_timeout_and_ttl() -> None:
    with sim() as c:
        r = c.post("/v2/ep/runsync", json={"input": {"id": "s-1"}})
        assert r.json()["status"] == "COMPLETED" and r.json()["id"].startswith("sync-")
        timed = c.post("/v2/ep/run", json={"input": {"id": "t"}, "policy": {"executionTimeout": 50}}).json()["id"]
        gone = c.post("/v2/ep/run", json={"input": {"id": "g"}, "policy": {"ttl": 200}}).json()["id"]
        body = until(lambda: c.get(f"/v2/ep/status/{timed}").json(), lambda b: b["status"] == "TIMED_OUT")
        assert body["status"] == "TIMED_OUT" and body["executionTime"] == 50
        until(lambda: c.get(f"/v2/ep/status/{gone}").status_code, lambda code: code == 404)
        assert c.get(f"/v2/ep/status/{gone}").status_code == 404  # removed by ttl although still running
        assert c.post("/v2/ep/run", json={"input": {}, "policy": {"ttl": -1}}).status_code == 400
    with sim(latency=3) as c:
        r = c.post("/v2/ep/runsync?wait=1000", json={"input": {"id": "slow"}})
        assert r.json()["status"] in ("IN_QUEUE", "IN_PROGRESS")  # not final: the SDK goes on polling /status


def test_runpod_cancel_retry_and_purge() -> None:
    with sim(latency=5, families={"runpod": {"queue_delay": 0.0}}) as c:
        job_id = c.post("/v2/ep/run", json={"input": {"id": "k"}}).json()["id"]
        r = c.post(f"/v2/ep/cancel/{job_id}")
        assert r.json() == {"id": job_id, "status": "CANCELLED"}
        assert c.get(f"/v2/ep/status/{job_id}").json()["status"] == "CANCELLED"
        assert c.post(f"/v2/ep/retry/{job_id}").status_code == 400
    with sim(fail_rate=1.0) as c:
        job_id = c.post("/v2/ep/run", json={"input": {"id": "f"}}).json()["id"]
        failed = until(lambda: c.get(f"/v2/ep/status/{job_id}").json(), lambda b: b["status"] == "FAILED")
        assert failed["error"] == "Simulated failure"
        assert c.post(f"/v2/ep/retry/{job_id}").json() == {"id": job_id, "status": "IN_QUEUE"}
        assert stats(c)["submissions_by_input_id"] == {"f": 2}  # a retry is a second GPU run
    with sim(queue_delay=10) as c:
        for i in range(3):
            c.post("/v2/ep/run", json={"input": {"i": i}})
        assert c.post("/v2/ep/purge-queue").json() == {"removed": 3, "status": "completed"}
        assert c.get("/v2/ep/health").json()["jobs"]["inQueue"] == 0


# --- Replicate -------------------------------------------------------------------------------------------------


def test_replicate_lifecycle_and_shapes() -> None:
    with sim() as c:
        r = c.post(
            "/v1/predictions",
            json={"version": "owner/model:" + "a" * 64, "input": {"id": "rep-1"}, "webhook": "https://hook/x?tag=rep"},
        )
        assert r.status_code == 201
        p = r.json()
        assert p["status"] == "starting" and p["model"] == "owner/model" and p["version"] == "a" * 64
        assert p["urls"]["get"] == f"{c.base_url}/v1/predictions/{p['id']}" and p["urls"]["cancel"].endswith("/cancel")
        assert p["output"] is None and p["data_removed"] is False and p["webhook"] == "https://hook/x?tag=rep"
        assert r.headers["location"] == p["urls"]["get"]
        done = until(lambda: c.get(p["urls"]["get"]).json(), lambda b: b["status"] == "succeeded")
        assert done["output"]["echo"] == {"id": "rep-1"}
        assert done["metrics"]["predict_time"] == pytest.approx(0.2) and "completed_at" in done
        assert done["started_at"] and done["created_at"].endswith("Z")
        m = c.post("/v1/models/acme/llm/predictions", json={"input": {"id": "rep-2"}}, headers={"Prefer": "wait=5"})
        assert m.status_code == 201 and m.json()["status"] == "succeeded" and m.json()["version"] == "hidden"
        listed = c.get("/v1/predictions").json()
        assert [x["id"] for x in listed["results"]] == [m.json()["id"], p["id"]] and listed["next"] is None


def test_replicate_errors_are_problem_json() -> None:
    with sim(rate_429=1.0, faults_on=["status"]) as c:
        r = c.post("/v1/predictions", json={"input": {"x": 1}})
        assert r.status_code == 422 and r.headers["content-type"] == "application/problem+json"
        assert r.json()["invalid_fields"][0]["field"] == "version" and r.json()["status"] == 422
        nf = c.post("/v1/predictions/nope/cancel")
        assert nf.status_code == 404 and nf.json()["title"] == "Not found"
        unauth = c.post("/v1/predictions", json={}, headers={"Authorization": "Key x"})
        assert unauth.status_code == 401 and "detail" in unauth.json()
        throttled = c.get("/v1/predictions/whatever")
        assert throttled.status_code == 429
        assert throttled.json() == {"detail": "Request was throttled. Expected available in 1 second."}
        assert throttled.headers["retry-after"] == "1"


def test_replicate_cancel_and_data_removed_expiry() -> None:
    with sim(latency=5) as c:
        p = c.post("/v1/predictions", json={"version": "v", "input": {"id": "x"}}).json()
        until(lambda: c.get(p["urls"]["get"]).json(), lambda b: b["status"] == "processing")
        cancelled = c.post(p["urls"]["cancel"]).json()
        assert cancelled["status"] == "canceled" and "predict_time" in cancelled["metrics"]
    with sim(result_ttl=0.2, families={"replicate": {"expiry_mode": "data_removed"}}) as c:
        p = c.post("/v1/predictions", json={"version": "v", "input": {"id": "y"}}).json()
        until(lambda: c.get(p["urls"]["get"]).json(), lambda b: b["status"] == "succeeded")
        gone = until(lambda: c.get(p["urls"]["get"]).json(), lambda b: b["data_removed"])
        assert gone["status"] == "succeeded" and gone["output"] is None and gone["input"] == {}


def test_replicate_cancel_after_header_sets_deadline() -> None:
    with sim() as c:
        p = c.post("/v1/predictions", json={"version": "v", "input": {}}, headers={"Cancel-After": "1m30s"}).json()
        assert "deadline" in p
        assert (
            c.post("/v1/predictions", json={"version": "v", "input": {}}, headers={"Cancel-After": "soon"}).status_code
            == 400
        )


def test_job_timeline_aborted_and_cancel() -> None:
    """The timeline logic itself, with explicit times (Replicate's Cancel-After minimum is 5 s)."""
    job = Job(
        id="j",
        family="replicate",
        target="m",
        input={},
        input_key="k",
        created=0.0,
        started=10.0,
        finished=20.0,
        outcome="succeeded",
        stopped=5.0,
        stop_phase="aborted",
        result_ttl=1.0,
    )
    assert [job.phase(t) for t in (1.0, 5.0, 30.0)] == ["queued", "aborted", "aborted"]
    assert job.ran_for(30.0) == 0 and job.expires_at() == 6.0
    other = Job(
        id="o",
        family="jobs",
        target="t",
        input={},
        input_key="k",
        created=0.0,
        started=1.0,
        finished=3.0,
        outcome="failed",
    )
    assert [other.phase(t) for t in (0.5, 2.0, 3.0)] == ["queued", "running", "failed"]
    assert other.cancel(3.5) is False  # already ended: nothing to stop
    assert other.cancel(2.0) is True and other.phase(2.5) == "cancelled" and other.ended_at() == 2.0


# --- fal -------------------------------------------------------------------------------------------------------


def test_fal_queue_lifecycle() -> None:
    with sim() as c:
        r = c.post("/fal-ai/flux/dev?fal_webhook=https://hook/f", json={"id": "fal-1", "prompt": "x"}, headers=FAL)
        assert r.status_code == 200
        sub = r.json()
        rid = sub["request_id"]
        base = f"{c.base_url}/fal-ai/flux/requests/{rid}"  # the subpath `dev` is dropped
        assert (sub["response_url"], sub["status_url"], sub["cancel_url"]) == (base, base + "/status", base + "/cancel")
        assert isinstance(sub["queue_position"], int)
        first = c.get(sub["status_url"], headers=FAL)
        assert first.status_code == 202 and first.json()["status"] == "IN_QUEUE"
        assert "queue_position" in first.json() and "logs" in first.json()
        assert c.get(sub["response_url"], headers=FAL).status_code == 400  # not ready yet
        mid = until(lambda: c.get(sub["status_url"], headers=FAL), lambda x: x.json()["status"] != "IN_QUEUE")
        if mid.json()["status"] == "IN_PROGRESS":
            assert mid.status_code == 202 and {"queue_position", "logs"} <= mid.json().keys()
        done = until(lambda: c.get(sub["status_url"], params={"logs": 1}, headers=FAL), lambda x: x.status_code == 200)
        assert done.json()["status"] == "COMPLETED" and done.json()["metrics"]["inference_time"] == pytest.approx(0.2)
        assert [line["message"] for line in done.json()["logs"]] == ["simulated: processing", "simulated: done"]
        assert "error" not in done.json()
        assert c.get(sub["response_url"], headers=FAL).json()["echo"] == {"id": "fal-1", "prompt": "x"}
        assert c.get(sub["status_url"]).status_code == 401  # Bearer is not fal's scheme
        assert c.get(f"{c.base_url}/fal-ai/other/requests/{rid}/status", headers=FAL).status_code == 404
        jobs = c.get("/_sim/jobs", params={"family": "fal"}).json()["jobs"]
        assert jobs[0]["meta"]["webhook"] == "https://hook/f" and jobs[0]["meta"]["path"] == "dev"


def test_fal_cancel_and_failure() -> None:
    with sim(latency=5) as c:
        sub = c.post("/fal-ai/flux", json={"id": "c"}, headers=FAL).json()
        r = c.put(sub["cancel_url"], headers=FAL)
        assert r.status_code == 202 and r.json() == {"status": "CANCELLATION_REQUESTED"}
        st = c.get(sub["status_url"], headers=FAL)
        assert st.status_code == 200 and st.json()["status"] == "COMPLETED"
        assert st.json()["error_type"] == "request_cancelled"
        assert c.get(sub["response_url"], headers=FAL).status_code == 400
        again = c.put(sub["cancel_url"], headers=FAL)
        assert again.status_code == 400 and again.json() == {"status": "ALREADY_COMPLETED"}
        missing = c.put(f"{c.base_url}/fal-ai/flux/requests/nope/cancel", headers=FAL)
        assert missing.status_code == 404 and missing.json() == {"status": "NOT_FOUND"}
        assert c.post(sub["cancel_url"], headers=FAL).status_code == 405  # cancel is PUT, and a POST never submits
    with sim(fail_rate=1.0) as c:
        sub = c.post("/fal-ai/flux", json={"id": "f"}, headers=FAL).json()
        st = until(lambda: c.get(sub["status_url"], headers=FAL), lambda x: x.status_code == 200)
        assert st.json()["status"] == "COMPLETED" and st.json()["error"] == "Simulated failure"
        res = c.get(sub["response_url"], headers=FAL)
        assert res.status_code == 500 and res.json()["detail"] == "Simulated failure"
        assert res.headers["x-fal-error-type"] == res.json()["error_type"]


def test_fal_prefix_and_namespaces() -> None:
    config = SimConfig.model_validate({"fal_prefix": "fal/", "default": FAST})
    with sim(config) as c:
        sub = c.post("/fal/workflows/me/flow/step", json={"id": "w"}, headers=FAL).json()
        assert sub["status_url"] == f"{c.base_url}/fal/workflows/me/flow/requests/{sub['request_id']}/status"
        until(lambda: c.get(sub["status_url"], headers=FAL), lambda x: x.status_code == 200)
        assert c.get(sub["response_url"], headers=FAL).json()["echo"] == {"id": "w"}
        assert c.post("/me/app", json={}, headers=FAL).status_code in (404, 405)  # nothing outside the prefix
        assert c.post("/_sim/config", json={"default": FAST}).status_code == 400  # the prefix is fixed at start
    with sim() as c:
        assert c.post("/v9/whatever", json={}, headers=FAL).status_code == 200  # unprefixed fal owns the rest
        assert c.post("/onlyone", json={}, headers=FAL).status_code == 404


# --- OpenAI ----------------------------------------------------------------------------------------------------


def test_openai_chat_completion_shape() -> None:
    with sim() as c:
        started = time.monotonic()
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": "gpt-sim",
                "messages": [{"role": "user", "content": "hi"}],
                "metadata": {"job_id": "oai-1"},
                "n": 2,
            },
        )
        assert time.monotonic() - started >= 0.3  # synchronous: queue delay + running time
        body = r.json()
        assert r.status_code == 200 and body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        assert body["model"] == "gpt-sim" and len(body["choices"]) == 2
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["message"]["role"] == "assistant"
        assert json.loads(choice["message"]["content"])["echo"]["metadata"] == {"job_id": "oai-1"}
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
        assert stats(c)["submissions_by_input_id"] == {"oai-1": 1}


def test_openai_errors() -> None:
    with sim() as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400
        assert r.json()["error"] == {
            "message": "you must provide a model parameter",
            "type": "invalid_request_error",
            "param": "model",
            "code": None,
        }
        assert (
            c.post("/v1/chat/completions", json={"model": "m", "messages": []}).json()["error"]["param"] == "messages"
        )
        assert (
            c.post("/v1/chat/completions", json={"model": "m"}, headers={"Authorization": "Key x"}).json()["error"][
                "code"
            ]
            == "invalid_api_key"
        )
    with sim(fail_rate=1.0) as c:
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"


# --- faults ----------------------------------------------------------------------------------------------------


def test_fail_rate_one_fails_every_family() -> None:
    with sim(fail_rate=1.0) as c:
        job = c.post("/jobs", json={"a": 1}).json()["id"]
        rp = c.post("/v2/e/run", json={"input": {}}).json()["id"]
        rep = c.post("/v1/predictions", json={"version": "v", "input": {}}).json()["urls"]["get"]
        assert until(lambda: c.get(f"/jobs/{job}").json(), lambda b: b["status"] == "failed")["error"]
        assert until(lambda: c.get(f"/v2/e/status/{rp}").json(), lambda b: b["status"] == "FAILED")["error"]
        failed = until(lambda: c.get(rep), lambda x: x.json()["status"] == "failed")
        assert failed.status_code == 200 and failed.json()["error"] == "Simulated failure"  # a failed run is 200


@pytest.mark.parametrize("header", [True, False])
def test_429_with_and_without_retry_after(header: bool) -> None:
    with sim(rate_429=1.0, retry_after_header=header, retry_after_seconds=2) as c:
        for path, body, headers in [
            ("/jobs", {"id": 1}, AUTH),
            ("/v2/e/run", {"input": {}}, AUTH),
            ("/v1/predictions", {"version": "v", "input": {}}, AUTH),
            ("/fal-ai/x", {}, FAL),
        ]:
            r = c.post(path, json=body, headers=headers)
            assert r.status_code == 429, path
            assert r.headers.get("retry-after") == ("2" if header else None), path
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user"}]})
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        assert ("retry-after-ms" in r.headers) is header and r.headers["x-ratelimit-remaining-requests"] == "0"
        assert c.post("/v1/predictions", json={}).json()["detail"].endswith("in 2 seconds.")
        s = stats(c)
        assert s["submissions"] == 0  # a throttled submit creates nothing
        assert sum(s["faults"].values()) == 6 and all(k.endswith("429" if header else "429_bare") for k in s["faults"])
    http_date = make_config(rate_429=1.0, retry_after_format="http-date")
    with sim(http_date) as c:
        assert c.get("/jobs/x").headers["retry-after"].endswith("GMT")


def test_malformed_responses() -> None:
    with sim(malformed_rate=1.0, malformed_kind="invalid_json") as c:
        r = c.post("/jobs", json={"id": "m"})
        assert r.status_code == 200
        with pytest.raises(json.JSONDecodeError):
            json.loads(r.content)
        assert stats(c)["submissions_by_input_id"] == {"m": 1}  # accepted, only the answer is garbage
    with sim(malformed_rate=1.0, malformed_kind="missing_fields", faults_on=["status"]) as c:
        job_id = c.post("/v2/e/run", json={"input": {}}).json()["id"]  # submit is not in faults_on
        body = c.get(f"/v2/e/status/{job_id}").json()
        assert "status" not in body and body["id"] == job_id
        assert c.get(f"/v2/e/status/{job_id}x").status_code == 404  # errors are never garbled
    with sim(malformed_rate=1.0, malformed_kind="missing_fields") as c:
        sub = c.post("/fal-ai/x", json={}, headers=FAL).json()
        assert "request_id" not in sub and "status_url" not in sub


def test_outage_window_then_recovery() -> None:
    config = make_config(outages=[{"start": 0, "end": 0.5, "mode": "503"}])
    with sim(config) as c:
        assert c.post("/jobs", json={}).status_code == 503
        assert c.get("/v1/predictions/x").json()["status"] == 503
        fal = c.post("/fal-ai/x", json={}, headers=FAL)
        assert fal.status_code == 503 and "nginx" in fal.text  # what the fal SDK retries as an ingress error
        assert c.get("/_sim/stats").status_code == 200  # control routes never fail
        time.sleep(0.55)
        assert c.post("/jobs", json={}).status_code == 200
        assert stats(c)["faults"]["jobs.submit outage_503"] == 1


def test_outage_reset_and_runtime_toggle() -> None:
    config = make_config(families={"runpod": {"outages": [{"mode": "reset"}]}})
    with sim(config) as c:
        with pytest.raises(httpx.TransportError):
            c.post("/v2/e/run", json={"input": {}})
        assert c.post("/jobs", json={}).status_code == 200  # other families unaffected
        assert c.post("/_sim/outage", json={"family": "jobs", "mode": "503", "seconds": 30}).status_code == 200
        assert c.post("/jobs", json={}).status_code == 503
        c.post("/_sim/outage", json={"family": "jobs", "mode": None})
        assert c.post("/jobs", json={}).status_code == 200
        c.post("/_sim/outage", json={"mode": "reset"})
        with pytest.raises(httpx.TransportError):
            c.get("/jobs/x")
        c.post("/_sim/outage", json={"mode": None})
        assert c.get("/jobs/x").status_code == 404


def test_result_expiry_returns_404_and_files_expire() -> None:
    with sim(result_ttl=0.3) as c:
        job_id = c.post("/jobs", json={"id": "e"}).json()["id"]
        rp = c.post("/v2/e/run", json={"input": {"id": "e2"}}).json()["id"]
        fal = c.post("/fal-ai/x", json={"id": "e3"}, headers=FAL).json()
        done = until(lambda: c.get(f"/jobs/{job_id}").json(), lambda b: b["status"] == "succeeded")
        file_url = done["output"]["files"][0]
        assert web.get(file_url).status_code == 200
        until(lambda: c.get(f"/jobs/{job_id}").status_code, lambda code: code == 404)
        assert c.get(f"/jobs/{job_id}").status_code == 404
        assert until(lambda: c.get(f"/v2/e/status/{rp}").status_code, lambda code: code == 404) == 404
        assert until(lambda: c.get(fal["status_url"], headers=FAL).status_code, lambda code: code == 404) == 404
        assert web.get(file_url).status_code == 404
        s = stats(c)
        assert s["submissions"] == 3 and s["jobs_in_store"] == 0


def test_lost_response_creates_the_job_once_and_it_can_be_found() -> None:
    with sim(families={"runpod": {"lost_response_rate": 1.0}}) as c:
        with pytest.raises(httpx.TransportError):
            c.post("/v2/e/run", json={"input": {"id": "orphan-1"}, "webhook": "https://w/?offload_job=orphan-1"})
        found = c.get("/_sim/jobs", params={"tag": "offload_job=orphan-1"}).json()
        assert found["count"] == 1 and found["jobs"][0]["input_id"] == "orphan-1"
        assert stats(c)["submissions_by_input_id"] == {"orphan-1": 1}
        assert stats(c)["faults"] == {"runpod.run lost_response": 1}


def test_stats_count_submissions_by_input_id() -> None:
    with sim() as c:
        c.post("/jobs", json={"id": "same"})
        c.post("/v2/e/run", json={"input": {"job_id": "same"}})
        c.post("/jobs", json={"prompt": "no id"})
        c.post("/jobs", json={"prompt": "no id"})
        c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user"}], "metadata": {"id": "md"}})
        s = stats(c)
        hashed = input_key({"prompt": "no id"})
        assert hashed.startswith("sha256:")
        assert s["submissions_by_input_id"] == {"same": 2, hashed: 2, "md": 1}
        assert s["duplicate_input_ids"] == sorted(["same", hashed])
        assert s["submissions_by_family"] == {"jobs": 3, "runpod": 1, "openai": 1}


# --- Idempotency-Key and the submission log ---------------------------------------------------------------------

SUBMITS: list[tuple[str, str, dict[str, Any], dict[str, str], Callable[[Any], str]]] = [
    ("jobs", "/jobs", {"id": "k-jobs"}, AUTH, lambda b: b["id"]),
    ("runpod", "/v2/e/run", {"input": {"id": "k-runpod"}}, AUTH, lambda b: b["id"]),
    ("replicate", "/v1/predictions", {"version": "v", "input": {"id": "k-replicate"}}, AUTH, lambda b: b["id"]),
    ("fal", "/fal-ai/x", {"id": "k-fal"}, FAL, lambda b: b["request_id"]),
    (
        "openai",
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user"}], "metadata": {"id": "k-openai"}},
        AUTH,
        lambda b: b["id"],
    ),
]


def submissions(client: httpx.Client, **params: Any) -> dict[str, Any]:
    body: dict[str, Any] = client.get("/_sim/submissions", params=params).json()
    return body


def test_idempotency_key_replays_the_first_answer_on_every_submit_route() -> None:
    with sim(latency=0.05) as c:
        for family, path, body, headers, remote_id in SUBMITS:
            key = {"Idempotency-Key": f"job-{family}.1"}
            first = c.post(path, json=body, headers={**headers, **key})
            again = c.post(path, json=body, headers={**headers, **key})
            assert first.status_code == again.status_code and first.status_code in (200, 201), family
            assert remote_id(again.json()) == remote_id(first.json()), family
            other = c.post(path, json=body, headers={**headers, "Idempotency-Key": f"job-{family}.2"})
            assert remote_id(other.json()) != remote_id(first.json()), family  # a new submission number: new run
            changed = {**body, "extra": 1}
            mismatch = c.post(path, json=changed, headers={**headers, **key})
            assert mismatch.status_code == 422, family
        s = stats(c)
        assert s["submissions_by_input_id"] == {f"k-{f}": 2 for f, *_ in SUBMITS}  # .1 once, .2 once
        assert s["idempotent_replays"] == {f: 1 for f, *_ in SUBMITS}
        log = submissions(c)["submissions"]
        assert [e["replay"] for e in log] == [False, True, False] * len(SUBMITS)
        assert [e["family"] for e in log[::3]] == [f for f, *_ in SUBMITS]
        for first, replay in zip(log[::3], log[1::3], strict=True):
            assert replay["remote_id"] == first["remote_id"] and replay["idempotency_key"] == first["idempotency_key"]


def test_idempotency_key_is_logged_but_ignored_when_not_honoured() -> None:
    with sim(SimConfig.model_validate({"seed": 7, "honour_idempotency_key": False, "default": FAST})) as c:
        ids = [
            c.post("/jobs", json={"id": "twice"}, headers={"Idempotency-Key": "job-1.1"}).json()["id"] for _ in range(2)
        ]
        assert ids[0] != ids[1]
        assert stats(c)["submissions_by_input_id"] == {"twice": 2} and stats(c)["idempotent_replays"] == {}
        log = submissions(c)["submissions"]
        assert [(e["idempotency_key"], e["replay"]) for e in log] == [("job-1.1", False)] * 2


def test_idempotency_key_survives_a_lost_answer_and_conflicts_while_in_flight() -> None:
    with sim(lost_response_rate=1.0) as c:
        with pytest.raises(httpx.TransportError):
            c.post("/jobs", json={"id": "lost"}, headers={"Idempotency-Key": "lost.1"})
        c.post("/_sim/config?merge=true", json={"default": {"lost_response_rate": 0}})
        retried = c.post("/jobs", json={"id": "lost"}, headers={"Idempotency-Key": "lost.1"})
        assert retried.status_code == 200
        log = submissions(c)["submissions"]
        assert [(e["lost_response"], e["replay"], e["status"]) for e in log] == [(True, False, 599), (False, True, 200)]
        assert retried.json()["id"] == log[0]["remote_id"]  # the provider recorded it: the retry gets that job
        assert stats(c)["submissions_by_input_id"] == {"lost": 1}
    with sim(submit_latency=0.6) as c, web.client(base_url=c.base_url, headers=AUTH, timeout=10) as other:
        import threading

        answers: list[httpx.Response] = []
        slow = threading.Thread(
            target=lambda: answers.append(
                other.post("/jobs", json={"id": "slow"}, headers={"Idempotency-Key": "slow.1"})
            )
        )
        slow.start()
        until(lambda: submissions(c)["total"], lambda n: n == 1)
        busy = c.post("/jobs", json={"id": "slow"}, headers={"Idempotency-Key": "slow.1"})
        slow.join()
        assert busy.status_code == 409 and answers[0].status_code == 200
        entry = submissions(c)["submissions"][0]
        assert entry["responded"] - entry["arrival"] >= 0.55  # a slow submit: the job exists, the answer waits
        assert stats(c)["faults"] == {"jobs.submit idempotency_conflict": 1}


def test_a_throttled_or_failed_submit_does_not_use_up_its_key() -> None:
    with sim(rate_429=1.0) as c:
        assert c.post("/jobs", json={"id": "t"}, headers={"Idempotency-Key": "t.1"}).status_code == 429
        c.post("/_sim/config?merge=true", json={"default": {"rate_429": 0, "error_rate": 1.0}})
        failed = c.post("/jobs", json={"id": "t"}, headers={"Idempotency-Key": "t.1"})
        assert failed.status_code in (500, 502, 503) and failed.json()["error"] == "Simulated server error"
        c.post("/_sim/config?merge=true", json={"default": {"error_rate": 0}})
        assert c.post("/jobs", json={"id": "t"}, headers={"Idempotency-Key": "t.1"}).status_code == 200
        assert stats(c)["submissions_by_input_id"] == {"t": 1} and submissions(c)["total"] == 1


def test_submission_log_names_the_worker_port_and_times_and_pages() -> None:
    agent = {"User-Agent": "offload/0.1.0 worker/host-a:1:9f3c"}
    with sim() as c:
        before = time.time()
        for i in range(5):
            c.post("/jobs", json={"id": f"log-{i}"}, headers=agent if i % 2 == 0 else {"User-Agent": "curl/8"})
        page = submissions(c, limit=2)
        assert page["total"] == 5 and page["next"] == 2 and [e["seq"] for e in page["submissions"]] == [1, 2]
        rest = submissions(c, after=page["next"], limit=10)
        assert rest["next"] is None and [e["input_id"] for e in rest["submissions"]] == ["log-2", "log-3", "log-4"]
        first = page["submissions"][0]
        assert first["worker"] == "host-a:1:9f3c" and page["submissions"][1]["worker"] is None
        assert first["port"] == httpx.URL(str(c.base_url)).port
        assert before <= first["arrival"] <= first["responded"] <= time.time()
        assert first["remote_status"] in ("queued", "running") and first["remote_expires_at"] > first["arrival"]
        assert c.get("/_sim/submissions", params={"after": -1}).status_code == 400


def test_error_rate_and_a_429_storm() -> None:
    with sim(error_rate=1.0, error_statuses=[502]) as c:
        assert c.post("/jobs", json={}).status_code == 502
        assert c.get("/jobs/x").status_code == 502
        assert stats(c)["submissions"] == 0 and stats(c)["faults"] == {"jobs.submit 502": 1, "jobs.status 502": 1}
    with pytest.raises(ValidationError):
        make_config(error_statuses=[404])
    with sim(retry_after_seconds=3) as c:
        assert c.post("/_sim/outage", json={"mode": "429", "seconds": 30}).status_code == 200
        storm = c.post("/v2/e/run", json={"input": {}})
        assert storm.status_code == 429 and storm.headers["retry-after"] == "3"
        assert c.get("/jobs/x").status_code == 429
        c.post("/_sim/outage", json={"mode": None})
        assert c.post("/jobs", json={}).status_code == 200
        assert stats(c)["faults"] == {"runpod.run storm_429": 1, "jobs.status storm_429": 1}


# --- control routes, files, config ------------------------------------------------------------------------------


def test_control_config_jobs_and_reset() -> None:
    with sim() as c:
        shown = c.get("/_sim/config").json()
        assert shown["effective"]["fal"]["latency"] == {
            "kind": "fixed",
            "seconds": 0.2,
            "min": 0.0,
            "max": None,
            "median": 1.0,
            "sigma": 0.5,
        }
        bad = c.post("/_sim/config", json={"default": {"fail_rate": 3}})
        assert bad.status_code == 422 and bad.json()["details"][0]["loc"] == ["default", "fail_rate"]
        assert c.post("/_sim/config", json={"default": {"latnecy": 1}}).status_code == 422
        merged = c.post("/_sim/config?merge=true", json={"default": {"fail_rate": 0.25}}).json()["effective"]
        assert merged["jobs"]["fail_rate"] == 0.25 and merged["jobs"]["latency"]["seconds"] == 0.2  # kept
        assert (
            c.post(
                "/_sim/config", json={"default": {"latency": 10}, "families": {"jobs": {"latency": 0.1}}}
            ).status_code
            == 200
        )
        fast = c.post("/jobs", json={"id": "fast"}).json()["id"]
        slow = c.post("/v2/e/run", json={"input": {"id": "slow"}}).json()["id"]
        until(lambda: c.get(f"/jobs/{fast}").json(), lambda b: b["status"] == "succeeded")
        listed = c.get("/_sim/jobs", params={"status": "succeeded"}).json()
        assert [j["id"] for j in listed["jobs"]] == [fast]
        assert c.get("/_sim/jobs", params={"family": "runpod"}).json()["jobs"][0]["id"] == slow
        assert c.get(f"/_sim/jobs/{slow}").json()["status"] in ("queued", "running")
        assert c.post("/_sim/reset").json() == {"ok": True}
        assert stats(c)["submissions"] == 0 and c.get(f"/jobs/{fast}").status_code == 404


def test_unmatched_paths_are_counted() -> None:
    with sim() as c:
        r = c.get("/v3/nothing/here")
        assert r.status_code in (404, 405) and r.json()["path"] == "/v3/nothing/here"
        assert stats(c)["requests"]["unmatched"] == 1


def test_a_known_path_with_a_wrong_method_is_405_and_routes_keep_their_order() -> None:
    """Requests that fully match a route skip Starlette's router (app.SimApp._route); a known path with a wrong
    method still gets Starlette's 405 with the simulator's JSON body, and a path two routes could take goes to
    the first one in the documented order (a pod, not a RunPod endpoint named `pods`)."""
    with sim() as c:
        r = c.delete("/v1/predictions")
        assert r.status_code == 405 and r.json() == {
            "error": "method not allowed",
            "path": "/v1/predictions",
            "method": "DELETE",
        }
        assert stats(c)["requests"]["unmatched"] == 1
        pod = c.get("/v2/pods/nope")
        assert pod.status_code == 404 and pod.json()["title"] == "pod not found"  # machines' answer, not RunPod's
        assert stats(c)["requests"]["unmatched"] == 1


@pytest.mark.parametrize(
    ("kind", "content_type"),
    [
        ("png", "image/png"),
        ("txt", "text/plain; charset=utf-8"),
        ("json", "application/json"),
        ("bin", "application/octet-stream"),
    ],
)
def test_output_files_have_content_types(kind: str, content_type: str) -> None:
    with sim(file_type=kind, files_per_job=2, file_size=3000, latency=0) as c:
        job_id = c.post("/jobs", json={}).json()["id"]
        out = until(lambda: c.get(f"/jobs/{job_id}").json(), lambda b: b["status"] == "succeeded")["output"]
        assert len(out["files"]) == 2
        first, second = (web.get(u) for u in out["files"])
        assert first.headers["content-type"] == content_type and first.content != second.content
        assert first.content == web.get(out["files"][0]).content  # deterministic: a copy can be verified
        if kind == "bin":
            assert len(first.content) == 3000
        assert c.get(f"/_sim/files/{job_id}-0.exe").status_code == 404
        assert c.get("/_sim/files/unknown-0.png").status_code == 404


def test_a_new_config_restarts_the_random_sequence_but_never_reuses_an_id() -> None:
    """Found by the chaos harness: a config change mid-run (healing the faults) reseeded the generator, the next
    jobs got the ids of the first ones, and an old remote id then named a new job (a foreign result)."""
    with sim() as c:
        first = [c.post("/jobs", json={"id": f"a{i}"}).json()["id"] for i in range(3)]
        c.post("/_sim/config?merge=true", json={"default": {"fail_rate": 0}})
        again = [c.post("/jobs", json={"id": f"b{i}"}).json()["id"] for i in range(3)]
        assert not set(first) & set(again)
        assert c.get(f"/_sim/jobs/{first[0]}").json()["input_id"] == "a0"


def test_seed_makes_runs_reproducible() -> None:
    def run() -> list[Any]:
        with sim(make_config(fail_rate=0.5, latency=0)) as c:
            ids = [c.post("/jobs", json={"i": i}).json()["id"] for i in range(8)]
            time.sleep(0.15)
            return [(i, c.get(f"/jobs/{i}").json()["status"]) for i in ids]

    first = run()
    assert first == run() and {s for _, s in first} == {"succeeded", "failed"}


def test_config_files_shorthands_and_family_overrides(tmp_path: Path) -> None:
    yml = tmp_path / "sim.yaml"
    yml.write_text(
        "seed: 3\ndefault:\n  latency: 1-3\n  fail_rate: 0.1\nfamilies:\n  fal:\n    latency: "
        "lognormal:2:0.5:10\n    rate_429: 0.2\n"
    )
    config = SimConfig.load(yml)
    assert config.behaviour("jobs").latency.kind == "uniform" and config.behaviour("jobs").latency.max == 3
    fal = config.behaviour("fal")
    assert fal.latency.kind == "lognormal" and fal.latency.max == 10 and fal.rate_429 == 0.2
    assert fal.fail_rate == 0.1  # not overridden: inherited from default
    js = tmp_path / "sim.json"
    js.write_text(json.dumps({"default": {"latency": {"kind": "fixed", "seconds": 4}}}))
    assert SimConfig.load(js).behaviour("openai").latency.seconds == 4
    with pytest.raises(ValidationError):
        SimConfig.model_validate({"default": {"latency": "soon"}})
    with pytest.raises(ValidationError):
        SimConfig.model_validate({"families": {"vast": {}}})
    flagged = build_config(yml, seed=9, latency="2", fail_rate=0.5, rate_429=0.05, retry_after_header=False)
    assert flagged.seed == 9 and flagged.default.latency.seconds == 2 and flagged.default.fail_rate == 0.5
    assert not flagged.default.retry_after_header and flagged.behaviour("fal").rate_429 == 0.2


def test_cli_help_and_bad_config(tmp_path: Path) -> None:
    runner = CliRunner()
    assert "serve" in runner.invoke(sim_app, ["--help"]).output
    assert "--rate-429" in runner.invoke(sim_app, ["serve", "--help"]).output
    bad = tmp_path / "bad.yaml"
    bad.write_text("default:\n  fail_rate: 2\n")
    result = runner.invoke(sim_app, ["serve", "--config", str(bad)])
    assert result.exit_code == 1 and "default.fail_rate" in result.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_cli_serve_runs_a_real_server() -> None:
    port = _free_port()
    other = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "offload.testing.sim",
            "serve",
            "--port",
            str(port),
            "--latency",
            "0",
            "--fail-rate",
            "1",
            "--log-level",
            "warning",
            "--also-port",
            str(other),
            "--ignore-idempotency-key",
        ],
        env={**os.environ},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=die_with_parent,
    )
    try:
        base = f"http://127.0.0.1:{port}"

        def health() -> int:
            try:
                return web.get(f"{base}/_sim/health").status_code
            except httpx.TransportError:
                return 0

        assert until(health, lambda code: code == 200, timeout=15) == 200
        job_id = web.post(f"{base}/jobs", json={}, headers=AUTH).json()["id"]
        body = until(lambda: web.get(f"{base}/jobs/{job_id}", headers=AUTH).json(), lambda b: b["status"] == "failed")
        assert body["status"] == "failed"
        twice = {**AUTH, "Idempotency-Key": "k.1"}
        web.post(f"http://127.0.0.1:{other}/jobs", json={"id": "p"}, headers=twice).raise_for_status()
        web.post(f"{base}/jobs", json={"id": "p"}, headers=twice).raise_for_status()
        log = web.get(f"http://127.0.0.1:{other}/_sim/submissions").json()["submissions"]
        assert [(e["port"], e["replay"]) for e in log[1:]] == [(other, False), (port, False)]  # key not honoured
    finally:
        proc.terminate()
        proc.wait(timeout=15)


# --- scale -----------------------------------------------------------------------------------------------------


def test_ten_thousand_jobs_in_flight_cost_no_tasks() -> None:
    """Status is computed from timestamps: 10k jobs in flight are 10k small objects, a poll a dict lookup."""
    store = JobStore()
    now = time.time()
    for i in range(10_000):
        store.add(
            Job(
                id=f"j{i}",
                family="runpod",
                target="e",
                input={"i": i},
                input_key=str(i),
                created=now,
                started=now + (i % 7),
                finished=now + 60 + (i % 13),
                outcome="succeeded",
                result_ttl=30,
            )
        )
    started = time.perf_counter()
    phases = [job.phase(now + 3) for job in (store.get(f"j{i}", now + 3) for i in range(10_000)) if job]
    assert time.perf_counter() - started < 1.0
    assert len(phases) == 10_000 and set(phases) == {"queued", "running"}
    assert store.purge(now + 200) == 10_000 and len(store) == 0
    with sim(latency=60) as c:
        live = _shared[0].app.sim  # the server is idle between requests: fill its store directly
        for i in range(10_000):
            live.new_job(
                "runpod",
                "e",
                {"i": i},
                live.behaviour("runpod"),
                time.time(),
                job_id=f"bulk-{i}",
                meta=None,
                run_timeout=None,
                hard_ttl=None,
            )
        started = time.perf_counter()
        for i in range(0, 10_000, 50):
            assert c.get(f"/v2/e/status/bulk-{i}").json()["status"] in ("IN_QUEUE", "IN_PROGRESS")
        assert time.perf_counter() - started < 5
        assert c.get("/v2/e/health").json()["jobs"]["inProgress"] + stats(c)["jobs_in_store"] >= 10_000


def test_sim_imports_nothing_else_from_offload() -> None:
    """The simulator stands alone: its modules import only each other from offload, besides six leaves (the base
    of config models, the exception tree and the "did you mean" of config errors, which import nothing else; and
    the start-up heap freeze, the clock types and the HTTP client factory, which import nothing from offload), and
    its command line (`offload/cli/sim.py`, which `python -m offload.testing.sim` runs) needs only the CLI's error
    handling on top."""
    from test_import_graph import import_graph

    graph = import_graph()
    leaves = {
        "offload.schema",
        "offload.errors",
        "offload.suggest",
        "offload.heap",
        "offload.clock",
        "offload.http_client",
    }
    assert graph["offload.schema"] == {"offload.errors", "offload.suggest"}
    assert graph["offload.errors"] == graph["offload.suggest"] == graph["offload.heap"] == set()
    assert graph["offload.clock"] == graph["offload.http_client"] == set()
    assert graph["offload.testing"] == set()  # the simulator's package: a docstring, no imports
    sim_modules = [m for m in graph if m.startswith("offload.testing.sim")]
    assert "offload.testing.sim.server" in sim_modules
    for module in sim_modules:
        allowed = leaves | ({"offload.cli", "offload.cli.sim"} if module == "offload.testing.sim.__main__" else set())
        assert {t for t in graph[module] if not t.startswith("offload.testing.sim")} <= allowed, module
    assert {t for t in graph["offload.cli.sim"] if not t.startswith("offload.testing")} == {"offload.cli.errors"}
    assert graph["offload.cli.errors"] == {"offload.errors"}


def test_python_m_offload_sim_loads_no_other_command_group() -> None:
    """What actually runs (not only what the source says): no queue, worker, server or autoscale command code."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "offload.testing.sim", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "serve" in proc.stdout, proc.stderr[-2000:]
    loaded = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "offload.cli.sim" in loaded and "offload.testing.sim.config" in loaded
    assert "offload.testing.sim.server" not in loaded  # the HTTP server (the `server` extra) loads only to serve
    others = sorted(
        m
        for m in loaded
        if m.startswith(
            (
                "offload.cli.",
                "offload.server",
                "offload.autoscale",
                "offload.worker",
                "offload.backends",
                "offload.storage",
            )
        )
    )
    assert others == ["offload.cli.errors", "offload.cli.sim"], others
