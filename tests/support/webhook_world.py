"""A world for webhook tests: the simulator (in a thread), the offload server (in a thread, on a port chosen
up front so its public URL can go into the config), real Valkey, local result storage, and dispatch workers
run in the test's event loop. One backend and queue per provider."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from bench import web
from offload.config import Settings
from offload.connection import connect
from offload.eventloop import within
from offload.models import Job, JobState
from offload.queue.keyspace import hooks_channel
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.worker.dispatch import Worker
from offload.worker.run import run_worker
from support.admin_redis import redis_admin
from support.eventually import eventually
from support.server_helpers import server
from support.servers import free_port

REPLICATE_SECRET = "whsec_" + "c2ltdWxhdGVkLXJlcGxpY2F0ZS1zZWNyZXQ="
QUEUES = {"replicate": "q-rep", "fal": "q-fal", "runpod": "q-rp"}
BACKENDS = {"replicate": "rep", "fal": "falapp", "runpod": "rp"}


def settings_for(redis_url: str, sim_url: str, public_url: str | None, results: Path, **kw: Any) -> Settings:
    return Settings.model_validate(config_for(redis_url, sim_url, public_url, results, **kw))


def config_for(
    redis_url: str,
    sim_url: str,
    public_url: str | None,
    results: Path,
    *,
    poll_s: float = 60.0,
    grace_s: float | None = None,
) -> dict[str, Any]:
    common: dict[str, Any] = {"base_url": sim_url, "api_key": "sim-key", "webhook_poll_interval_s": poll_s}
    if grace_s is not None:
        common["webhook_grace_s"] = grace_s
    return {
        "redis_url": redis_url,
        "storage": {"kind": "local", "path": str(results)},
        "server": {"public_url": public_url},
        "backends": {
            "rep": {"kind": "replicate", "version": "v1hash", "webhook_secret": REPLICATE_SECRET, **common},
            "falapp": {
                "kind": "fal",
                "app": "fal-ai/flux/dev",
                "webhook_jwks_url": f"{sim_url}/_sim/fal/jwks.json",
                **common,
            },
            "rp": {"kind": "runpod", "endpoint_id": "ep1", **common},
        },
        "queues": {
            q: {"backend": BACKENDS[p], "poll_interval": 0.2, "poll_timeout": 60, "max_attempts": 3}
            for p, q in QUEUES.items()
        },
    }


def configure_sim(sim_url: str, *, latency: float = 0.3, behaviour: dict[str, Any] | None = None, **hooks: Any) -> None:
    """Fresh jobs and counters; jobs of fixed `latency` (and other `behaviour` fields); webhook faults `hooks`;
    the known Replicate secret. Idempotency-Key is ignored, as the real providers do."""
    behaviour = behaviour or {}
    web.post(f"{sim_url}/_sim/reset").raise_for_status()
    config = {"seed": 7, "default": {"latency": latency, **behaviour}, "honour_idempotency_key": False}
    web.post(f"{sim_url}/_sim/config", json=config).raise_for_status()
    body = {"replicate_secret": REPLICATE_SECRET, **hooks}
    web.post(f"{sim_url}/_sim/webhooks", json=body).raise_for_status()


def deliveries(sim_url: str, event: str | None = "completed") -> list[dict[str, Any]]:
    """The simulator's webhook deliveries of one event (`completed`, `start`), or of all (None)."""
    sent = web.get(f"{sim_url}/_sim/webhooks").json()["deliveries"]
    return [d for d in sent if event is None or d["event"] == event]


def sim_jobs(sim_url: str, job_id: str) -> list[dict[str, Any]]:
    """The remote jobs whose webhook URL names offload job `job_id` (quoted in the URL's path)."""
    tag = f"/{quote(job_id, safe='')}/"
    return list(web.get(f"{sim_url}/_sim/jobs", params={"tag": tag}).json()["jobs"])


def sim_requests(sim_url: str) -> dict[str, int]:
    return dict(web.get(f"{sim_url}/_sim/stats").json()["requests"])


@dataclass
class World:
    sim_url: str
    server_url: str
    settings: Settings
    store: QueueStore

    async def enqueue(self, provider: str, input_id: str) -> str:
        return await self.store.enqueue(QUEUES[provider], JobSpec(input={"id": input_id, "prompt": input_id}))

    async def finished(self, job_id: str, timeout: float = 20.0) -> Job:
        async def done() -> Job | None:
            job = await self.store.get(job_id)
            return job if job.state in (JobState.SUCCEEDED, JobState.DEAD) else None

        found: Job = await eventually(done, timeout, f"job {job_id} to finish")
        return found

    @contextlib.asynccontextmanager
    async def worker(self, provider: str, settings: Settings | None = None) -> AsyncIterator[Worker]:
        """A dispatch worker for the provider's queue, in this event loop, drained on exit."""
        stop, cut = asyncio.Event(), asyncio.Event()
        ready: list[Worker] = []
        task = asyncio.create_task(
            run_worker(
                settings or self.settings,
                QUEUES[provider],
                stop=stop,
                cut=cut,
                grace_s=1.0,
                install_signals=False,
                on_ready=ready.append,
            )
        )

        async def started() -> bool:
            if task.done():
                task.result()
            return bool(ready)

        await eventually(started, 10, "the worker to start")
        if (settings or self.settings).hook_base(BACKENDS[provider]):
            channel = hooks_channel(QUEUES[provider], ready[0].id)

            async def subscribed() -> bool:
                ((_, n),) = await redis_admin(self.store.redis).pubsub_numsub(channel)
                return bool(n)

            await eventually(subscribed, 10, "the worker's webhook subscription")
        try:
            yield ready[0]
        finally:
            stop.set()  # a drain awaits the submit calls out (up to the backend's timeout): a test that holds one
            done, _ = await asyncio.wait([task], timeout=5)  # at the provider on purpose ends by cutting the drain
            if not done:
                cut.set()
            await within(task, 15)


@contextlib.contextmanager
def server_at(settings: Settings, redis_url: str, port: int) -> Any:
    with server(redis_url, settings=settings, port=port, admin_key="boot-admin-key-for-tests-0123456789") as (url, _):
        yield url


@contextlib.asynccontextmanager
async def world(redis_url: str, sim_url: str, tmp: Path, **settings: Any) -> AsyncIterator[World]:
    port = free_port()
    public = f"http://127.0.0.1:{port}"
    config = settings_for(redis_url, sim_url, public, tmp / "results", **settings)
    with server_at(config, redis_url, port) as url:
        client = await connect(redis_url)
        try:
            yield World(sim_url, url, config, QueueStore(client))
        finally:
            await client.aclose()
