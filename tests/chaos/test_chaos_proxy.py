"""The fault proxy of the chaos harness (bench/chaos/proxy.py) in front of a real Valkey: RESP framing across
chunk boundaries, a dropped reply really is a command that executed, a pipeline loses every reply from the
dropped one on, a black-hole really blocks and then heals, a reset cuts every connection."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from support.servers import HOST, ValkeyServer

from bench.chaos.proxy import FaultProxy, command_words, message_end, split_messages
from offload.eventloop import within
from offload.queue.scripts import SCRIPTS


def test_framing_handles_every_resp_type_and_split_chunks() -> None:
    stream = (
        b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$5\r\nhe\r\nl\r\n"  # a bulk string may hold CRLF
        b"+OK\r\n-ERR x\r\n:42\r\n$-1\r\n*-1\r\n*2\r\n*1\r\n:1\r\n$0\r\n\r\n"
        b"%1\r\n+a\r\n,1.5\r\n_\r\n#t\r\n(123\r\n=8\r\ntxt:abcd\r\n~1\r\n+s\r\n>2\r\n+p\r\n+q\r\n"
        b"|1\r\n+k\r\n+v\r\n:7\r\nPING\r\n"
    )
    whole = split_messages(bytearray(stream))
    assert len(whole) == 16 and whole[0].endswith(b"he\r\nl\r\n") and whole[-1] == b"PING\r\n"
    assert whole[-2] == b"|1\r\n+k\r\n+v\r\n:7\r\n"  # an attribute travels with the reply it annotates
    for cut in range(1, len(stream)):  # every split point: nothing is framed early or lost
        buf = bytearray(stream[:cut])
        got = split_messages(buf)
        buf += stream[cut:]
        got += split_messages(buf)
        assert got == whole and not buf, cut
    assert message_end(b"$5\r\nab") is None and message_end(b"*2\r\n:1\r\n") is None
    assert command_words(whole[0]) == ["SET", "k"] and command_words(b"ping x\r\n") == ["ping", "x"]


@pytest.fixture
async def proxy(valkey_url: str, valkey: ValkeyServer) -> AsyncIterator[FaultProxy]:
    names = {getattr(SCRIPTS, n).sha: n for n in ("enqueue", "claim")}
    p = await FaultProxy((HOST, valkey.port), seed=1, script_names=names).start()
    yield p
    await p.close()


def client(url: str, timeout: float = 5.0) -> aioredis.Redis:
    """No automatic retries: the test must see the fault itself, not redis-py's replay of the command."""
    return aioredis.Redis.from_url(url, socket_timeout=timeout, retry=Retry(NoBackoff(), 0))


async def test_a_dropped_reply_is_a_command_that_executed(proxy: FaultProxy, valkey: ValkeyServer) -> None:
    direct = valkey.client()
    c = client(proxy.url)
    assert await c.set("n", 0)
    proxy.drop_next(1, commands=["INCRBY"])
    with pytest.raises(redis.ConnectionError):
        await c.incr("n")
    assert direct.get("n") == b"1"  # it ran: only the reply was lost
    assert await c.incr("n") == 2  # a new connection works again
    (drop,) = proxy.dropped
    assert drop.command == "INCRBY" and proxy.counts["dropped_replies"] == 1
    script = SCRIPTS.enqueue.sha
    direct.script_load(SCRIPTS.enqueue.source)
    proxy.drop_next(1, commands=["EVALSHA"])
    job = "q:0193aabbccddeeff001122334455"
    with pytest.raises(redis.ConnectionError):
        await c.evalsha(script, 1, "offload:{q}:", "", "0", '["0\\t\\t3\\t60\\t\\t\\t\\t"]', f'[["{job}", "{{}}", 1]]')
    assert direct.exists(f"offload:{{q}}:job:{job}") == 1
    assert proxy.dropped[-1].command == "EVALSHA enqueue" and proxy.dropped[-1].job_ids == [job]
    await c.aclose()


async def test_a_pipeline_loses_every_reply_from_the_dropped_one_on(proxy: FaultProxy, valkey: ValkeyServer) -> None:
    direct = valkey.client()
    direct.delete("a", "b", "c")
    reader, writer = await asyncio.open_connection(HOST, proxy.port)
    proxy.drop_next(1, commands=["INCR"])
    writer.write(
        b"*3\r\n$3\r\nSET\r\n$1\r\na\r\n$1\r\n1\r\n*2\r\n$4\r\nINCR\r\n$1\r\nb\r\n*2\r\n$4\r\nINCR\r\n$1\r\nc\r\n"
    )
    await writer.drain()
    got = b""
    with pytest.raises(ConnectionResetError):
        while chunk := await within(reader.read(100), 5):
            got += chunk
    assert got == b"+OK\r\n"  # the reply before the dropped one arrived; then the connection was reset
    assert (direct.get("a"), direct.get("b"), direct.get("c")) == (b"1", b"1", b"1")  # all three ran
    writer.close()


async def test_a_black_hole_blocks_both_ways_then_heals(proxy: FaultProxy, valkey: ValkeyServer) -> None:
    c = client(proxy.url, timeout=0.3)
    assert await c.ping()
    reader, writer = await asyncio.open_connection(HOST, proxy.port)
    proxy.blackhole(1.5)
    with pytest.raises(redis.TimeoutError):
        await c.set("hole", 1)  # a request in the hole times out ...
    assert valkey.client().get("hole") is None  # ... and never reached the server
    started = time.monotonic()
    writer.write(b"PING\r\n")
    assert await within(reader.readline(), 10) == b"+PONG\r\n"  # delivered once the hole closes
    waited = time.monotonic() - started
    assert waited >= 0.9, waited
    assert not proxy.blackholed and await client(proxy.url).ping()
    writer.close()
    await c.aclose()


async def test_reset_cuts_every_connection_and_delay_slows_replies(proxy: FaultProxy) -> None:
    a, b = client(proxy.url), client(proxy.url)
    assert await a.ping() and await b.ping()
    assert proxy.reset_all() == 2
    for c in (a, b):
        # redis-py 8.2+ finds the cut socket when the pool hands the connection out and reconnects before sending
        # anything; older ones send and raise. Either way nothing is half-sent and the next command is answered.
        with contextlib.suppress(redis.ConnectionError):
            await c.ping()
        assert await c.ping()
    assert proxy.counts["connections"] == 4  # both commands went over new connections: the reset really cut
    proxy.delay_s = 0.3
    started = time.monotonic()
    assert await a.ping()
    assert time.monotonic() - started >= 0.28
    await a.aclose()
    await b.aclose()
