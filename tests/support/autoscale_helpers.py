"""Helpers for the autoscaler tests: a scaler wired to a mock provider, worker keys, the simulator's control calls;
the settable clock and the GPU worker's registry record come from bench/cost/world.py. Real Redis/Valkey underneath."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from bench import web
from bench.cost.world import Clock, drop_worker, put_worker
from offload.access.api_keys import KeyStore
from offload.autoscale.instances import Instance
from offload.autoscale.provider_store import ProviderStore
from offload.autoscale.providers.local import LocalConfig, LocalProvider
from offload.autoscale.providers.mock import MockConfig, MockProvider
from offload.autoscale.scaler import Autoscaler
from offload.autoscale.vault import Vault
from offload.config import Settings
from offload.redis_client import RedisClient

__all__ = [
    "VAULT_KEY",
    "Clock",
    "drop_worker",
    "make_scaler",
    "put_worker",
    "queue_block",
    "sim_call",
    "stored",
    "worker_token",
]

VAULT_KEY = "test-master-key-0123456789abcdef"


async def stored(scaler: Autoscaler, instance_id: str) -> Instance:
    """The instance record the scaler keeps, which must exist."""
    instance = await scaler.instances.get(instance_id)
    assert instance is not None, instance_id
    return instance


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
    return web.request(method, url, timeout=10, **kwargs).json()


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


REPO = str(Path(__file__).resolve().parents[2])  # where `tests.support.handlers` imports from


@contextlib.asynccontextmanager
async def local_fleet(redis: RedisClient, queue: str, handler: str, tmp_path: Path) -> AsyncIterator[str]:
    """Provider `here` (type local: its machines are `offload worker --handler <handler>` processes, logs in
    tmp_path/logs) and a worker key for `queue`, which it yields. Whatever happens, no worker process outlives it."""
    _, worker_key = await KeyStore(redis).create("worker", [queue], "autoscaled workers")
    machine = {
        "handler": handler,
        "python": sys.executable,
        "workdir": REPO,
        "grace": 5,
        "log_dir": str(tmp_path / "logs"),
        "stop_timeout": 5,
    }
    await ProviderStore(redis, Vault(VAULT_KEY)).create("here", "local", machine)
    try:
        yield worker_key
    finally:
        leftover = LocalProvider("here", LocalConfig(stop_timeout=1), redis)
        for found in await leftover.list():
            await leftover.destroy(found.provider_id)
