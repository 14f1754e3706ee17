"""Handlers for `offload worker --handler tests.handlers:...` in the remote-worker tests (real subprocesses)."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from offload.worker.remote import JobContext, PermanentError

LOADS = {"count": 0}


def load() -> dict[str, Any]:
    """The load hook: counts its own calls, so a test can see it ran once per process."""
    LOADS["count"] += 1
    return {"model": "tiny", "loads": LOADS["count"]}


def echo(input: Any, ctx: JobContext) -> dict[str, Any]:
    """Sync, with context. OFFLOAD_TEST_SLOW=S makes every job take S seconds (crash and drain tests)."""
    slow = float(os.environ.get("OFFLOAD_TEST_SLOW", "0") or 0)
    if slow:
        time.sleep(slow)
    loaded = ctx.loaded or {}
    return {
        "echo": input,
        "job": ctx.id,
        "attempt": ctx.attempt,
        "pid": os.getpid(),
        "loads": loaded.get("loads"),
        "load_calls": LOADS["count"],
    }


def boom(input: Any) -> Any:
    """Sync, input only: always fails (retried per the job's policy)."""
    raise RuntimeError(f"boom on {input!r}")


def bad_input(input: Any) -> Any:
    raise PermanentError("this input can never work")


async def async_echo(input: Any, ctx: JobContext) -> dict[str, Any]:
    await asyncio.sleep(0.01)
    return {"async": True, "echo": input, "job": ctx.id}


async def async_slow(input: Any, ctx: JobContext) -> Any:
    """Runs until cancelled (the cancel test)."""
    await asyncio.sleep(120)
    return input
