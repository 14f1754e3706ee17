"""The event loop the long-running commands run on: uvloop where it is installed, else asyncio's own.

The `worker` and `server` extras bring uvloop (libuv's loop, written in Cython), and `uvicorn` already picks it by
itself for `offload server`. For the dispatch worker it lowers the loop's own cost per job, and its timers fire
closer to their deadline than asyncio's (docs/explanation/performance.md, *Event loop*).
`OFFLOAD_EVENT_LOOP=asyncio` keeps asyncio's loop (for a debugger
or a library that needs it); `=uvloop` requires uvloop. A bad value is an error naming the variable.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from offload.env import env_str
from offload.errors import ConfigError

T = TypeVar("T")
LOOP_VAR = "OFFLOAD_EVENT_LOOP"
LOOPS = ("uvloop", "asyncio")


def loop_factory(environ: dict[str, str] | None = None) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's `new_event_loop` unless OFFLOAD_EVENT_LOOP says `asyncio` or uvloop is not installed (None:
    asyncio's default loop)."""
    choice = env_str(LOOP_VAR, "", env=environ).strip().lower()
    if choice and choice not in LOOPS:
        raise ConfigError(f"{LOOP_VAR}: expected one of {', '.join(LOOPS)}, got {choice!r}")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError(f"{LOOP_VAR}: uvloop was asked for and is not installed (pip install uvloop)") from None
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the loop `loop_factory` picks."""
    try:
        factory = loop_factory()
    except ConfigError:
        main.close()  # never awaited: no "coroutine was never awaited" warning beside the error
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


async def first_of(*aws: Any) -> None:
    """Wait until the first of several awaitables finishes (a stop event, a wake-up, a timer), then cancel the
    others this created; a future passed in is the caller's and is left alone. One helper for every wait of the
    worker's loops, so none leaves a waiter task behind."""
    tasks = [a if isinstance(a, asyncio.Future) else asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for given, task in zip(aws, tasks, strict=True):
            if task is not given:
                task.cancel()


async def within(aw: Awaitable[T], seconds: float | None) -> T:
    """`await aw` for at most `seconds` (None: no limit), else TimeoutError: `asyncio.wait_for`, except that a
    cancel landing as `aw` finishes is delivered. Python 3.11's wait_for returns the result then and the cancel is
    lost (CPython gh-86296, fixed in 3.12): a drain's cut or a server's stop that a loop never sees. The one timed
    wait of offload: `asyncio.wait_for` is banned in pyproject.toml (ruff TID251)."""
    async with asyncio.timeout(seconds):
        return await aw
