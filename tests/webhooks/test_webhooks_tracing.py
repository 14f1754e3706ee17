"""A job completed by its provider's webhook, traced (offload/tracing.py): the simulator calls the real server,
which wakes the dispatch worker; the worker's attempt span has an `offload.webhook` child and no poll, and no
span carries the webhook URL's secret or the backend's key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry import trace
from support.tracing import no_secret, parent_id, spans, traced
from support.webhook_world import configure_sim, sim_jobs, world

from offload import tracing
from offload.config import TracingSettings
from offload.models import JobState
from offload.testing.sim import running_sim


@pytest.fixture(scope="module")
def sim_url() -> Iterator[str]:
    with running_sim() as base:
        yield str(base)


@pytest.mark.parametrize("provider", ["replicate", "runpod"])
async def test_the_webhook_that_completed_a_job_is_in_its_trace(
    provider: str, valkey_url: str, sim_url: str, tmp_path: Path
) -> None:
    configure_sim(sim_url, latency=0.3)
    with traced():
        async with world(valkey_url, sim_url, tmp_path) as w:
            on = w.settings.model_copy(update={"tracing": TracingSettings(enabled=True)})
            async with w.worker(provider, settings=on):
                job_id = await w.enqueue(provider, f"traced-{provider}")
                job = await w.finished(job_id)
        assert job.state == JobState.SUCCEEDED
        found = spans()
    (attempt,) = [s for s in spans("offload.attempt") if s.attributes and s.attributes[tracing.JOB_ID] == job_id]
    assert attempt.context is not None and attempt.attributes is not None
    assert attempt.attributes[tracing.OUTCOME] == "succeeded"
    children = {s.name: s for s in found if parent_id(s) == attempt.context.span_id}
    assert set(children) == {"offload.submit", "offload.webhook", "offload.store"}, set(children)  # no poll
    hook = children["offload.webhook"]
    assert hook.attributes == {
        tracing.BACKEND: attempt.attributes[tracing.BACKEND],
        tracing.REMOTE_ID: attempt.attributes[tracing.REMOTE_ID],
        tracing.SUBMISSION: 1,
    }
    assert hook.kind is trace.SpanKind.INTERNAL
    (remote,) = sim_jobs(sim_url, job_id)
    secret = str(remote["meta"]["webhook"]).rsplit("/", 1)[1]  # the webhook URL's last segment
    no_secret(found, secret, "sim-key")
