"""Webhooks the simulator sends when a remote job ends (and, for Replicate, when it starts), signed the way each
provider signs them, with faults.

Replicate signs with Standard Webhooks (`webhook-id`, `webhook-timestamp`, `webhook-signature`: HMAC-SHA256 over
`id.timestamp.body` keyed with the secret after `whsec_`; the secret is served at `GET /v1/webhooks/default/secret`
as Replicate does). fal signs with ED25519: `X-Fal-Webhook-Signature` is the hex signature of
`request_id \\n user_id \\n timestamp \\n sha256(body)`, verifiable with the public keys at `/_sim/fal/jwks.json`.
RunPod does not sign at all.

Jobs are fixed timelines (see store.py), so nothing runs per job: one task sleeps until the earliest due
delivery. A Replicate prediction whose `webhook_events_filter` names `start` also gets a `start` delivery at
once (the prediction as it was created, `starting`), which is how a receiver learns the id of a prediction
whose create answer never reached its client. The fault knobs (`POST /_sim/webhooks`) drop, duplicate, delay
and reorder deliveries (a reordered final delivery is followed by a stale "still running" body; a reordered
`start` arrives after the job ended), so a receiver can be shown to shrug them off.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import heapq
import itertools
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import orjson
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from pydantic import BaseModel, ConfigDict, Field
from standardwebhooks import Webhook

from offload.clock import Clock
from offload.testing.sim.sender import LeanPost, SendError
from offload.testing.sim.store import TERMINAL, Job

Render = Callable[[float], dict[str, Any]]  # (at) -> the body as a poll at time `at` would have seen it
Event = Literal["completed", "start"]
FAL_USER_ID = "sim-user"
RETRIES = 2  # RunPod retries twice; Replicate "a few times"; fal more, but two show the behaviour
RETRY_PAUSE_S = 0.5
REORDER_LAG_S = 0.2  # a reordered `start` comes this long after the job ended, and after its final delivery
REORDER_WAIT_S = 30.0  # the longest a reordered `start` waits for that final delivery to have been sent
MAX_CONNECTIONS = 256
Rate = Annotated[float, Field(ge=0, le=1)]


class HookFaults(BaseModel):
    """Runtime knobs. Rates are probabilities per delivery; `delay_s` is added to a `delay_rate` share of the
    deliveries (all of them by default)."""

    model_config = ConfigDict(extra="forbid")
    drop_rate: Rate = 0.0
    duplicate_rate: Rate = 0.0
    reorder_rate: Rate = 0.0
    delay_s: Annotated[float, Field(ge=0, le=3600)] = 0.0
    delay_rate: Rate = 1.0
    replicate_secret: Annotated[str | None, Field(pattern=r"^whsec_[A-Za-z0-9+/=]+$")] = None


@dataclass(slots=True)
class Delivery:
    """One webhook due at `due`: what it is about, which event, and how it is rendered."""

    job: Job
    url: str
    render: Render
    event: Event = "completed"
    attempts: list[int] = field(default_factory=list)  # HTTP status per attempt (0: no answer)
    dropped: bool = False
    delayed: bool = False


def _b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


class HookSender:
    """Schedules, signs and sends the simulator's webhooks."""

    def __init__(self, clock: Clock, rng: Any) -> None:
        self.clock = clock
        self.rng = rng
        self.faults = HookFaults()
        self.replicate_secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
        self._fal_key = Ed25519PrivateKey.generate()
        self._heap: list[tuple[float, int, Delivery]] = []
        self._seq = itertools.count()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._client: LeanPost | None = None
        self.sent: list[dict[str, Any]] = []  # the delivery log: GET /_sim/webhooks
        self._finals: dict[str, asyncio.Event] = {}  # job id -> set once its final delivery has been sent

    def configure(self, faults: HookFaults) -> None:
        self.faults = faults
        if faults.replicate_secret:
            self.replicate_secret = faults.replicate_secret

    def reset(self) -> None:
        self._heap.clear()
        self.sent.clear()
        for final in self._finals.values():
            final.set()
        self._finals.clear()
        self.faults = HookFaults(replicate_secret=self.replicate_secret)

    def jwks(self) -> dict[str, Any]:
        raw = self._fal_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        return {"keys": [{"kty": "OKP", "crv": "Ed25519", "x": _b64url(raw), "kid": "sim-1", "use": "sig"}]}

    # -- scheduling ------------------------------------------------------------------------------------

    def schedule(self, job: Job, url: str, render: Render, event: Event = "completed") -> None:
        """Deliver `completed` once `job` has ended (its timeline is fixed at submit; a cancel only moves the end
        earlier, and a cancelled job's webhook then simply comes at the planned end), `start` at once."""
        due = self.clock() if event == "start" else max(job.ended_at(), self.clock())
        if event == "completed":
            self._finals.setdefault(job.id, asyncio.Event())
        self._push(due, Delivery(job, url, render, event))
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())
        elif self._wake is not None:
            self._wake.set()

    def _push(self, due: float, delivery: Delivery) -> None:
        heapq.heappush(self._heap, (due, next(self._seq), delivery))

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            self._wake.clear()
            now = self.clock()
            while self._heap and self._heap[0][0] <= now:
                _, _, delivery = heapq.heappop(self._heap)
                if delivery.event == "completed" and delivery.job.phase(now) not in TERMINAL:  # not yet: its
                    # end moved (a retried RunPod job)
                    self._push(delivery.job.ended_at(), delivery)
                    continue
                asyncio.get_running_loop().create_task(self._deliver(delivery))
            timeout = (self._heap[0][0] - now) if self._heap else None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):  # (not offload.eventloop.within: the simulator stands alone)
                    await self._wake.wait()

    async def _deliver(self, d: Delivery) -> None:
        f = self.faults
        if f.delay_s > 0 and (f.delay_rate >= 1 or self.rng.random() < f.delay_rate):
            d.delayed = True
            await asyncio.sleep(f.delay_s)
        if f.drop_rate > 0 and self.rng.random() < f.drop_rate:
            d.dropped = True
            self._log(d, copies=0)
            return
        copies = 2 if f.duplicate_rate > 0 and self.rng.random() < f.duplicate_rate else 1
        reorder = f.reorder_rate > 0 and self.rng.random() < f.reorder_rate
        message_id = "msg_" + secrets.token_hex(12)  # a duplicate is the same message delivered twice
        if d.event == "start":
            if reorder:  # overtaken by the final delivery: it arrives after the job ended and after that
                # delivery was answered (a slow receiver or a retried final must not let the start pass it)
                await asyncio.sleep(max(0.0, d.job.ended_at() - self.clock()) + REORDER_LAG_S)
                final = self._finals.get(d.job.id)
                if final is not None:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(REORDER_WAIT_S):
                            await final.wait()
            body = orjson.dumps(d.render(d.job.created))
            for _ in range(copies):
                await self._send(d, body, message_id)
            self._log(d, copies=copies, reordered=reorder)
            return
        body = orjson.dumps(d.render(self.clock()))
        for _ in range(copies):
            await self._send(d, body, message_id)
        if reorder:  # a stale "still running" event arriving after the final one
            job = d.job
            stale = job.started if job.started < job.ended_at() else job.created
            await self._send(d, orjson.dumps(d.render(stale)), "msg_" + secrets.token_hex(12))
        self._log(d, copies=copies, reordered=reorder)

    async def _send(self, d: Delivery, body: bytes, message_id: str) -> None:
        if self._client is None:  # not aiohttp: see sender.py
            self._client = LeanPost(limit=MAX_CONNECTIONS, timeout_s=10.0, agent="offload-sim-webhooks")
        for attempt in range(RETRIES + 1):
            headers = {"content-type": "application/json", **self._sign(d.job, body, message_id)}
            try:
                status = await self._client.post(d.url, body, headers)
                d.attempts.append(status)
                if status < 500:
                    return
            except (SendError, TimeoutError):
                d.attempts.append(0)
            if attempt < RETRIES:
                await asyncio.sleep(RETRY_PAUSE_S)

    def _sign(self, job: Job, body: bytes, message_id: str) -> dict[str, str]:
        if job.family == "replicate":
            stamp = datetime.fromtimestamp(int(time.time()), UTC)
            signature = Webhook(self.replicate_secret).sign(message_id, stamp, body.decode())
            return {
                "webhook-id": message_id,
                "webhook-timestamp": str(int(stamp.timestamp())),
                "webhook-signature": signature,
            }
        if job.family == "fal":
            seconds = str(int(time.time()))
            message = "\n".join([job.id, FAL_USER_ID, seconds, hashlib.sha256(body).hexdigest()]).encode()
            return {
                "x-fal-webhook-request-id": job.id,
                "x-fal-webhook-user-id": FAL_USER_ID,
                "x-fal-webhook-timestamp": seconds,
                "x-fal-webhook-signature": self._fal_key.sign(message).hex(),
            }
        return {}  # RunPod: no signature; the URL is the only secret

    def _log(self, d: Delivery, *, copies: int, reordered: bool = False) -> None:
        if d.event == "completed" and (final := self._finals.pop(d.job.id, None)) is not None:
            final.set()
        self.sent.append(
            {
                "job": d.job.id,
                "family": d.job.family,
                "event": d.event,
                "ended": d.job.ended_at(),
                "sent_at": self.clock(),
                "dropped": d.dropped,
                "delayed": d.delayed,
                "copies": copies,
                "reordered": reordered,
                "statuses": list(d.attempts),
            }
        )

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._client is not None:
            await self._client.aclose()
