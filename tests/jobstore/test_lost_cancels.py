"""A task cancelled while it talks to the store ends cancelled, at whatever step of a command the cancel lands.

Python 3.11's `asyncio.wait_for` returns the result when a cancel lands as what it waits for finishes (CPython
gh-86296, fixed in 3.12), and redis-py writes every command through it. Measured before the fix on Valkey 9: a
cancel one to three event-loop steps into any command was lost every time (30 of 30 at each of those steps), and
the task ran on as if never cancelled; a server's stop then waited forever on its store watch (CI, stop 53: the
warm-start test's subprocess killed at 60 s). offload/connection.py's `restore_lost_cancels` delivers such a
cancel after the write, on a closed connection; `offload.eventloop.within` is our own timed wait without the flaw.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from offload.config import Settings
from offload.connection import connect
from offload.eventloop import within
from offload.queue.memory import read_memory
from offload.redis_client import RedisClient
from offload.server.store_watch import StoreWatch

Call = Callable[[], Coroutine[Any, Any, object]]
STEPS = 12  # event-loop steps into a command at which the cancel lands: past the write and into the read
TRIES = 4


async def cancel_at(step: int, call: Call) -> str:
    """Start `call` as a task, let it run `step` event-loop steps, cancel it: how it ended."""
    task = asyncio.create_task(call())
    for _ in range(step):
        await asyncio.sleep(0)
    if not task.cancel():
        await task
        return "finished first"
    try:
        await task
    except asyncio.CancelledError:
        return "cancelled"
    return "ran on"


async def outcomes_of(redis: RedisClient, call: Call) -> Counter[str]:
    seen: Counter[str] = Counter()
    for step in range(STEPS):
        for _ in range(TRIES):
            seen[await cancel_at(step, call)] += 1
    for i in range(20):  # every reply still reaches its own command: no cancelled command's reply is read later
        await redis.set(f"after:{i}", str(i))
        assert await redis.get(f"after:{i}") == str(i)
    return seen


def commands(redis: RedisClient) -> dict[str, Call]:
    async def pipeline() -> object:
        pipe = redis.pipeline(transaction=True)
        pipe.hincrby("h", "n")
        pipe.hget("h", "n")
        return await pipe.execute()

    return {
        "info": lambda: read_memory(redis),  # INFO memory
        "set": lambda: redis.set("k", "v"),
        "script": lambda: redis.eval("return redis.call('incr', KEYS[1])", 1, "n"),
        "pipeline": pipeline,
    }


@pytest.mark.parametrize("command", ["info", "set", "script", "pipeline"])
async def test_a_cancel_at_any_step_of_a_store_command_is_delivered(valkey_url: str, command: str) -> None:
    redis = await connect(valkey_url)
    try:
        seen = await outcomes_of(redis, commands(redis)[command])
    finally:
        await redis.aclose()
    assert seen["ran on"] == 0, seen
    assert seen["cancelled"] >= 4 * TRIES, seen  # steps 0-3 land before the reply on any machine: it was tried


async def test_the_store_watch_ends_when_cancelled_at_any_step_of_its_pass(valkey_url: str) -> None:
    """The loop the server's stop waited on: cancelled at any step of its first pass, it ends."""
    redis = await connect(valkey_url)
    watch = StoreWatch(redis, Settings.model_validate({"redis_url": valkey_url}), every_s=30)
    ended: Counter[str] = Counter()
    try:
        for step in range(STEPS):
            task = asyncio.create_task(watch.run())
            for _ in range(step):
                await asyncio.sleep(0)
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=5)
            ended["cancelled" if task in done and task.cancelled() else f"still running at step {step}"] += 1
            task.cancel()
    finally:
        await watch.aclose()
        await redis.aclose()
    assert ended == {"cancelled": STEPS}, ended


async def test_within_delivers_a_cancel_that_lands_as_its_awaitable_finishes() -> None:
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[str] = loop.create_future()
    task = asyncio.create_task(within(answer, 10))
    await asyncio.sleep(0)  # the task now waits on the answer
    answer.set_result("done")
    task.cancel()  # in the same step: asyncio.wait_for on Python 3.11 returns "done" here
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await within(asyncio.sleep(0, "in time"), 10) == "in time"
    with pytest.raises(TimeoutError):
        await within(loop.create_future(), 0.01)
