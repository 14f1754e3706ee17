"""Drive each official provider SDK against the simulator: submit, poll to completion, read output, cancel.

RunPod and fal read their base URL/host from the environment at import time (`RUNPOD_ENDPOINT_BASE_URL`,
`FAL_QUEUE_RUN_HOST`), so those checks run in a fresh interpreter: `python tests/support/sim_sdk_check.py runpod|fal`
prints one JSON document. Replicate and OpenAI take a base URL per client and are called in-process.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

POLL = 0.05
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMED_OUT")


def check_runpod() -> dict[str, Any]:
    import runpod  # type: ignore[import-untyped]

    runpod.api_key = "sim-key"
    endpoint = runpod.Endpoint("ep-sim")
    job = endpoint.run({"id": "rp-1", "prompt": "a haiku"})
    deadline = time.monotonic() + 20
    while job.status() not in FINAL and time.monotonic() < deadline:  # Job.output(timeout) polls once a second
        time.sleep(POLL)
    status = job.status()
    output = job.output()
    sync_output = endpoint.run_sync({"input": {"id": "rp-2"}}, timeout=20)
    to_cancel = endpoint.run({"id": "rp-3"})
    cancelled = to_cancel.cancel()
    health = endpoint.health()
    return {
        "job_id": job.job_id,
        "status": status,
        "output": output,
        "sync_output": sync_output,
        "cancelled": cancelled,
        "cancel_status": to_cancel.status(),
        "health": health,
    }


def check_fal() -> dict[str, Any]:
    import fal_client

    client = fal_client.SyncClient(key="sim-key")
    handle = client.submit("fal-ai/flux/dev", arguments={"id": "fal-1", "prompt": "a lighthouse"})
    events = [type(e).__name__ for e in handle.iter_events(with_logs=True, interval=POLL)]
    result = handle.get()
    # Rebuilt from the request id, as a worker that restarted would do (the subpath must be dropped).
    rebuilt = client.status("fal-ai/flux/dev", handle.request_id, with_logs=False)
    rebuilt_result = client.result("fal-ai/flux/dev", handle.request_id)
    to_cancel = client.submit("fal-ai/flux/dev", arguments={"id": "fal-2"})
    to_cancel.cancel()
    after_cancel = to_cancel.status()
    return {
        "request_id": handle.request_id,
        "status_url": handle.status_url,
        "events": events,
        "result": result,
        "rebuilt_status": type(rebuilt).__name__,
        "rebuilt_result": rebuilt_result,
        "cancel_status": type(after_cancel).__name__,
        "cancel_error": getattr(after_cancel, "error", None),
    }


def check_replicate(base_url: str) -> dict[str, Any]:
    import replicate
    from replicate.client import Client

    client = Client(api_token="sim-key", base_url=base_url)
    client.poll_interval = POLL
    created = client.predictions.create(
        version="5c7d5dc6dd8bf75c1acaa8565735e7986bc5b66206b55cca93cb72c9bf15ccaa",
        input={"id": "rep-1", "prompt": "a cat"},
        webhook="https://example/hook?tag=t1",
    )
    created.wait()
    ran = client.run("sim-owner/sim-model", input={"id": "rep-2"})
    to_cancel = client.models.predictions.create(model="sim-owner/sim-model", input={"id": "rep-3"})
    to_cancel.cancel()
    to_cancel.reload()
    page = client.predictions.list()
    try:
        client.predictions.get("does-not-exist")
        missing: dict[str, Any] = {}
    except replicate.exceptions.ReplicateError as exc:
        missing = {"status": exc.status, "title": exc.title, "detail": exc.detail}
    return {
        "status": created.status,
        "output": created.output,
        "metrics": created.metrics,
        "urls": created.urls,
        "run_output": ran,
        "cancel_status": to_cancel.status,
        "listed": [p.id for p in page.results],
        "missing": missing,
    }


def check_openai(base_url: str) -> dict[str, Any]:
    import openai

    client = openai.OpenAI(api_key="sim-key", base_url=f"{base_url}/v1", max_retries=0)
    completion = client.chat.completions.create(
        model="sim-model",
        messages=[{"role": "user", "content": "hello"}],
        metadata={"job_id": "oai-1"},
    )
    message = completion.choices[0].message.content or ""
    return {
        "id": completion.id,
        "object": completion.object,
        "finish_reason": completion.choices[0].finish_reason,
        "usage": completion.usage.model_dump() if completion.usage else None,
        "content": json.loads(message),
    }


def check_openai_throttled(base_url: str) -> dict[str, Any]:
    import openai

    client = openai.OpenAI(api_key="sim-key", base_url=f"{base_url}/v1", max_retries=0)
    try:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    except openai.RateLimitError as exc:
        return {
            "status": exc.status_code,
            "code": exc.code,
            "type": exc.type,
            "retry_after": exc.response.headers.get("retry-after"),
        }
    return {}


if __name__ == "__main__":
    started = time.monotonic()
    checks = {"runpod": check_runpod, "fal": check_fal}
    out = checks[sys.argv[1]]()
    out["elapsed"] = time.monotonic() - started
    print(json.dumps(out, default=str))
