"""A job's max_cost against the backend's price model: a submission that may cost more fails `over max_cost`
before anything is sent (the simulator receives nothing for it); one within it runs."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from support.eventually import eventually
from support.s3server import RcloneS3
from test_worker import job_input, settings_for, sim_stats, start_worker

from bench import web
from offload.backends.settings import HttpJobSettings
from offload.connection import connect
from offload.models import JobState
from offload.queue import keyspace
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.testing.sim.config import SimConfig
from offload.testing.sim.server import running_sim
from offload.worker.budget import fits

BUCKET = "gpu-results"


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    with running_sim(SimConfig.model_validate({"default": {"latency": 0.1}})) as url:
        yield str(url)


@pytest.fixture(autouse=True)
def _reset_sim(sim: str) -> None:
    web.post(f"{sim}/_sim/reset").raise_for_status()


@pytest.fixture
async def store(valkey_url: str) -> AsyncIterator[QueueStore]:
    redis = await connect(valkey_url)
    yield QueueStore(redis)
    await redis.aclose()


def _prices(**prices: float) -> HttpJobSettings:
    return HttpJobSettings.model_validate({"kind": "http-job", "base_url": "http://sim", **prices})


def test_fits_judges_the_most_a_submission_may_cost() -> None:
    """max_job_cost first, else price_per_job, else price_per_second for the whole poll_timeout (the spend cap's
    reservation); no price model, or no max_cost: nothing to judge."""
    job = JobSpec(input=1, max_cost=0.05)
    assert fits(job, _prices(price_per_job=0.05), poll_timeout=600) is None
    assert fits(job, _prices(price_per_job=0.06), poll_timeout=600) == (
        "over max_cost: a submission may cost $0.06, over the job's max_cost $0.05"
    )
    assert fits(job, _prices(price_per_second=0.001), poll_timeout=60) is not None  # up to $0.06
    assert fits(job, _prices(price_per_second=0.001), poll_timeout=50) is None
    assert fits(job, _prices(price_per_job=0.01, max_job_cost=0.5), poll_timeout=60) is not None
    assert fits(job, _prices(), poll_timeout=600) is None
    assert fits(JobSpec(input=1), _prices(price_per_job=9), poll_timeout=600) is None


async def test_a_job_over_its_max_cost_fails_without_a_submission(
    valkey_url: str, s3: RcloneS3, sim: str, store: QueueStore
) -> None:
    settings = settings_for(valkey_url, s3, sim, "http-job")
    settings.backends["gpu"].price_per_job = 0.10
    over, within, unbounded = await store.enqueue_many(
        "q",
        [
            JobSpec(input=job_input("over"), max_cost=0.05),
            JobSpec(input=job_input("within"), max_cost=0.10),
            JobSpec(input=job_input("unbounded")),
        ],
    )
    stop, task = await start_worker(settings)

    async def all_done() -> bool:
        return all([(await store.get(i)).state.terminal for i in (over, within, unbounded)])

    await eventually(all_done, 30, "the three jobs to finish")
    stop.set()
    await task
    refused = await store.get(over)
    assert refused.state is JobState.DEAD and refused.attempts == 1
    assert refused.error == "over max_cost: a submission may cost $0.1, over the job's max_cost $0.05"
    assert refused.remote_id is None and refused.cost is None
    assert [(await store.get(i)).state for i in (within, unbounded)] == [JobState.SUCCEEDED] * 2
    submissions = sim_stats(sim)["submissions_by_input_id"]
    assert "over" not in submissions and submissions == {"within": 1, "unbounded": 1}, submissions
    assert (await store.stats("q")).totals["over_max_cost"] == 1
    events = await store.redis.xrange(keyspace.events("q"), "-", "+")
    assert [f["jobs"] for _, f in events if f["state"] == "over_max_cost"] == [over]
