"""`mock`: a dry-run provider. It records what it would rent (in Redis, so a server restart keeps them) and
boots nothing. A person can play the machine by starting a worker with OFFLOAD_INSTANCE_ID=<as-…>.

It also takes a few fault knobs (failing creates or destroys, a boot delay) so a policy can be rehearsed, and
so the policy tests exercise the same journal/retry paths a real provider's failures take.
"""

from __future__ import annotations

import builtins
import logging
import secrets
import time
from typing import Any

import orjson
from pydantic import Field

from offload.autoscale import keyspace
from offload.autoscale.providers.base import (
    LaunchSpec,
    Machine,
    MachineState,
    NotOurs,
    OutOfCapacity,
    Provider,
    ProviderConfig,
    ProviderError,
    is_ours,
)
from offload.clock import Clock
from offload.redis_client import RedisClient

log = logging.getLogger("offload.autoscale.mock")


class MockConfig(ProviderConfig):
    boot_seconds: float = Field(0.0, ge=0, description="seconds until the machine reports running")
    price_per_hour: float | None = Field(None, ge=0, description="listed price (over the cap: not rented)")
    fail_creates: int = Field(0, ge=0, description="the next N creates fail (out of capacity)")
    fail_destroys: int = Field(0, ge=0, description="the next N destroys fail (HTTP-500-like)")


class MockProvider(Provider):
    type = "mock"
    real = False
    Config = MockConfig

    def __init__(self, name: str, config: MockConfig, redis: RedisClient, clock: Clock = time.time) -> None:
        super().__init__(name)
        self.config = config
        self.redis = redis
        self.clock = clock
        self.key = keyspace.machines("mock", name)
        self.calls: dict[str, int] = {"create": 0, "list": 0, "destroy": 0}

    async def _take_fault(self, field: str, configured: int) -> bool:
        """Fault budgets count down in Redis, so they survive a scaler restart (the day test restarts it)."""
        used = int(await self.redis.hincrby(keyspace.mock_faults(self.name), field, 1))
        return used <= configured

    async def create(self, spec: LaunchSpec) -> Machine:
        self.calls["create"] += 1
        if self.config.fail_creates and await self._take_fault("create", self.config.fail_creates):
            raise OutOfCapacity("mock: no capacity (fail_creates)")
        listed, cap = self.config.price_per_hour, spec.spot_max_price if spec.spot else spec.max_price_per_hour
        if listed is not None and cap is not None and listed > cap:
            raise OutOfCapacity(f"mock: listed at ${listed:.3f}/h, over the queue's cap ${cap:.3f}")
        provider_id = "mock-" + secrets.token_hex(6)
        price = self._price(spec)
        record = {
            "id": provider_id,
            "label": spec.label,
            "created": self.clock(),
            "price": price,
            "host": "mockhost-" + provider_id[-4:],
            "queue": spec.queue,
            "gpu": spec.gpu,
            "spot": spec.spot,
        }
        await self.redis.hset(self.key, provider_id, orjson.dumps(record))
        log.info("mock: would rent %s for queue %s (%s, image %s)", spec.label, spec.queue, spec.gpu, spec.image)
        return self._machine(record)

    def _price(self, spec: LaunchSpec) -> float | None:
        price = self.config.price_per_hour if self.config.price_per_hour is not None else spec.max_price_per_hour
        if spec.spot and spec.spot_max_price is not None:
            price = min(price, spec.spot_max_price) if price is not None else spec.spot_max_price
        return price

    async def quote(self, spec: LaunchSpec) -> float | None:
        return self._price(spec)

    def _machine(self, r: dict[str, Any]) -> Machine:
        booted = self.clock() - float(r["created"]) >= self.config.boot_seconds
        state = MachineState.RUNNING if booted else MachineState.STARTING
        if r.get("state"):
            state = MachineState(r["state"])
        return Machine(
            provider_id=r["id"],
            label=r["label"],
            state=state,
            price_per_hour=r.get("price"),
            host_id=r.get("host"),
            raw=r,
        )

    async def list(self) -> builtins.list[Machine]:
        self.calls["list"] += 1
        raw = await self.redis.hgetall(self.key)
        return [m for m in (self._machine(orjson.loads(v)) for v in raw.values()) if is_ours(m.label)]

    async def destroy(self, provider_id: str) -> None:
        self.calls["destroy"] += 1
        raw = await self.redis.hget(self.key, provider_id)
        if raw is None:
            return
        record = orjson.loads(raw)
        if not is_ours(record.get("label")):
            raise NotOurs(provider_id, record.get("label", ""))
        if self.config.fail_destroys and await self._take_fault("destroy", self.config.fail_destroys):
            raise ProviderError("mock: destroy failed (fail_destroys)")
        await self.redis.hdel(self.key, provider_id)
        log.info("mock: would destroy %s (%s)", provider_id, record.get("label"))

    async def vanish(self, provider_id: str) -> None:
        """Test hook: the machine disappears at the provider (pre-emption)."""
        await self.redis.hdel(self.key, provider_id)

    async def set_state(self, provider_id: str, state: MachineState) -> None:
        """Test hook: the provider reports this state for the machine from now on (e.g. failed: a broken host)."""
        raw = await self.redis.hget(self.key, provider_id)
        if raw is not None:
            await self.redis.hset(self.key, provider_id, orjson.dumps({**orjson.loads(raw), "state": state.value}))

    async def plant(self, label: str) -> str:
        """Test hook: a machine we have no record of (an orphan), or a foreign one (label not offload-)."""
        provider_id = "mock-" + secrets.token_hex(6)
        await self.redis.hset(
            self.key,
            provider_id,
            orjson.dumps({"id": provider_id, "label": label, "created": self.clock(), "price": 0.1, "host": "h"}),
        )
        return provider_id

    async def all_ids(self) -> builtins.list[str]:
        """Every machine the mock holds, ours or not (tests count leaks with it)."""
        return [str(k) for k in await self.redis.hkeys(self.key)]
