"""A host whose clock the result storage refuses starts no new paid work until the storage takes it again.

S3 refuses a request signed more than 15 minutes off its own clock, and boto3 does not correct for that
(boto/boto3#1252): a worker on such a host would pay for jobs whose outputs it cannot store. One gate per worker
process. A refusal (`ClockRefused`, from the start's probe or from storing an output) closes it, said in one
error line (again each minute while it stays closed); while it is closed the process's workers claim nothing and
send no new submission. Work already paid for goes on: a finished remote job's output is stored again and, past
`poll_timeout`, the job goes back with its remote id for a worker whose clock the storage takes. A probe (a
signed HEAD of a key in the queue's own namespace) asks again, soon and then every `every_s`, and opens the gate
once the storage answers anything but that refusal (another failure says nothing about this host's clock).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from offload.backoff import compute_backoff
from offload.eventloop import within
from offload.storage import ClockRefused

log = logging.getLogger("offload.worker")
PROBE_EVERY_S = 30.0
FIRST_PROBE_S = 1.0
LOUD_EVERY_S = 60.0
START_PROBE_S = 5.0  # a storage down at the start delays no worker longer: the first output stored says so
WHAT = "no claim or submission starts until the storage takes this host's clock"


class StorageGate:
    """`open` while the storage takes this host's clock; `refused(exc)` closes it until `probe()` passes. Without
    a probe the gate opens again after `every_s` (the next output stored is the probe)."""

    def __init__(self, probe: Callable[[], Awaitable[object]] | None = None, every_s: float = PROBE_EVERY_S) -> None:
        self._probe = probe
        self.every_s = every_s
        self._open = asyncio.Event()
        self._open.set()
        self._said = 0.0
        self._watch: asyncio.Task[None] | None = None

    @property
    def open(self) -> bool:
        return self._open.is_set()

    async def wait_open(self) -> None:
        await self._open.wait()

    def refused(self, exc: ClockRefused) -> None:
        now = time.monotonic()
        if self.open or now - self._said >= LOUD_EVERY_S:
            self._said = now
            log.error("%s; %s", exc, WHAT)
        if self.open:
            self._open.clear()
            self._watch = asyncio.create_task(self._until_taken(), name="storage clock probe")

    async def check(self) -> None:
        """Ask now (a worker's start): closed if the storage refuses this host's clock."""
        if self._probe is not None and (refusal := await self._ask(self._probe, START_PROBE_S)) is not None:
            self.refused(refusal)

    @staticmethod
    async def _ask(probe: Callable[[], Awaitable[object]], timeout: float | None = None) -> ClockRefused | None:
        """The probe's refusal of this host's clock, or None for any other answer (an outage or a setting says
        nothing about the clock: the first output stored says what it is)."""
        try:
            await within(probe(), timeout)
        except ClockRefused as exc:
            return exc
        except Exception as exc:
            log.debug("storage clock probe: %s", exc)
        return None

    async def _until_taken(self) -> None:
        tries = 0
        while True:
            tries += 1
            await asyncio.sleep(compute_backoff(tries, base=min(FIRST_PROBE_S, self.every_s), cap=self.every_s))
            if self._probe is None or (refusal := await self._ask(self._probe)) is None:
                break
            self.refused(refusal)
        log.warning("the storage takes this host's clock again: claims and submissions resume")
        self._open.set()

    async def aclose(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
