"""`--faults hostile` (with `--webhooks`, which runs the `offload server`): hostile clients at the server while
the run goes on, all from the address the simulator's webhooks and the operator's own requests come from.

Every `hostile_every` seconds (mean) one of: a burst of bad keys past the failed-auth limit, each followed by a
request with the operator's valid admin key from the same address; or a body trickled one byte every 0.2 s with a
valid producer key. The checker's invariants: `valid_key_refused` (a valid key answered 429 or 408: a
lockout), `bad_keys_not_limited` (a burst never reached 429 although more than the limit of its bad keys were
refused within one failure window: the limit does not act; a burst slowed past the window by the store faults or
a loaded machine, or answered 5xx in an outage, proves nothing and counts as `undecided`), `loris_not_cut` (a
trickled body not answered 408 within the server's body deadline plus a grace). Webhooks answered 429 show in the
run's `webhooks` summary (`answered_200` against `sent`).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import select
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import httpx

from bench import web
from bench.chaos.loops import FaultLoop
from offload.server.state import ServerOptions

if TYPE_CHECKING:
    from bench.chaos.faults import Schedule

ADMIN_KEY = "chaos-admin-" + secrets.token_hex(16)  # the server's OFFLOAD_ADMIN_KEY for the run
BURST = 30  # bad keys per burst: past the server's default limit
LIMIT = ServerOptions.auth_fail_limit  # the run's server keeps the defaults
WINDOW_S = ServerOptions.auth_fail_window_s
BODY_TIMEOUT_S = 3.0  # the server's --body-timeout in a hostile run
LORIS_GRACE_S = 15.0


class Hostile(FaultLoop):
    def __init__(self, schedule: Schedule, url: str, queue: str, quiet: asyncio.Lock) -> None:
        """`quiet`: held through each action (hooks.Server's: no restart cuts a burst or a trickle short)."""
        super().__init__(schedule)
        self.url, self.queue, self.quiet = url, queue, quiet

    async def act(self) -> None:
        await self._quietly(self._guess if self.schedule.rng.random() < 0.5 else self._loris)

    async def _quietly(self, action: Callable[[], Awaitable[None]]) -> None:
        async with self.quiet:
            await action()

    async def _guess(self) -> None:
        bad = f"ofk_{secrets.token_hex(6)}_{secrets.token_urlsafe(12)}"
        statuses: list[int] = []
        valid: list[int] = []
        counted: list[float] = []  # when each bad key was answered 401 or 429 (the server counted it)
        async with web.async_client(base_url=self.url, timeout=30) as c:
            for _ in range(BURST):
                with contextlib.suppress(httpx.HTTPError):
                    statuses.append((await c.get("/v1/queues", headers={"Authorization": f"Bearer {bad}"})).status_code)
                    if statuses[-1] in (401, 429):
                        counted.append(time.monotonic())
                with contextlib.suppress(httpx.HTTPError):
                    r = await c.get("/v1/queues", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
                    valid.append(r.status_code)
        # the limit must have acted if more than LIMIT failures fell within one window from the first
        decided = len(counted) > LIMIT and counted[LIMIT] - counted[0] < WINDOW_S
        self.schedule.note("hostile_guess", "server", bad=_count(statuses), valid=_count(valid), decided=decided)

    async def _loris(self) -> None:
        producer = await self._producer_key()
        began = time.monotonic()
        answer = await asyncio.to_thread(self._trickle, producer, began + BODY_TIMEOUT_S + LORIS_GRACE_S)
        status = int(answer[9:12]) if answer.startswith(b"HTTP/1.1 ") and answer[9:12].isdigit() else None
        self.schedule.note("hostile_loris", "server", status=status, seconds=round(time.monotonic() - began, 2))

    async def _producer_key(self) -> str:
        if not hasattr(self, "_key"):
            async with web.async_client(base_url=self.url, timeout=30) as c:
                for _ in range(30):  # a key the replica lacks is refused with 503 (durability): made again
                    r = await c.post(
                        "/v1/keys",
                        json={"scope": "producer", "queues": [self.queue], "name": "chaos hostile"},
                        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                    )
                    if r.status_code != 503:
                        break
                    await asyncio.sleep(1)
                r.raise_for_status()
                self._key: str = r.json()["token"]
        return self._key

    def _trickle(self, token: str, until: float) -> bytes:
        host, port = self.url.removeprefix("http://").split(":")
        head = (
            f"POST /v1/queues/{self.queue}/jobs HTTP/1.1\r\nHost: chaos\r\nAuthorization: Bearer {token}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"
        )
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(head.encode())
            while time.monotonic() < until:
                if select.select([sock], [], [], 0.2)[0]:
                    with contextlib.suppress(OSError):
                        return sock.recv(4096)
                    return b""
                with contextlib.suppress(OSError):
                    sock.sendall(b" ")
        return b""


def _count(statuses: list[int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in statuses:
        out[str(s)] = out.get(str(s), 0) + 1
    return out


def check(timeline: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """The summary part and the findings of `--faults hostile` (see the module docstring)."""
    guesses = [e for e in timeline if e["kind"] == "hostile_guess"]
    lorises = [e for e in timeline if e["kind"] == "hostile_loris"]
    if not guesses and not lorises:
        return {}, []
    findings = []
    refused = sum(e["valid"].get("429", 0) + e["valid"].get("408", 0) for e in guesses)
    if refused:
        findings.append(f"hostile: a valid key was refused {refused} times after bursts of bad keys")
    unlimited = sum(1 for e in guesses if not e["bad"].get("429") and e.get("decided", True))
    undecided = sum(1 for e in guesses if not e["bad"].get("429") and not e.get("decided", True))
    if unlimited:
        findings.append(f"hostile: {unlimited} burst(s) of {BURST} bad keys never got 429")
    not_cut = [e for e in lorises if e["status"] != 408 or e["seconds"] > BODY_TIMEOUT_S + LORIS_GRACE_S]
    if not_cut:
        findings.append(f"hostile: {len(not_cut)} trickled body(ies) not cut with 408: {not_cut[:3]}")
    summary = {
        "hostile": {"guess_bursts": len(guesses), "undecided": undecided, "trickled_bodies": len(lorises)},
        "valid_key_refused": refused,
        "bad_keys_not_limited": unlimited,
        "loris_not_cut": len(not_cut),
    }
    return summary, findings
