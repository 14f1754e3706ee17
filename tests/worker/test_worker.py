"""The dispatch worker end to end: real Valkey, the real simulator over HTTP, a real S3 server (rclone)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson
import pytest
from support.eventually import eventually
from support.s3server import RcloneS3

from bench import web
from offload.config import Settings
from offload.connection import connect
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.testing.sim.config import SimConfig
from offload.testing.sim.server import running_sim
from offload.worker.run import run_worker

BUCKET = "gpu-results"


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    with running_sim(SimConfig.model_validate({"default": {"latency": 0.3}})) as url:
        yield str(url)


@pytest.fixture(autouse=True)
def _reset_sim(sim: str) -> None:
    web.post(f"{sim}/_sim/reset").raise_for_status()


def configure_sim(sim: str, config: dict[str, Any]) -> None:
    web.post(f"{sim}/_sim/config", json=config).raise_for_status()


def sim_stats(sim: str) -> dict[str, Any]:
    stats: dict[str, Any] = web.get(f"{sim}/_sim/stats").json()
    return stats


BACKENDS: dict[str, dict[str, Any]] = {
    "http-job": {"kind": "http-job"},
    "runpod": {"kind": "runpod", "endpoint_id": "sdxl"},
    "replicate": {"kind": "replicate", "model": "acme/sdxl"},
    "fal": {"kind": "fal", "app": "fal-ai/flux/dev"},
    "openai": {"kind": "openai", "model": "gpt-sim"},
}


def settings_for(valkey_url: str, s3: RcloneS3, sim: str, kind: str, **queue: Any) -> Settings:
    base = f"{sim}/v1" if kind == "openai" else sim  # the OpenAI SDK's convention: the base URL ends in /v1
    backend = {**BACKENDS[kind], "base_url": base, "api_key": "sim-key"}
    return Settings.model_validate(
        {
            "redis_url": valkey_url,
            "storage": s3.settings(BUCKET),
            "backends": {"gpu": backend},
            "queues": {"q": {"backend": "gpu", "poll_interval": 0.2, "poll_timeout": 30, **queue}},
        }
    )


def job_input(input_id: str) -> dict[str, Any]:
    """An input every simulated API accepts (the chat API needs messages); `id` lets the simulator count
    submissions per job."""
    return {"id": input_id, "prompt": f"a haiku about {input_id}", "messages": [{"role": "user", "content": "hi"}]}


async def start_worker(settings: Settings, **kw: Any) -> tuple[asyncio.Event, asyncio.Task[Any]]:
    stop = asyncio.Event()
    task = asyncio.create_task(run_worker(settings, "q", stop=stop, install_signals=False, grace_s=5, **kw))
    return stop, task


@pytest.fixture
async def store(valkey_url: str) -> AsyncIterator[QueueStore]:
    redis = await connect(valkey_url)
    yield QueueStore(redis)
    await redis.aclose()


@pytest.mark.parametrize("kind", list(BACKENDS))
async def test_every_backend_end_to_end(kind: str, valkey_url: str, s3: RcloneS3, sim: str, store: QueueStore) -> None:
    settings = settings_for(valkey_url, s3, sim, kind)
    ids = await store.enqueue_many("q", [JobSpec(input=job_input(f"{kind}-{i}")) for i in range(20)])
    stop, task = await start_worker(settings)

    async def all_done() -> bool:
        return (await store.stats("q")).counts["succeeded"] == 20

    await eventually(all_done, 60, "20 jobs to succeed")
    stop.set()
    await task
    client = s3.client()
    for i, job_id in enumerate(ids):
        job = await store.get(job_id)
        assert job.result == f"s3://{BUCKET}/results/{job_id}.json"
        body = orjson.loads(client.get_object(Bucket=BUCKET, Key=f"results/{job_id}.json")["Body"].read())
        assert f"{kind}-{i}" in orjson.dumps(body).decode()  # the output echoes the input
    submissions = sim_stats(sim)["submissions_by_input_id"]
    assert all(submissions.get(f"{kind}-{i}") == 1 for i in range(20)), submissions
