"""The one way a test waits for something: poll a condition until it holds or a deadline passes, then fail
naming what it waited for (never a bare sleep as synchronisation). Deadlines are generous bounds on a loaded
machine, not measurements: a test that measures a time asserts it separately."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

Check = Callable[[], Any]  # returns a value or an awaitable one; truthy means done


def _failure(timeout: float, what: str, last: Any, why: Callable[[], str] | None) -> AssertionError:
    detail = f"\n{why()}" if why else ""
    return AssertionError(f"timed out after {timeout:g}s waiting for {what} (last: {last!r}){detail}")


async def eventually(
    check: Check,
    timeout: float = 20.0,
    what: str = "condition",
    *,
    every: float = 0.05,
    why: Callable[[], str] | None = None,
    task: asyncio.Future[Any] | None = None,
    tolerate: tuple[type[BaseException], ...] = (),
) -> Any:
    """The first truthy value `check` returns (awaited when it returns an awaitable). `why` adds a diagnosis (a
    log tail) to the failure; `task` fails at once when that task ends first; `tolerate` counts those exceptions
    from `check` as not yet (a server restarting)."""
    deadline = time.monotonic() + timeout
    value: Any = None
    while True:
        try:
            value = check()
            if inspect.isawaitable(value):
                value = await value
        except tolerate:
            value = None
        if value:
            return value
        if task is not None and task.done():
            task.result()  # a crashed task raises here
            raise AssertionError(f"the task stopped while waiting for {what}")
        if time.monotonic() > deadline:
            raise _failure(timeout, what, value, why)
        await asyncio.sleep(every)


async def seconds_until(check: Callable[[], Awaitable[Any]], timeout: float, what: str, **kw: Any) -> float:
    """`eventually`, timed: the seconds it took."""
    t0 = time.monotonic()
    await eventually(check, timeout, what, **kw)
    return time.monotonic() - t0


def eventually_sync(
    check: Check,
    timeout: float = 20.0,
    what: str = "condition",
    *,
    every: float = 0.05,
    why: Callable[[], str] | None = None,
) -> Any:
    """`eventually` for code without an event loop."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _failure(timeout, what, value, why)
        time.sleep(every)
