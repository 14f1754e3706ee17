"""Completion webhooks for producers: the server's sender, one loop per server process.

A job that ends (succeeded, dead, cancelled) with a callback URL, its own or its queue's, owes a webhook: the
step that ends it puts the job id in its queue's outbox (lua/includes/outbox.lua), so a process killed between
the end and the POST loses nothing. Every server claims due webhooks with a lease in Redis (callback_claim.lua):
at most one sends each at a time, and one whose sender died comes due again when the claim ends. Each POST is
signed with Standard Webhooks (`webhook-id`, `webhook-timestamp`, `webhook-signature`) under the queue's secret,
and under the previous one too during a rotation (callback_secrets.py). A 2xx delivers; anything else is tried
again with offload.backoff's doubling waits, up to `callbacks.max_tries`, then dead-lettered with its reason
(GET /v1/queues/{queue}/callbacks/failed). Connections obey offload.egress: only `callbacks.hosts`, and public
addresses unless `callbacks.allow_private_hosts`. The body never carries the job's input nor any secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import UTC, datetime
from typing import Any

import httpx
import orjson
from standardwebhooks import Webhook

from offload.autoscale.vault import VaultError
from offload.backends.http import new_client
from offload.backoff import compute_backoff
from offload.callback_settings import CallbackSettings
from offload.egress import POLICY, AddressRefused
from offload.errors import JobNotFound
from offload.eventloop import within
from offload.models import Job
from offload.queue.outbox import Claimed, Outbox, Outcome
from offload.redact import excerpt
from offload.server.callback_secrets import CallbackSecrets
from offload.server.routes_jobs import own_object, result_url
from offload.server.state import ServerState

log = logging.getLogger("offload.server.callbacks")
CLAIM_BATCH = 50  # webhooks one server claims from a queue per pass
MAX_IN_FLIGHT = 64  # POSTs one server has open at once
STOP_GRACE_S = 2.0  # how long POSTs still open at shutdown may take to end
ANSWER_EXCERPT = 200  # bytes of a failed answer kept as the reason


def payload(job: Job, url: str | None) -> bytes:
    """The webhook body (Standard Webhooks' `type`, `timestamp`, `data`): what a producer needs to act on the end
    of its job, never its input. `url`: the presigned result URL the API gives for it."""
    data = {
        "id": job.id,
        "queue": job.queue,
        "state": job.state.value,
        "attempts": job.attempts,
        "max_attempts": job.max_attempts,
        "error": job.error,
        "cost": job.cost,
        "result": job.result if job.state.value == "succeeded" else None,
        "result_url": url,
        "backend": job.backend,
        "created_at": job.created_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
    }
    when = datetime.fromtimestamp((job.finished_at or 0) / 1000, UTC).isoformat().replace("+00:00", "Z")
    return orjson.dumps({"type": f"job.{job.state.value}", "timestamp": when, "data": data})


def signed_headers(secrets: list[str], message_id: str, body: bytes, now: datetime) -> dict[str, str]:
    """Standard Webhooks' headers: one `v1,` signature per secret, space-separated (a rotation sends both)."""
    signatures = " ".join(Webhook(secret).sign(message_id, now, body) for secret in secrets)
    return {
        "content-type": "application/json",
        "webhook-id": message_id,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": signatures,
    }


class CallbackSender:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.settings: CallbackSettings = state.options.settings.callbacks
        self.outbox = Outbox(state.redis, state.store.clock_ms, state.store.durability)
        self.secrets = CallbackSecrets(self.outbox)
        self.policy = self.settings.policy()
        self.http = new_client(max_connections=MAX_IN_FLIGHT, timeout=self.settings.timeout_s, egress=True)
        self._in_flight: set[asyncio.Task[None]] = set()

    async def run(self, stop: asyncio.Event) -> None:
        """Mark the queues that have a callback URL of their own, then send what is due every `poll_s` until
        `stop`. Redis away: the next pass tries again. POSTs run as tasks of their own, so a receiver that hangs
        holds up only its own webhooks; at `stop` those still open get a moment, then are cancelled (their claims
        run out and another server sends them)."""
        if (problem := self.secrets.problem()) is not None:  # webhooks wait (and retry) until it is set
            log.warning("completion webhooks cannot be signed: %s", problem)
        marked = False
        while not stop.is_set():
            try:
                if not marked:
                    await self.mark_queues()
                    marked = True
                for queue in await self.state.store.queues():
                    await self.send_due(queue)
            except Exception as exc:  # (a Redis error's text may carry a URL with a password: the type only)
                if stop.is_set():
                    break
                log.warning("completion webhooks: %s", type(exc).__name__)
            with contextlib.suppress(TimeoutError):
                await within(stop.wait(), self.settings.poll_s)
        if self._in_flight:
            _, left = await asyncio.wait(self._in_flight, timeout=STOP_GRACE_S)
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)

    async def mark_queues(self) -> None:
        for name, q in self.state.options.settings.queues.items():
            await self.outbox.set_queue_callback(name, q.callback_url is not None)

    async def send_due(self, queue: str) -> int:
        """Claim the queue's due webhooks, as many as there are free places in flight, and start their POSTs;
        the number claimed."""
        free = MAX_IN_FLIGHT - len(self._in_flight)
        if free <= 0:
            return 0
        claimed = await self.outbox.claim(queue, min(CLAIM_BATCH, free), int(self.settings.claim_s * 1000))
        for one in claimed:
            task = asyncio.create_task(self._deliver(queue, one), name=f"callback {one.job_id}")
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)
        return len(claimed)

    async def _deliver(self, queue: str, claimed: Claimed) -> None:
        try:
            outcome, error = await self._try(queue, claimed)
        except Exception as exc:  # a bug or Redis away: tried again later, never lost
            outcome, error = "retry", f"internal error: {type(exc).__name__}"
        tries = claimed.tries + 1
        if outcome == "retry" and tries >= self.settings.max_tries:
            outcome, error = "dead", f"{error} (after {tries} tries)"
        wait = compute_backoff(tries, base=self.settings.backoff_s, cap=self.settings.backoff_cap_s, jitter=True)
        try:
            settled = await self.outbox.settle(
                queue, claimed, outcome, at_ms=int((time.time() + wait) * 1000), error=error
            )
        except Exception as exc:  # Redis away: the claim runs out and the webhook is sent again
            log.warning("completion webhook of %s: outcome not recorded: %s", claimed.job_id, type(exc).__name__)
            return
        if not settled:
            log.warning("completion webhook of %s: the claim ran out before the POST ended", claimed.job_id)
        elif outcome == "dead":
            log.warning("completion webhook of %s dead-lettered: %s", claimed.job_id, error)

    async def _try(self, queue: str, claimed: Claimed) -> tuple[Outcome, str]:
        """One POST of the webhook: ("ok", ""), or ("retry" | "dead", why)."""
        try:
            job = await self.state.store.get(claimed.job_id)
        except JobNotFound:
            return "dead", "the job's record is gone (its retention ended, or it was purged)"
        q = self.state.options.settings.queues.get(queue)
        url = job.callback_url or (q.callback_url if q is not None else None)
        if url is None:
            return "dead", "no callback_url: the queue's was removed from offload.yaml"
        if problem := self.settings.problem(url):
            return "dead", f"callback_url {problem}"
        try:
            secrets = (await self.secrets.get(queue)).signing
        except VaultError as exc:
            return "retry", f"no signing secret: {exc}"
        body = payload(job, await result_url(self.state, own_object(self.state, job)))
        headers = signed_headers(secrets, f"{job.id}.{job.finished_at}", body, datetime.now(UTC))
        return await self._post(url, body, headers)

    async def _post(self, url: str, body: bytes, headers: dict[str, str]) -> tuple[Outcome, str]:
        extensions: dict[str, Any] = {POLICY: self.policy}
        try:
            async with self.http.stream("POST", url, content=body, headers=headers, extensions=extensions) as r:
                if 200 <= r.status_code < 300:
                    return "ok", ""
                answer = b""
                async for chunk in r.aiter_raw():
                    answer += chunk
                    if len(answer) >= ANSWER_EXCERPT:
                        break
        except AddressRefused as exc:  # the address is the operator's business (the log), not the producer's
            log.warning("completion webhook refused: %s (%s)", exc.address, exc.why)
            return "retry", str(exc)
        except httpx.HTTPError as exc:
            return "retry", excerpt(f"{type(exc).__name__}: {exc}")
        text = excerpt(answer[:ANSWER_EXCERPT].decode(errors="replace"))
        return "retry", f"HTTP {r.status_code}" + (f": {text}" if text else "")

    async def aclose(self) -> None:
        await self.http.aclose()
