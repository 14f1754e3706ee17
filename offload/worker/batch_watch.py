"""One provider batch as a dispatch worker waits for it: one poll loop per batch, whatever the number of its jobs
this worker holds, backing off (offload.backoff) from `FIRST_POLL_S` to the backend's `batch_poll_interval_s`.
Once the batch has ended its results are read once and each waiting job takes its own line. A batch whose every
line this worker holds is cancelled by the operator is cancelled at the provider (the lines that ran are paid;
the rest come back canceled). Also how a lost batch create is looked for (`find_pack`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from offload.backends.base import BackendError, NotFound, Transient
from offload.backends.batch import BatchClient, LineResult
from offload.backends.openai_batch import OpenAIBatch
from offload.backoff import compute_backoff
from offload.queue.batch_packs import PackRecord
from offload.worker.job_run import JobRun

log = logging.getLogger("offload.worker")
FIRST_POLL_S = 1.0
TRANSIENT_POLLS = 30  # transient failures in a row that fail the batch's jobs (their remote id kept: re-polled)
# A pack's create time is this host's clock, a listing the provider's: a lost create is looked for an hour either side.
LIST_SKEW_S = 3600.0


class BatchWatch:
    """The wait for one batch's results; `members` are this worker's runs waiting for it (by job id)."""

    def __init__(self, client: BatchClient, batch_id: str, poll_cap: float) -> None:
        self.client, self.batch_id, self.poll_cap = client, batch_id, poll_cap
        self.members: dict[str, JobRun] = {}
        self.done: asyncio.Future[dict[str, LineResult]] = asyncio.get_running_loop().create_future()
        self.cancel_sent = False
        self.task = asyncio.create_task(self._run(), name=f"batch {batch_id}")

    async def _run(self) -> None:
        try:
            self.done.set_result(await self._poll())
        except asyncio.CancelledError:
            if not self.done.done():
                self.done.cancel()
            raise
        except Exception as exc:
            if not self.done.done():
                self.done.set_exception(exc)

    async def _poll(self) -> dict[str, LineResult]:
        polls = transient = 0
        while True:
            try:
                status = await self.client.status(self.batch_id)
                transient = 0
                if status.ended:
                    return await self.client.results(self.batch_id)
                await self._cancel_if_unwanted(status.counts)
            except NotFound:
                raise
            except Transient:
                transient += 1
                if transient >= TRANSIENT_POLLS:
                    raise
            polls += 1
            await asyncio.sleep(compute_backoff(polls, base=FIRST_POLL_S, cap=self.poll_cap))

    async def _cancel_if_unwanted(self, counts: dict[str, int]) -> None:
        """Every line of the batch held here, and each of them cancelled by the operator: the batch is cancelled."""
        if self.cancel_sent or not self.members:
            return
        total = counts.get("total", sum(counts.values()))
        if len(self.members) >= total and all(run.cancel for run in self.members.values()):
            log.info("batch %s: every job in it is cancelled; cancelling the batch", self.batch_id)
            with contextlib.suppress(BackendError):
                await self.client.cancel(self.batch_id)
                self.cancel_sent = True


async def find_pack(client: BatchClient, rec: PackRecord, job_id: str, wait: float) -> str | None:
    """The batch a lost create of pack `rec` made, or None once it is proven absent. OpenAI's batches carry the
    pack id in their metadata: a listing answers. A Message Batch carries nothing of ours but its custom_ids,
    which only its results show: each batch created near the pack's time with its count is waited for until it
    ends (`wait`: the longest pause between polls) and its results name the job or not."""
    listed = await client.listing(rec.at - LIST_SKEW_S)
    if isinstance(client, OpenAIBatch):
        return next((b.batch_id for b in listed if b.tag == rec.pack), None)
    near = [b for b in listed if abs(b.created - rec.at) <= LIST_SKEW_S and b.total == rec.count]
    for b in near:
        if job_id in await _ended_results(client, b.batch_id, wait):
            return b.batch_id
    return None


async def _ended_results(client: BatchClient, batch_id: str, wait: float) -> dict[str, LineResult]:
    polls = 0
    started = time.monotonic()
    while not (await client.status(batch_id)).ended:
        polls += 1
        waited = time.monotonic() - started
        log.info("batch %s may hold a lost pack; waiting for it to end (%.0fs so far)", batch_id, waited)
        await asyncio.sleep(compute_backoff(polls, base=FIRST_POLL_S, cap=wait))
    return await client.results(batch_id)
