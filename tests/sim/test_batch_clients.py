"""The provider batch clients (offload.backends.openai_batch, anthropic_batch) over real HTTP against the
simulator: a pack submitted, polled to its end and split into one result per job; partial failure, expiry and
cancel reach only their own jobs; the providers' limits refuse a pack before it is sent; HTTP failures map
through the backend error tree."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from support.eventually import eventually

from bench import web
from offload.backends.anthropic_batch import AnthropicBatch, custom_id, job_id
from offload.backends.base import Fatal, NotFound, Throttled, Transient
from offload.backends.batch import LIMITS, BatchClient, BatchStatus, PackTooLarge
from offload.backends.openai_batch import OpenAIBatch
from offload.testing.sim import SimConfig, running_sim

KEY = "sim-key"


@pytest.fixture(scope="module")
def sim_base() -> Iterator[str]:
    with running_sim(SimConfig(seed=9, api_key=KEY)) as base:
        yield base


@pytest.fixture
def sim(sim_base: str) -> str:
    web.post(
        f"{sim_base}/_sim/config", json={"seed": 9, "api_key": KEY, "batches": {"seconds": 0.3}}
    ).raise_for_status()
    web.post(f"{sim_base}/_sim/reset").raise_for_status()
    return sim_base


def configure(base: str, changes: dict[str, Any]) -> None:
    web.post(f"{base}/_sim/config?merge=true", json=changes).raise_for_status()


def sim_stats(base: str) -> dict[str, Any]:
    stats: dict[str, Any] = web.get(f"{base}/_sim/stats").json()
    return stats


def chat(job: str) -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": job}]}


def message(job: str) -> dict[str, Any]:
    return {**chat(job), "max_tokens": 32}


def clients(base: str) -> list[tuple[BatchClient, Callable[[str], dict[str, Any]]]]:
    """Each provider's client with how it writes one job's request."""
    return [
        (OpenAIBatch(base_url=f"{base}/v1", api_key=KEY), chat),
        (AnthropicBatch(base_url=base, api_key=KEY), message),
    ]


async def ended(client: BatchClient, batch_id: str) -> BatchStatus:
    async def check() -> BatchStatus | None:
        status: BatchStatus = await client.status(batch_id)
        return status if status.ended else None

    found: BatchStatus = await eventually(check, 20, f"{client.provider} batch {batch_id} ended")
    return found


JOBS = [f"images.v2:0190{i:024x}" for i in range(4)]  # offload job ids: a queue name with a dot, a colon


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_a_pack_comes_back_one_result_per_job(sim: str, provider: str) -> None:
    client, body = dict((c.provider, (c, b)) for c, b in clients(sim))[provider]
    try:
        batch_id = await client.submit([(job, body(job)) for job in JOBS])
        assert not (await client.status(batch_id)).ended
        status = await ended(client, batch_id)
        assert status.provider_status in ("completed", "ended")
        results = await client.results(batch_id)
        assert sorted(results) == JOBS and all(r.ok for r in results.values())
        text = results[JOBS[2]].output["choices"][0]["message"]["content"] if provider == "openai" else None
        text = text or results[JOBS[2]].output["content"][0]["text"]
        assert JOBS[2] in text  # the answer to that job's own request
        counts = sim_stats(sim)["submissions_by_input_id"]
        assert len(counts) == 4 and set(counts.values()) == {1}
    finally:
        await client.aclose()


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_failed_expired_and_cancelled_lines_reach_only_their_jobs(sim: str, provider: str) -> None:
    client, body = dict((c.provider, (c, b)) for c, b in clients(sim))[provider]
    try:
        configure(sim, {"batches": {"seconds": 2.0, "expire_after": 1.2}})  # lines at 0.5, 1, 1.5, 2 s
        bad: tuple[str, dict[str, Any]] = (JOBS[1], {"messages": []})  # no model: the endpoint refuses it
        expiring = await client.submit([(JOBS[0], body(JOBS[0])), bad, *[(j, body(j)) for j in JOBS[2:]]])
        await ended(client, expiring)
        kinds = {job: r.kind for job, r in (await client.results(expiring)).items()}
        assert kinds == {JOBS[0]: "succeeded", JOBS[1]: "errored", JOBS[2]: "expired", JOBS[3]: "expired"}
        configure(sim, {"batches": {"seconds": 30.0, "expire_after": 86_400}})
        running = await client.submit([(job, body(job)) for job in JOBS])
        assert (await client.cancel(running)).state in ("cancelling", "ended")
        await ended(client, running)
        results = await client.results(running)
        assert {r.kind for r in results.values()} == {"canceled"}
        assert (await client.cancel(running)).ended, "a second cancel is no error"
    finally:
        await client.aclose()


async def test_limits_refuse_a_pack_before_sending(sim: str) -> None:
    for client, _ in clients(sim):
        try:
            with pytest.raises(PackTooLarge):
                await client.submit([])
            too_many = LIMITS[client.provider].max_requests + 1
            with pytest.raises(PackTooLarge, match="requests"):
                await client.submit([(f"q:{i:x}", {}) for i in range(too_many)])
        finally:
            await client.aclose()
    stats = sim_stats(sim)
    assert not any(route.startswith(("openai.", "anthropic.")) for route in stats["requests"])
    with pytest.raises(PackTooLarge, match="custom_id"):
        custom_id("q" * 70 + ":0190")
    assert job_id(custom_id("a_b.c:0190ff")) == "a_b.c:0190ff"


async def test_http_failures_map_to_the_backend_errors(sim: str) -> None:
    openai_batch, anthropic_batch = (client for client, _ in clients(sim))
    try:
        with pytest.raises(NotFound):
            await openai_batch.status("batch_gone")
        with pytest.raises(NotFound):
            await anthropic_batch.status("msgbatch_gone")
        configure(sim, {"default": {"rate_429": 1.0}})
        with pytest.raises(Throttled) as throttled:
            await anthropic_batch.submit([(JOBS[0], message(JOBS[0]))])
        assert throttled.value.retry_after == 1.0
        configure(sim, {"default": {"rate_429": 0.0, "error_rate": 1.0, "error_statuses": [502]}})
        with pytest.raises(Transient) as gateway:
            await openai_batch.submit([(JOBS[0], chat(JOBS[0]))])
        assert gateway.value.maybe_accepted
        configure(sim, {"default": {"error_rate": 0.0}})
        pending = await openai_batch.submit([(JOBS[0], chat(JOBS[0]))])
        configure(sim, {"batches": {"seconds": 30.0}})
        slow = await anthropic_batch.submit([(JOBS[0], message(JOBS[0]))])
        with pytest.raises(Transient, match="not ended"):
            await anthropic_batch.results(slow)
        await ended(openai_batch, pending)
    finally:
        await openai_batch.aclose()
        await anthropic_batch.aclose()
    wrong = OpenAIBatch(base_url=f"{sim}/v1", api_key="wrong")
    try:
        with pytest.raises(Fatal) as refused:
            await wrong.status(pending)
        assert refused.value.status == 401 and "wrong" not in str(refused.value)
    finally:
        await wrong.aclose()
