"""`offload worker` runs on uvloop where it is installed (offload/eventloop.py); OFFLOAD_EVENT_LOOP chooses."""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import sys

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from support.admin_redis import redis_admin

from offload import eventloop
from offload.connection import connect, is_outage
from offload.errors import ConfigError


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_by_default_asyncio_when_asked() -> None:
    assert eventloop.run(_loop_module()).startswith("uvloop")
    assert eventloop.loop_factory({eventloop.LOOP_VAR: " Asyncio "}) is None


def test_a_bad_loop_names_the_variable_and_leaves_no_unawaited_coroutine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(eventloop.LOOP_VAR, "trio")
    coro = _loop_module()
    with pytest.raises(ConfigError, match=r"OFFLOAD_EVENT_LOOP: expected one of uvloop, asyncio, got 'trio'"):
        eventloop.run(coro)
    assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED  # closed, not left to warn


def test_without_uvloop_the_default_is_asyncio_and_asking_for_it_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    assert eventloop.run(_loop_module()) == "asyncio.unix_events"
    with pytest.raises(ConfigError, match=r"OFFLOAD_EVENT_LOOP: uvloop was asked for and is not installed"):
        eventloop.loop_factory({eventloop.LOOP_VAR: "uvloop"})


def test_the_worker_command_fails_at_start_naming_a_bad_loop() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "offload", "worker", "--queue", "q"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, eventloop.LOOP_VAR: "trio", "OFFLOAD_REDIS_URL": "redis://127.0.0.1:1/0"},
    )
    assert out.returncode != 0
    assert "OFFLOAD_EVENT_LOOP: expected one of uvloop, asyncio, got 'trio'" in out.stderr
    assert "Traceback" not in out.stderr


async def _write_after_reset(url: str) -> tuple[BaseException, bool]:
    """A pooled redis-py connection whose transport is reset under it (as a Valkey crash does), then a command on
    it: what it raises, and whether the next command (a new connection) is answered."""
    redis = await connect(url)
    try:
        await redis.ping()
        pool = redis_admin(redis).connection_pool
        [conn] = list(pool._available_connections)
        assert conn._writer is not None
        conn._writer.transport.abort()
        await asyncio.sleep(0)  # the loop runs the transport's close
        # straight on the connection: redis-py 8.2+'s pool would find the closed socket at checkout and reconnect
        # before sending, but a reset that lands between the checkout and the write reaches the write like this
        with pytest.raises(Exception) as raised:
            await conn.send_command("PING")
        return raised.value, bool(await redis.ping())
    finally:
        await redis.aclose()


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_write_on_a_reset_connection_is_an_outage_on_either_loop(valkey_url: str, loop: str) -> None:
    """uvloop raises RuntimeError ('... the handler is closed') where asyncio's loop raises a ConnectionError;
    both must read as an outage (waited out, never a failed attempt), and the client reconnects after either."""
    runner = asyncio.Runner(loop_factory=eventloop.loop_factory({eventloop.LOOP_VAR: loop}))
    with runner:
        exc, answered = runner.run(_write_after_reset(valkey_url))
    # redis-py before 8.2 let uvloop's RuntimeError ('... the handler is closed') through where asyncio's loop
    # gives a ConnectionError; 8.2 wraps both as ConnectionError. Each must read as an outage.
    expected = (RuntimeError, RedisConnectionError) if loop == "uvloop" else (RedisConnectionError,)
    assert isinstance(exc, expected), repr(exc)
    assert is_outage(exc), repr(exc)
    assert answered
    closed = "unable to perform operation on <TCPTransport closed=True reading=False 0x7f00>; the handler is closed"
    assert is_outage(RuntimeError(closed))  # what uvloop raised through redis-py before 8.2
    assert not is_outage(RuntimeError("a bug of our own")) and not is_outage(ValueError("the handler is closed"))
