"""Helpers for the autoscaler tests: a settable clock, simulated GPU workers written in the server registry's
format, and a scaler wired to a mock provider. Real Redis/Valkey underneath, never fakes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from offload.autoscale.instances import Instance
from offload.autoscale.providers.mock import MockConfig, MockProvider
from offload.autoscale.scaler import Autoscaler
from offload.config import Settings
from offload.queue.keyspace import GPU_WORKERS as INDEX
from offload.queue.keyspace import gpu_worker as worker_key
from offload.redis_client import RedisClient

VAULT_KEY = "test-master-key-0123456789abcdef"


@dataclass
class Clock:
    t: float = 1_800_000_000.0  # a fixed, arbitrary instant (2027-01-15 08:00 UTC)

    def __call__(self) -> float:
        return self.t

    def ms(self) -> int:
        """The same instant in integer milliseconds: a QueueStore's clock."""
        return int(self.t * 1000)

    def advance(self, seconds: float) -> None:
        self.t += seconds


async def stored(scaler: Autoscaler, instance_id: str) -> Instance:
    """The instance record the scaler keeps, which must exist."""
    instance = await scaler.instances.get(instance_id)
    assert instance is not None, instance_id
    return instance


async def put_worker(
    redis: RedisClient,
    worker_id: str,
    queue: str,
    instance_id: str | None,
    now: float,
    *,
    in_flight: int = 0,
    protected: bool = False,
) -> None:
    """A GPU worker's registry record, as the server's WorkerRegistry writes it (register + heartbeat)."""
    await redis.hset(
        worker_key(worker_id),
        mapping={
            "id": worker_id,
            "key_id": "k",
            "host": "gpu-host",
            "version": "test",
            "queues": queue,
            "pid": 1,
            "concurrency": 1,
            "instance_id": instance_id or "",
            "protected": int(protected),
            "gpus": "[]",
            "registered_at": int(now * 1000),
            "last_heartbeat": int(now * 1000),
            "in_flight": in_flight,
        },
    )
    await redis.zadd(INDEX, {worker_id: int(now * 1000)})


async def drop_worker(redis: RedisClient, worker_id: str) -> None:
    await redis.delete(worker_key(worker_id))
    await redis.zrem(INDEX, worker_id)


async def worker_token(redis: RedisClient, queue: str = "gpu") -> str:
    """A real worker key for `queue`: the scaler checks the key it ships to real providers (the mock ships none)."""
    from offload.access.api_keys import KeyStore

    _, token = await KeyStore(redis).create("worker", [queue], "autoscaler test")
    return token


def queue_block(**overrides: Any) -> dict[str, Any]:
    block: dict[str, Any] = {
        "enabled": True,
        "provider": "m",
        "min_workers": 0,
        "max_workers": 3,
        "poll_interval": "30s",
        "boot_timeout": "10m",
        "scale_up": [{"trigger": "no_workers"}],
        "scale_down": [{"trigger": "idle", "timeout": "5m"}],
        "instance": {"gpu": "RTX 4090", "image": "img", "max_price_per_hour": 0.5},
    }
    block.update(overrides)
    return block


def sim_call(method: str, url: str, **kwargs: Any) -> Any:
    """A simulator control/inspection call (sync: the simulator runs in its own thread)."""
    return httpx.request(method, url, timeout=10, **kwargs).json()


def make_scaler(
    redis: RedisClient,
    clock: Clock,
    block: dict[str, Any] | None = None,
    *,
    queue: str = "gpu",
    mock: MockConfig | None = None,
    owner: str = "s1",
    alerts: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    server: dict[str, Any] | None = None,
) -> tuple[Autoscaler, MockProvider]:
    settings = Settings.model_validate(
        {
            "queues": {queue: {"autoscale": block or queue_block()}},
            "autoscaler": {"worker_key": "ofk_worker_key", "leader_ttl": 60, **(server or {})},
            "alerts": alerts or {},
            **(extra or {}),
        }
    )
    provider = MockProvider("m", mock or MockConfig(), redis, clock)
    scaler = Autoscaler(
        redis, settings, clock=clock, owner=owner, provider_override={"m": provider}, drain_settle=0.0, env={}
    )
    return scaler, provider
