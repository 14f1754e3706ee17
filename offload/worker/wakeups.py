"""Wake-ups over pub/sub: one subscription per dispatch worker and queue, for two kinds of news.

- **Jobs became ready** (`keyspace.wake_channel`): a claim that found the queue's ready set empty leaves a flag,
  and the next script that makes a job ready PUBLISHes once (ready.lua's `wake`). An idle worker claims at
  once instead of at its next poll, which backs off to 0.5 s.
- **Webhooks** (`keyspace.hooks_channel`, with webhooks on): the server's hook.lua PUBLISHes `<job id> <submission>`
  on the channel of the worker that holds the job right after it kept a verified final webhook, with ` <body>`
  after it when the body is small. One blocking read serves every job in flight: a message sets that job's
  event, and its task takes the body from the message (no read: see docs/explanation/performance.md, *Webhook
  bodies in the wake-up*), or reads the kept one from the job record.

Pub/sub delivers at most once, so a message lost to a dropped connection costs a wake-up only its fallback (the
claim loop's next poll; a job's fallback poll, and a job claimed later finds its webhook body by itself), never a
job or a result. Once subscribed (after a reconnect, and the first time) every channel's handler is called
with None, since messages sent before were lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

from offload.backoff import Backoff
from offload.connection import is_outage

log = logging.getLogger("offload.worker")
RECONNECT_FIRST_S = 0.1
RECONNECT_MAX_S = 5.0


Wake = Callable[[str | None, int, str | None], None]


def hook_messages(wake: Wake) -> Callable[[str | None], None]:
    """A `listen` handler for a worker's hooks channel: `wake(job_id, submission, body or None)` per message,
    `wake(None, 0, None)` once subscribed (every job in flight looks for a kept webhook once: after a reconnect,
    messages were lost; the first time, the jobs are few if any). A message that does not parse wakes its job
    without a body (it reads the record)."""

    def handle(data: str | None) -> None:
        if data is None:
            wake(None, 0, None)
            return
        job_id, _, rest = data.partition(" ")
        number, _, body = rest.partition(" ")
        wake(job_id, int(number) if number.isdigit() else 0, body or None)

    return handle


async def listen(redis: Any, handlers: Mapping[str, Callable[[str | None], None]]) -> None:
    """Call `handlers[channel](data)` for every message until cancelled; reconnect after an outage. Every
    handler is called with None each time the subscription is in place, the first time too: messages sent
    before it (while reconnecting, or while the worker's first claims ran ahead of its first subscription)
    were lost."""
    pauses = Backoff(RECONNECT_FIRST_S, RECONNECT_MAX_S)
    while True:
        pubsub = redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(*handlers)
            for handle in handlers.values():
                handle(None)
            pauses.reset()
            while True:
                message = await pubsub.get_message(timeout=30.0)
                if message is not None and message.get("type") == "message":
                    handler = handlers.get(str(message["channel"]))
                    if handler is not None:
                        handler(str(message["data"]))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not is_outage(exc):
                log.warning("pub/sub wake-ups: %s: %s", type(exc).__name__, exc)
            await asyncio.sleep(pauses.next())
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()
