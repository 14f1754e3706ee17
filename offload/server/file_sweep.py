"""Files expire with their job: the server's sweep deletes input, worker-output and copied provider files whose job
record is gone.

A job record disappears when its retention runs out or it is purged; its files must not outlive it (they are
the large part). Every file key names its job (`offload.storage.inputs`), so the sweep lists each queue's
`_in/`, `_out/` and `_files/` spaces (and its results, for provider files earlier versions copied beside
them), asks the job store which of those jobs still exist, and deletes the files of the others, but only files
older than `storage.upload_grace_s`: a file uploaded for a job that is not enqueued yet (the HTTP form, or a
client between its upload and its enqueue) has no record yet either. It also aborts multipart uploads older
than the grace under those spaces (a producer killed mid-upload), whose parts cost storage but are invisible
to listings. Result JSON documents stay: only files go.

This is done by the server for every backend alike rather than by an S3 lifecycle rule: a rule expires by age
under a prefix, while offload's retention is per job (and a purge is immediate). The sweep works through at most
`BATCH` objects per queue and round, resuming where it stopped, so a huge bucket costs a bounded amount per round.
Safe to run in several servers at once (deletes are idempotent).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from offload.errors import JobNotFound
from offload.queue.store import QueueStore
from offload.storage import Storage
from offload.storage.inputs import COPIED, INPUTS, OUTPUTS, job_of_key
from offload.storage.namespace import own_prefix

log = logging.getLogger("offload.server")
BATCH = 1000


@dataclass
class FileSweep:
    storage: Storage
    store: QueueStore
    grace_s: float
    clock: Callable[[], float] = time.time
    _cursors: dict[str, str] = field(default_factory=dict)

    async def run_once(self) -> int:
        """One round over every queue; how many files were deleted."""
        deleted = 0
        for queue in await self.store.queues():
            own = own_prefix(queue)
            for space in (INPUTS, OUTPUTS, COPIED):  # inputs, worker outputs and copied provider files
                deleted += await self._space(queue, own + space)
            # the whole namespace, a batch a round (the slow walk), for the copies earlier versions put among the
            # results; keys of offload's own `_` spaces are left to their walks above (one existence check each)
            deleted += await self._space(queue, own, skip=own + "_")
        return deleted

    async def _space(self, queue: str, prefix: str, skip: str | None = None) -> int:
        after = self._cursors.get(prefix, "")
        listing = await self.storage.list_objects(prefix, BATCH, after)
        self._cursors[prefix] = listing[-1].key if len(listing) == BATCH else ""  # wrap around at the end
        cutoff = self.clock() - self.grace_s
        alive: dict[str, bool] = {}
        deleted = 0
        for obj in listing:
            if skip is not None and obj.key.startswith(skip):
                continue
            job_id = job_of_key(queue, obj.key)
            if job_id is None or obj.modified > cutoff:
                continue
            if job_id not in alive:
                alive[job_id] = await self._exists(job_id)
            if not alive[job_id]:
                await self.storage.delete(obj.key)
                deleted += 1
        skew = self.clock() - time.time()  # an injected clock (tests) moves the upload cutoff too
        aborted = await self.storage.abort_uploads(prefix, self.grace_s - skew)
        if deleted or aborted:
            log.info("file sweep: %s: deleted %d file(s) of finished-and-forgotten jobs, aborted %d upload(s)",
                     prefix, deleted, aborted)  # fmt: skip
        return deleted

    async def _exists(self, job_id: str) -> bool:
        try:
            await self.store.get(job_id)
        except JobNotFound:
            return False
        return True
