"""Hearing of webhooks: one pub/sub subscription per dispatch worker and queue, for all the jobs it holds.

The server's hook.lua PUBLISHes `<job id> <submission>` on the channel of the worker that holds the job
(`keys.hooks_channel`) right after it kept a verified final webhook, with ` <body>` after it when the body is
small. One blocking read serves every job in flight: a message sets that job's event, and its task takes the
body from the message, or reads the kept one from the job record (a burst of 2,000 completions spent ~90 ms per
job, median, between the wake-up and that read: a round trip in a batch behind the others). Pub/sub delivers
at most once, so a message lost to a dropped connection costs that job only its fallback poll (and a job
claimed later finds the body by itself), never its result.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from offload.connection import is_outage

log = logging.getLogger("offload.worker")
RECONNECT_MAX_S = 5.0


Wake = Callable[[str | None, int, str | None], None]


async def listen(redis: Any, channel: str, wake: Wake) -> None:
    """Call `wake(job_id, submission, body or None)` for every message on `channel` until cancelled; reconnect
    after an outage, then `wake(None, 0, None)`: every job looks for a kept webhook once, since messages sent
    meanwhile were lost. A message that does not parse wakes its job without a body (it reads the record)."""
    pause = 0.1
    subscribed_before = False
    while True:
        pubsub = redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(channel)
            if subscribed_before:
                wake(None, 0, None)
            subscribed_before = True
            pause = 0.1
            while True:
                message = await pubsub.get_message(timeout=30.0)
                if message is not None and message.get("type") == "message":
                    job_id, _, rest = str(message["data"]).partition(" ")
                    number, _, body = rest.partition(" ")
                    wake(job_id, int(number) if number.isdigit() else 0, body or None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not is_outage(exc):
                log.warning("webhook wake-ups: %s: %s", type(exc).__name__, exc)
            await asyncio.sleep(pause)
            pause = min(pause * 2, RECONNECT_MAX_S)
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()
