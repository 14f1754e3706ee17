"""Alerts: `autoscale_failure`, `boot_timeout`, `spend_cap_reached`, `dead_letter_growth`, `queue_latency`,
`file_sweep` (the file sweep stopped itself: see offload/server/file_sweep.py), `store_memory` and
`eviction_policy` (the job store's, offload/server/store_watch.py), delivered by webhook (a JSON POST, retried with
backoff) and by email (SMTP).

The same alert (kind + subject, e.g. a queue) is sent at most once per cooldown across all servers: the last
send time lives in Redis and the check-and-set is one SET with a compare in Lua. Deliveries run as background
tasks so a slow webhook never delays the scaler; `drain()` waits for them (tests, shutdown).
"""

from __future__ import annotations

import asyncio
import logging
import smtplib
import time
from email.message import EmailMessage
from typing import Any

import httpx
import orjson

from offload.autoscale import keyspace
from offload.autoscale.alert_settings import AlertKind, AlertSettings, EmailTarget, WebhookTarget
from offload.autoscale.instances import EventKind, log_event
from offload.backoff import compute_backoff
from offload.clock import Clock
from offload.connection import is_outage
from offload.http_client import make_client
from offload.queue.keyspace import dead_letter_alert
from offload.queue.scripts import SCRIPTS
from offload.redact import Redactor, mask_url
from offload.redis_client import RedisClient

log = logging.getLogger("offload.autoscale.alerts")
# A target filtering on a kind also receives its sub-kinds: a machine that never booted is an autoscale failure.
PARENT: dict[str, str] = {"boot_timeout": "autoscale_failure"}


# The longest wait between two tries of one delivery: 10 tries (the most `attempts` allows) then take at most
# ~26 s in all, instead of 102 s for the tenth wait alone.
RETRY_CAP_S = 5.0


def _retry_wait(attempt: int) -> float:
    """Seconds before delivery try `attempt + 2`: 0.2, 0.4, 0.8... up to RETRY_CAP_S (`settings.attempts` bounds
    the tries)."""
    return compute_backoff(attempt + 1, base=0.2, cap=RETRY_CAP_S)


def _wants(kinds: list[AlertKind] | None, kind: str) -> bool:
    return kinds is None or kind in kinds or PARENT.get(kind) in kinds


class Alerter:
    def __init__(
        self,
        settings: AlertSettings,
        redis: RedisClient,
        clock: Clock = time.time,
        http: httpx.AsyncClient | None = None,
        redact: Redactor | None = None,
    ) -> None:
        self.settings = settings
        # alerts leave the process (webhooks, email, the journal): redacted with every secret the caller
        # knows plus the alert targets' own (webhook headers, the SMTP password)
        self.redact = redact or Redactor()
        self.redact.add(*(v for hook in settings.webhooks for v in hook.headers.values()))
        self.redact.add(settings.email.password if settings.email else None)
        self.redis = redis
        self.clock = clock
        self.http = http or make_client("alerts")
        self._tasks: set[asyncio.Task[None]] = set()
        self.sent: list[dict[str, Any]] = []
        self.failed: list[str] = []

    async def alert(self, kind: AlertKind, subject: str, message: str, **details: Any) -> bool:
        """Raise an alert; False if the same one was sent within the cooldown."""
        now = self.clock()
        if not await SCRIPTS.alert_once(
            self.redis, [keyspace.alert(kind, subject)], [repr(now), self.settings.cooldown]
        ):
            return False
        message = self.redact(message)
        details = {k: self.redact(v) if isinstance(v, str) else v for k, v in details.items()}
        doc = {"kind": kind, "subject": subject, "message": message, "details": details, "ts": now, "source": "offload"}
        log.warning("alert %s (%s): %s", kind, subject, message)
        self.sent.append(doc)
        for hook in self.settings.webhooks:
            if _wants(hook.kinds, kind):
                self._spawn(self._webhook(hook, doc))
        email = self.settings.email
        if email is not None and _wants(email.kinds, kind):
            self._spawn(asyncio.to_thread(self._email, email, doc))
        try:  # after the deliveries: a store at its maxmemory refuses the journal, never the alert about it
            await log_event(self.redis, now, EventKind.ALERT, message, alert=kind, subject=subject)
        except Exception as exc:
            if not is_outage(exc):
                raise
            log.warning("alert %s (%s) not journalled: %s", kind, subject, type(exc).__name__)
        return True

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _webhook(self, hook: WebhookTarget, doc: dict[str, Any]) -> None:
        body = orjson.dumps(doc)
        for attempt in range(self.settings.attempts):
            try:
                r = await self.http.post(
                    hook.url, content=body, headers={"Content-Type": "application/json", **hook.headers}
                )
                if r.status_code < 300:
                    return
                problem = f"HTTP {r.status_code}"
                if 400 <= r.status_code < 500 and r.status_code not in (408, 429):
                    break
            except httpx.HTTPError as exc:
                problem = type(exc).__name__
            if attempt + 1 < self.settings.attempts:
                await asyncio.sleep(_retry_wait(attempt))
        self.failed.append(f"webhook {mask_url(hook.url)}: {problem}")
        log.warning("alert webhook %s failed: %s", mask_url(hook.url), problem)

    def _email(self, target: EmailTarget, doc: dict[str, Any]) -> None:
        msg = EmailMessage()
        msg["Subject"] = f"[offload] {doc['kind']}: {doc['subject']}"
        msg["From"] = target.from_addr
        msg["To"] = ", ".join(target.to)
        msg.set_content(f"{doc['message']}\n\n{orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode()}\n")
        for attempt in range(self.settings.attempts):
            try:
                with smtplib.SMTP(target.host, target.port, timeout=10) as smtp:
                    if target.starttls:
                        smtp.starttls()
                    if target.username:
                        smtp.login(target.username, target.password or "")
                    smtp.send_message(msg)
                return
            except (OSError, smtplib.SMTPException) as exc:
                problem = type(exc).__name__
                if attempt + 1 < self.settings.attempts:
                    time.sleep(_retry_wait(attempt))
        self.failed.append(f"email {target.host}: {problem}")

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def monitor(self, store: Any, queues: list[str]) -> None:
        """Queue-level alerts: dead-letter growth over a window, and queue latency."""
        s = self.settings
        if s.dead_letter_growth is None and s.queue_latency is None:
            return
        now = self.clock()
        for queue in queues:
            stats = await store.stats(queue)
            if s.queue_latency is not None and stats.oldest_ready_age_ms is not None and not stats.paused:
                age = stats.oldest_ready_age_ms / 1000
                if age > s.queue_latency:
                    await self.alert(
                        "queue_latency",
                        queue,
                        f"queue {queue}: the oldest ready job has waited {age:.0f}s (limit {s.queue_latency:.0f}s)",
                        age_s=age,
                    )
            if s.dead_letter_growth is not None:
                dead = stats.counts.get("dead", 0)
                key = dead_letter_alert(queue)
                snap = await self.redis.get(key)
                if snap is None:
                    await self.redis.set(key, f"{dead}|{now}")
                    continue
                base, since = snap.split("|")
                if dead - int(base) >= s.dead_letter_growth:
                    await self.alert(
                        "dead_letter_growth",
                        queue,
                        f"queue {queue}: {dead - int(base)} jobs went dead in {now - float(since):.0f}s",
                        dead=dead,
                        added=dead - int(base),
                    )
                    await self.redis.set(key, f"{dead}|{now}")
                elif now - float(since) >= s.dead_letter_window or dead < int(base):
                    await self.redis.set(key, f"{dead}|{now}")

    async def aclose(self) -> None:
        await self.drain()
        await self.http.aclose()
