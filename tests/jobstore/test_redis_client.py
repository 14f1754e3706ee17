"""`RedisClient` says what offload relies on of redis-py's two async clients; this checks it says nothing false.

The Protocol is only a type (connect() casts to it), so nothing at run time would notice a method it lists that a
client lacks, or a parameter spelt differently: every command must exist on the single-node and the cluster
client (and on both pipelines for RedisPipeline) with every parameter the Protocol gives, by name, and the
connected client must answer the decoded types it promises.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Protocol, get_overloads

import pytest
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterPipeline, RedisCluster

from offload.connection import connect
from offload.redis_client import RedisClient, RedisPipeline


def _members(protocol: type) -> list[str]:
    return sorted(name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_"))


def _params(fn: Callable[..., object]) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def _overloads(protocol: type, name: str) -> list[Callable[..., object]]:
    """The @overload signatures of a Protocol method (which has no implementation to look them up by)."""

    def stub() -> None: ...

    stub.__module__, stub.__qualname__ = protocol.__module__, f"{protocol.__qualname__}.{name}"
    return list(get_overloads(stub))


def _accepts(real: Callable[..., object], wanted: inspect.Parameter) -> bool:
    params = {p.name: p for p in _params(real)}
    if wanted.kind is inspect.Parameter.VAR_POSITIONAL:
        return any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values()) or bool(params)
    if wanted.name in params:
        return True
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


@pytest.mark.parametrize(
    ("protocol", "real"),
    [(RedisClient, Redis), (RedisClient, RedisCluster), (RedisPipeline, Pipeline), (RedisPipeline, ClusterPipeline)],
    ids=["client-redis", "client-cluster", "pipeline-redis", "pipeline-cluster"],
)
def test_every_protocol_command_exists_with_its_parameters(protocol: type, real: type) -> None:
    assert _problems(protocol, real) == []
    assert len(_members(protocol)) >= (30 if protocol is RedisClient else 10)


def _problems(protocol: type, real: type) -> list[str]:
    missing: list[str] = []
    for name in _members(protocol):
        method = getattr(real, name, None)
        if method is None:
            missing.append(f"{real.__name__}.{name} does not exist")
            continue
        declared = getattr(protocol, name)
        for wanted in [p for sig in _overloads(protocol, name) or [declared] for p in _params(sig)]:
            if not _accepts(method, wanted):
                missing.append(f"{real.__name__}.{name} has no parameter {wanted.name!r}")
    return missing


class _Wrong(Protocol):
    async def get(self, key: str) -> str | None: ...  # redis-py calls it `name`
    async def hgetall_typo(self, name: str) -> dict[str, str]: ...


def test_the_check_catches_a_wrong_protocol() -> None:
    assert _problems(_Wrong, Redis) == ["Redis.get has no parameter 'key'", "Redis.hgetall_typo does not exist"]


async def test_the_connected_client_answers_str_as_promised(valkey_url: str) -> None:
    """decode_responses=True is what the Protocol's `str` replies stand on: connect() must keep setting it."""
    redis = await connect(valkey_url)
    try:
        await redis.set("t:k", "v")
        await redis.hset("t:h", mapping={"f": 1})
        await redis.sadd("t:s", "m")
        await redis.zadd("t:z", {"m": 1.5})
        await redis.xadd("t:x", {"f": "v"})
        assert await redis.get("t:k") == "v"
        assert await redis.hgetall("t:h") == {"f": "1"}
        assert await redis.smembers("t:s") == {"m"}
        assert await redis.zrangebyscore("t:z", "-inf", "+inf", withscores=True) == [("m", 1.5)]
        [(entry_id, fields)] = await redis.xrange("t:x")
        assert isinstance(entry_id, str) and fields == {"f": "v"}
        assert await redis.mget(["t:k", "t:none"]) == ["v", None]
    finally:
        await redis.aclose()
