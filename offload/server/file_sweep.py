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

"Record gone" proves nothing when the job store is not the one the files were written under (a server pointed at an
empty store, a failover to a replica that lost its data, a flush): every live input would look orphaned. So a pass
deletes only when the store proves its identity: a random id in the store (`offload:store-id`) and a marker object
in the bucket naming it (`_offload/store-id`), both written when first seen together; a missing id or a marker that
names another store stops the sweep, loudly (an error line every pass, a `file_sweep` alert), until an operator
says which store is right (docs/how-to/files.md). And even then a pass deletes at most MAX_SHARE of the objects each
listing holds (at least one), resuming at the first file it left: a store that forgets every job at once costs a
tenth of a listing per pass, in plain sight (a warning and an alert), not every input in one pass.

This is done by the server for every backend alike rather than by an S3 lifecycle rule: a rule expires by age
under a prefix, while offload's retention is per job (and a purge is immediate). The sweep works through at most
`BATCH` objects per queue and round, resuming where it stopped, so a huge bucket costs a bounded amount per round.
Safe to run in several servers at once (deletes are idempotent; the identity is set with SET NX, and the marker
only ever names that one id).
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import orjson

from offload.clock import Clock
from offload.errors import JobNotFound
from offload.queue.keyspace import STORE_ID
from offload.queue.store import QueueStore
from offload.storage import ObjectNotFound, Storage
from offload.storage.inputs import COPIED, INPUTS, OUTPUTS, job_of_key
from offload.storage.namespace import STORE_MARKER, own_prefix

log = logging.getLogger("offload.server")
BATCH = 1000
MAX_SHARE = 0.1  # of a listing's objects, the most one pass deletes (rounded up)
UNREADABLE = "<unreadable>"  # a marker that is not ours to read: never taken for a match


@dataclass
class FileSweep:
    storage: Storage
    store: QueueStore
    grace_s: float
    clock: Clock = time.time
    # (subject, message) for operators: app.py sends it to the `alerts:` targets, once per subject and cooldown
    alert: Callable[[str, str], Awaitable[object]] | None = None
    _cursors: dict[str, str] = field(default_factory=dict)

    async def run_once(self) -> int:
        """One round over every queue; how many files were deleted (none when the store is not proven)."""
        if not await self._same_store():
            return 0
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
        cursor = listing[-1].key if len(listing) == BATCH else ""  # wrap around at the end
        budget = math.ceil(len(listing) * MAX_SHARE)
        cutoff = self.clock() - self.grace_s
        alive: dict[str, bool] = {}
        deleted = orphans = 0
        previous = after
        for obj in listing:
            job_id = None if skip is not None and obj.key.startswith(skip) else job_of_key(queue, obj.key)
            if job_id is not None and obj.modified <= cutoff:
                if job_id not in alive:
                    alive[job_id] = await self._exists(job_id)
                if not alive[job_id]:
                    orphans += 1
                    if deleted < budget:
                        await self.storage.delete(obj.key)
                        deleted += 1
                    elif orphans == deleted + 1:  # the first one left: the next pass starts here
                        cursor = previous
            previous = obj.key
        skew = self.clock() - time.time()  # an injected clock (tests) moves the upload cutoff too
        aborted = await self.storage.abort_uploads(prefix, self.grace_s - skew)
        if deleted or aborted:
            log.info("file sweep: %s: deleted %d file(s) of finished-and-forgotten jobs, aborted %d upload(s)",
                     prefix, deleted, aborted)  # fmt: skip
        self._cursors[prefix] = cursor
        if orphans > deleted:
            await self._bounded(prefix, len(listing), orphans, deleted)
        return deleted

    async def _bounded(self, prefix: str, listed: int, orphans: int, deleted: int) -> None:
        """More orphans than a pass may delete: a warning, and an alert when they are most of the listing (a store
        that forgot its jobs looks like that; a small deployment's routine expiry does not)."""
        message = (
            f"file sweep: {prefix}: {orphans} of {listed} listed files belong to jobs the job store does not know; "
            f"deleted {deleted} (at most {MAX_SHARE:.0%} of a listing per pass), the rest wait for the next passes. "
            "Expected after a large purge or expiry; otherwise check that this server uses the right job store"
        )
        log.warning("%s", message)
        if 2 * orphans > listed:
            await self._tell(prefix, message)

    async def _same_store(self) -> bool:
        """Whether the job store is the one this bucket's files were written under (see the module docstring)."""
        redis = self.store.redis
        ours = await redis.get(STORE_ID)
        marker = await self._marker()
        if ours is None and marker is None:  # a first start: the two are seen together for the first time
            await redis.set(STORE_ID, secrets.token_hex(16), nx=True)
            ours = await redis.get(STORE_ID)
        if ours is not None and marker is None:  # a store that has its id, and a bucket new to it
            await self.storage.put_json(STORE_MARKER, {"store_id": ours, "written_at": self.clock()})
            marker = await self._marker()
        if ours is not None and marker == ours:
            return True
        if ours is None:
            why = (
                f"the job store has no identity ({STORE_ID}) while the bucket's {STORE_MARKER} names store "
                f"{marker}: an empty, flushed or failed-over store"
            )
        else:
            why = f"the job store is {ours} while the bucket's {STORE_MARKER} names store {marker}"
        message = (
            f"file sweep stopped, nothing deleted: {why}, so a job record it lacks proves nothing. If this is the "
            "right store, see docs/how-to/files.md for how to bind it to the bucket"
        )
        log.error("%s", message)
        await self._tell("store identity", message)
        return False

    async def _marker(self) -> str | None:
        """The store id the bucket's marker names; None when there is no marker."""
        try:
            doc = orjson.loads(await self.storage.get_bytes(STORE_MARKER))
        except ObjectNotFound:
            return None
        except orjson.JSONDecodeError:
            return UNREADABLE
        named = doc.get("store_id") if isinstance(doc, dict) else None
        return named if isinstance(named, str) else UNREADABLE

    async def _tell(self, subject: str, message: str) -> None:
        if self.alert is not None:
            try:
                await self.alert(subject, message)
            except Exception as exc:  # an alert target away must not stop the maintenance loop
                log.warning("file sweep: alert failed: %s", type(exc).__name__)

    async def _exists(self, job_id: str) -> bool:
        try:
            await self.store.get(job_id)
        except JobNotFound:
            return False
        return True
