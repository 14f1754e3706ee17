"""The file sweep deletes a job's files when its record is gone, which proves nothing when the job store is not the
one the files were written under. Before, a server pointed at an empty store (or a failed-over one that lost its
data) deleted every live input older than the upload grace in one pass. Now a pass deletes only while the store's
identity (`offload:store-id`) matches the marker in the bucket (`_offload/store-id`), and then at most a tenth of a
listing per pass, saying so.

Real S3 (rclone), real Valkeys (the session's, and the test's own as the "other" store), the real server's
maintenance loop for the server case.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import orjson
import pytest
import test_storage
from support.s3server import RcloneS3
from support.server_helpers import server
from support.servers import ValkeyServer

from offload import AsyncClient, File
from offload.autoscale.instances import read_events
from offload.connection import connect
from offload.queue import keyspace
from offload.queue.keyspace import STORE_ID
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.server.file_sweep import FileSweep
from offload.storage.namespace import STORE_MARKER
from offload.storage.s3 import S3Storage

bucket, storage = test_storage.bucket, test_storage.storage
LATER = 7200  # the sweep's clock this far ahead: every file is past the upload grace


def objects(s3: RcloneS3, bucket: str) -> set[str]:
    listing = s3.client().list_objects_v2(Bucket=bucket)
    return {o["Key"] for o in listing.get("Contents", [])}


@pytest.fixture
async def home(valkey_url: str) -> AsyncIterator[QueueStore]:
    """The job store the files were written under."""
    redis = await connect(valkey_url)
    yield QueueStore(redis)
    await redis.aclose()


@pytest.fixture
async def other(own_valkey: ValkeyServer) -> AsyncIterator[QueueStore]:
    """Another job store: empty, or one with an identity of its own."""
    redis = await connect(own_valkey.url)
    yield QueueStore(redis)
    await redis.aclose()


async def with_inputs(url: str, storage: S3Storage, queue: str, n: int) -> list[str]:
    async with AsyncClient(url, storage=storage) as client:
        return [await client.enqueue(queue, {"f": File(f"input {i}".encode())}) for i in range(n)]


def sweep(storage: S3Storage, store: QueueStore, told: list[str] | None = None) -> FileSweep:
    async def alert(subject: str, message: str) -> None:
        if told is not None:
            told.append(message)

    return FileSweep(storage, store, grace_s=3600, clock=lambda: time.time() + LATER, alert=alert)


def test_a_server_pointed_at_an_empty_store_deletes_no_input(
    valkey_url: str, own_valkey: ValkeyServer, s3: RcloneS3, bucket: str
) -> None:
    """The files were written, and the sweep ran once, under the home store. A server then starts against an empty
    store to which producers go on enqueueing (so it knows the queue): its sweep deletes nothing and raises a
    `file_sweep` alert (recorded in that store's event journal)."""
    settings = {**s3.settings(bucket), "upload_grace_s": 0.01}

    async def before() -> set[str]:
        redis = await connect(valkey_url)
        s = await storage_for(s3, bucket)
        try:
            await with_inputs(valkey_url, s, "gpu", 5)
            assert await sweep(s, QueueStore(redis)).run_once() == 0  # binds the store: nothing is orphaned
            return objects(s3, bucket)
        finally:
            await s.aclose()
            await redis.aclose()

    kept = asyncio.run(before()) - {STORE_MARKER}
    assert len(kept) == 5

    async def new_producer_job() -> None:
        redis = await connect(own_valkey.url)
        await QueueStore(redis).enqueue("gpu", JobSpec(input={"after": "the switch"}))
        await redis.aclose()

    asyncio.run(new_producer_job())
    with server(own_valkey.url, settings):
        alerts = swept(own_valkey.url, lambda: not kept <= objects(s3, bucket))
    assert kept <= objects(s3, bucket), "the server's sweep deleted live inputs"
    assert alerts, "the server's sweep raised no file_sweep alert within 30 s"
    assert "file sweep stopped, nothing deleted" in alerts[0]["message"] and "has no identity" in alerts[0]["message"]


def swept(url: str, deleted: Callable[[], bool]) -> list[dict[str, str]]:
    """The `file_sweep` alerts of the store at `url`, once there is one or `deleted()` (within 30 s)."""

    async def go() -> list[dict[str, str]]:
        redis = await connect(url)
        try:
            deadline = time.monotonic() + 30
            while True:
                found = [e for e in await read_events(redis) if e.get("alert") == "file_sweep"]
                if found or deleted() or time.monotonic() > deadline:
                    return found
                await asyncio.sleep(0.1)
        finally:
            await redis.aclose()

    return asyncio.run(go())


async def storage_for(s3: RcloneS3, bucket: str) -> S3Storage:
    from offload.storage import create_storage

    made = create_storage(s3.settings(bucket, max_attempts=1))
    assert isinstance(made, S3Storage)
    return made


async def test_a_store_with_another_identity_deletes_nothing(
    valkey_url: str, storage: S3Storage, home: QueueStore, other: QueueStore, s3: RcloneS3, bucket: str
) -> None:
    """A failed-over or restored store that is another store (its own identity), knowing the queue but none of the
    jobs: nothing deleted, neither identity rewritten, the operator told which two disagree."""
    await with_inputs(valkey_url, storage, "gpu", 4)
    assert await sweep(storage, home).run_once() == 0
    ours = await home.redis.get(STORE_ID)
    await other.redis.set(STORE_ID, "another-store")
    await other.enqueue("gpu", JobSpec(input=1))
    kept = objects(s3, bucket)
    told: list[str] = []
    assert await sweep(storage, other, told).run_once() == 0
    assert objects(s3, bucket) == kept
    assert told and "the job store is another-store" in told[0] and f"names store {ours}" in told[0]
    assert orjson.loads(await storage.get_bytes(STORE_MARKER))["store_id"] == ours
    assert await other.redis.get(STORE_ID) == "another-store"


async def test_an_empty_store_facing_a_bound_bucket_is_not_given_an_identity(
    valkey_url: str, storage: S3Storage, home: QueueStore, other: QueueStore, s3: RcloneS3, bucket: str
) -> None:
    """The bucket names a store; the empty store has no id: it stays without one (every pass refuses, loudly,
    until an operator binds it), instead of being given a fresh id that would only mismatch."""
    await with_inputs(valkey_url, storage, "gpu", 3)
    assert await sweep(storage, home).run_once() == 0
    await other.enqueue("gpu", JobSpec(input=1))
    kept = objects(s3, bucket)
    told: list[str] = []
    for _ in range(2):
        assert await sweep(storage, other, told).run_once() == 0
    assert objects(s3, bucket) == kept and len(told) == 2
    assert await other.redis.get(STORE_ID) is None


async def test_the_right_store_deletes_at_most_a_tenth_of_a_listing_per_pass(
    valkey_url: str, storage: S3Storage, home: QueueStore, s3: RcloneS3, bucket: str
) -> None:
    """25 inputs, 20 of their jobs purged: a pass deletes at most ceil(25 / 10) = 3 of them, says how many are
    left, and the next passes go on where it stopped until all 20 are gone; the 5 live jobs keep theirs."""
    ids = await with_inputs(valkey_url, storage, "gpu", 25)
    live = set(ids[:5])
    for job_id in ids[5:]:
        await home.redis.delete(keyspace.job("gpu", job_id))  # the record gone, as a purge or an expiry leaves it
    told: list[str] = []
    pass_sizes: list[int] = []
    sweeper = sweep(storage, home, told)
    for _ in range(20):
        deleted = await sweeper.run_once()
        if not deleted:
            break
        pass_sizes.append(deleted)
    assert pass_sizes[0] == 3 and max(pass_sizes) == 3 and sum(pass_sizes) == 20, pass_sizes
    assert "20 of 25 listed files belong to jobs the job store does not know" in told[0]
    left = {k for k in objects(s3, bucket) if k != STORE_MARKER}
    assert len(left) == 5 and all(any(job_id.split(":")[1] in k for job_id in live) for k in left)
