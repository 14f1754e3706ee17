"""Files by reference, producer side: `File(...)` in an input is streamed to the real S3 server (rclone) and the job
carries a reference; every failure leaves neither a job nor an object behind."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import test_storage
from support.s3server import RcloneS3

from offload import AsyncClient, File
from offload.eventloop import within
from offload.files import REF_KEY, field_name, references_in
from offload.queue.keyspace import new_job_id
from offload.queue.store import QueueStore
from offload.server.file_sweep import FileSweep
from offload.storage.inputs import FileTooLarge, copied_prefix, inputs_prefix, job_of_key, outputs_prefix
from offload.storage.namespace import STORE_MARKER
from offload.storage.outputs import files_prefix
from offload.storage.s3 import S3Storage

# the servers and storage fixtures this module shares with test_storage (a module-scoped S3, a fresh bucket)
bucket, storage = test_storage.bucket, test_storage.storage
MiB = 1024 * 1024


@pytest.fixture
async def client(backend_url: str, storage: S3Storage) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(backend_url, storage=storage, max_file_bytes=64 * MiB) as c:
        yield c


def objects(s3: RcloneS3, bucket: str) -> list[str]:
    listing = s3.client().list_objects_v2(Bucket=bucket)
    return [o["Key"] for o in listing.get("Contents", [])]


def pending_uploads(s3: RcloneS3, bucket: str) -> list[Any]:
    return list(s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []))


async def queue_jobs(store: QueueStore, queue: str) -> int:
    stats = await store.stats(queue)
    return sum(stats.counts.values())


def write_random(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    with path.open("wb") as f:
        left = size
        while left:
            chunk = os.urandom(min(left, 4 * MiB))
            digest.update(chunk)
            f.write(chunk)
            left -= len(chunk)
    return digest.hexdigest()


async def test_file_anywhere_in_the_input_becomes_a_reference(
    client: AsyncClient, storage: S3Storage, s3: RcloneS3, bucket: str, tmp_path: Path
) -> None:
    big = tmp_path / "talk.mp3"
    big_sha = write_random(big, 20 * MiB + 123)  # multipart: three parts, the last one short
    stream = io.BytesIO(b"streamed bytes")
    stream.name = "notes.txt"
    job_input = {"audio": File(big), "lang": "en", "extra": [File(b"\x89PNG...", name="a.png"), File(stream)]}
    job_id = await client.enqueue("files", job_input)
    job = await client.get(job_id)
    refs = dict(references_in(job.input))
    assert set(refs) == {("audio",), ("extra", 0), ("extra", 1)}
    audio = refs[("audio",)]
    assert audio["size"] == 20 * MiB + 123 and audio["sha256"] == big_sha
    assert audio["content_type"] == "audio/mpeg"
    assert refs[("extra", 0)]["content_type"] == "image/png"
    assert refs[("extra", 1)]["sha256"] == hashlib.sha256(b"streamed bytes").hexdigest()
    assert job.input["lang"] == "en"
    for ref in refs.values():  # each under the job's own inputs prefix, byte-identical
        assert ref[REF_KEY].startswith(inputs_prefix(job_id))
        assert job_of_key("files", ref[REF_KEY]) == job_id
        body = s3.client().get_object(Bucket=bucket, Key=ref[REF_KEY])["Body"].read()
        assert hashlib.sha256(body).hexdigest() == ref["sha256"] and len(body) == ref["size"]
    assert pending_uploads(s3, bucket) == []


async def test_enqueue_many_and_a_duplicate_keeps_no_orphan(client: AsyncClient, s3: RcloneS3, bucket: str) -> None:
    ids = await client.enqueue_many("files", [{"f": File(b"one")}, {"input": {"f": File(b"two")}, "priority": 5}])
    assert len(set(ids)) == 2 and len(objects(s3, bucket)) == 2
    first = await client.enqueue("files", {"f": File(b"x")}, idempotency_key="same")
    again = await client.enqueue("files", {"f": File(b"y")}, idempotency_key="same")
    assert again == first
    keys = objects(s3, bucket)
    assert len(keys) == 3 and all(job_of_key("files", k) in (*ids, first) for k in keys)


async def test_missing_file_enqueues_nothing(client: AsyncClient, s3: RcloneS3, bucket: str, tmp_path: Path) -> None:
    store = await client.store()
    with pytest.raises(ValueError, match=r"nope\.wav: not a readable file"):
        await client.enqueue("bad", {"ok": File(b"first"), "audio": File(tmp_path / "nope.wav")})
    assert await queue_jobs(store, "bad") == 0
    assert objects(s3, bucket) == []  # the file uploaded before the missing one was removed


async def test_oversized_file_is_refused_before_and_while_uploading(
    client: AsyncClient, s3: RcloneS3, bucket: str, tmp_path: Path
) -> None:
    store = await client.store()
    big = tmp_path / "big.bin"
    with big.open("wb") as f:
        f.truncate(64 * MiB + 1)
    with pytest.raises(FileTooLarge, match=r"input\.big: .*over the 67108864-byte limit"):
        await client.enqueue("bad", {"big": File(big)})
    # a stream has no size up front: it is cut off at the limit, and the started multipart upload aborted

    class Endless(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def readinto(self, buffer: Any) -> int:
            buffer[:] = b"\0" * len(buffer)
            return len(buffer)

    with pytest.raises(FileTooLarge, match=r"input\.stream\[0\]: larger than"):
        await client.enqueue("bad", {"stream": [File(io.BufferedReader(Endless()))]})
    assert await queue_jobs(store, "bad") == 0
    assert objects(s3, bucket) == [] and pending_uploads(s3, bucket) == []


async def test_upload_cut_off_midway_leaves_nothing(client: AsyncClient, s3: RcloneS3, bucket: str) -> None:
    class Broken(io.RawIOBase):
        """A source that dies after 20 MiB (a network share going away, a disk error)."""

        sent = 0

        def readable(self) -> bool:
            return True

        def readinto(self, buffer: Any) -> int:
            if self.sent >= 20 * MiB:
                raise OSError(5, "Input/output error")
            n = min(len(buffer), 20 * MiB - self.sent)
            buffer[:n] = b"x" * n
            self.sent += n
            return n

    store = await client.store()
    with pytest.raises(OSError, match="Input/output error"):
        await client.enqueue("bad", {"video": File(io.BufferedReader(Broken()), name="v.mp4")})
    assert await queue_jobs(store, "bad") == 0
    assert objects(s3, bucket) == [] and pending_uploads(s3, bucket) == []


async def test_cancelled_upload_leaves_nothing(client: AsyncClient, s3: RcloneS3, bucket: str) -> None:
    """The caller gives up (a timeout, Ctrl-C in asyncio code) while the bytes are still flowing."""
    started = asyncio.Event()
    loop = asyncio.get_running_loop()

    class Slow(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def readinto(self, buffer: Any) -> int:
            loop.call_soon_threadsafe(started.set)
            buffer[:] = b"s" * len(buffer)
            return len(buffer)

    store = await client.store()
    task = asyncio.create_task(client.enqueue("bad", {"f": File(io.BufferedReader(Slow()))}))
    await within(started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await queue_jobs(store, "bad") == 0
    assert objects(s3, bucket) == [] and pending_uploads(s3, bucket) == []


async def test_enqueue_failure_removes_the_upload(
    backend_url: str, storage: S3Storage, s3: RcloneS3, bucket: str
) -> None:
    """Uploaded, then the enqueue is refused (input over the payload limit with its reference): no file stays."""
    async with AsyncClient(backend_url, storage=storage, max_payload=300) as c:
        with pytest.raises(Exception, match="over the limit of 300 bytes"):
            await c.enqueue("bad", {"f": File(b"data"), "pad": "p" * 200})
        assert await queue_jobs(await c.store(), "bad") == 0
    assert objects(s3, bucket) == []


async def test_bad_options_fail_before_anything_is_uploaded(client: AsyncClient, s3: RcloneS3, bucket: str) -> None:
    with pytest.raises(Exception, match="priority must be"):
        await client.enqueue("bad", {"f": File(b"data")}, priority=5000)
    assert objects(s3, bucket) == []


def test_key_layout_names_the_job() -> None:
    job_id = "gpu:0190a1b2c3d4e5f6a7b8c9d0e1f2"
    assert inputs_prefix(job_id) == "results/gpu:_in/0190a1b2c3d4e5f6a7b8c9d0e1f2/"
    assert outputs_prefix(job_id) == "results/gpu:_out/0190a1b2c3d4e5f6a7b8c9d0e1f2/"
    assert job_of_key("gpu", inputs_prefix(job_id) + "0-a.wav") == job_id
    assert job_of_key("gpu", outputs_prefix(job_id) + "0-a.png") == job_id
    assert job_of_key("gpu", "results/gpu:0190a1b2c3d4e5f6a7b8c9d0e1f2.json") is None
    copied = files_prefix(f"results/{job_id}.json")  # the default output key's copies: one flat space
    assert copied == "results/gpu:_files/0190a1b2c3d4e5f6a7b8c9d0e1f2~" == copied_prefix(job_id)
    assert job_of_key("gpu", copied + "r1-0-a.png") == job_id
    assert job_of_key("gpu", copied) is None  # a prefix, not a file
    assert job_of_key("gpu", "results/gpu:_files/0190a1b2c3d4e5f6a7b8c9d0e1f2") is None  # no `~`: no job named
    assert job_of_key("gpu", "results/gpu:_files/a.b~r1-0-x~y.png") == "gpu:a.b"  # ids may hold dots, never `~`
    assert job_of_key("gpu", "results/gpu:0190a1b2c3d4e5f6a7b8c9d0e1f2/files/1/0-a.png") == job_id  # earlier layout
    assert job_of_key("gpu", "results/gpu:0190a1b2c3d4e5f6a7b8c9d0e1f2/files/") is None
    # other output keys keep their copies beside them, which name no job the sweep could mistake them for
    assert files_prefix("results/gpu:mine/x.json") == "results/gpu:mine/x/files/"
    assert files_prefix("results/gpu:_x.json") == "results/gpu:_x/files/"  # reserved, never a default key
    assert files_prefix("results/abc.json") == "results/abc/files/"  # a tutorial id (no queue)
    assert job_of_key("gpu", "results/gpu:mine/other.json") is None
    assert job_of_key("other", inputs_prefix(job_id) + "0-a.wav") is None
    assert job_of_key("gpu", "results/gpu:_in/../x") is None
    assert job_of_key("gpu", "results/gpu:_in/0190a1b2c3d4e5f6a7b8c9d0e1f2") is None  # a prefix, not a file
    assert field_name(("a", 0, "b")) == "input.a[0].b"


def test_file_source_types(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="path, bytes or a binary file object"):
        File(12)  # type: ignore[arg-type]
    assert File(tmp_path / "x.flac").content_type == "audio/flac"
    assert File(b"", name="n.json").content_type == "application/json"
    assert File(b"raw").content_type == "application/octet-stream"
    directory = File(tmp_path)
    with pytest.raises(ValueError, match="not a readable file"):
        directory.open()


async def test_inputs_without_files_never_touch_storage(backend_url: str) -> None:
    """No File in the input: enqueued exactly as before, and no storage is built (none is even configured)."""
    async with AsyncClient(backend_url) as c:
        job_id = await c.enqueue("plain", {"a": 1})
        ids = await c.enqueue_many("plain", [{"b": 2}])
        assert (await c.get(job_id)).input == {"a": 1} and len(ids) == 1
        assert c._storage is None


async def test_sweep_deletes_files_whose_job_is_gone(
    client: AsyncClient, storage: S3Storage, s3: RcloneS3, bucket: str
) -> None:
    """Retention or purge removes a record; the sweep then removes its files, keeping live jobs' files and
    fresh uploads (their enqueue may still be coming) and aborting old unfinished multipart uploads."""
    store = await client.store()
    live = await client.enqueue("sweep-live", {"f": File(b"keep me")})
    purged = await client.enqueue("sweep-gone", {"f": File(b"purge me"), "g": [File(b"and me")]})
    orphan = new_job_id("sweep-live")  # an upload whose producer died before enqueueing
    await storage.put_bytes(inputs_prefix(orphan) + "0-x.bin", b"orphan")
    outputs = outputs_prefix(purged) + "1/0-out.png"  # a GPU worker's output of the purged job
    await storage.put_bytes(outputs, b"png")
    await storage.put_bytes(files_prefix(f"results/{purged}.json") + "r1-0-copied.png", b"provider file")  # a copy
    await storage.put_bytes(f"results/{purged}/files/1/0-old.png", b"provider file")  # copied by an earlier version
    custom = "results/sweep-gone:mine~r1-0-x.png"  # a producer's own output key, whatever it looks like, stays
    await storage.put_bytes(custom, b"producer output")
    await storage.put_bytes(f"results/{purged}.json", b"{}")  # its result document stays
    multipart = s3.client().create_multipart_upload(Bucket=bucket, Key=inputs_prefix(orphan) + "1-big.bin")
    assert await store.purge("sweep-gone", "queued") == 1
    before = set(objects(s3, bucket))

    fresh = FileSweep(storage, store, grace_s=3600)  # everything is younger than the grace: nothing goes
    assert await fresh.run_once() == 0 and set(objects(s3, bucket)) == before | {STORE_MARKER}  # the store named
    assert len(pending_uploads(s3, bucket)) == 1

    checked: list[str] = []

    class Counted(FileSweep):
        async def _exists(self, job_id: str) -> bool:
            checked.append(job_id)
            return await super()._exists(job_id)

    later = Counted(storage, store, grace_s=3600, clock=lambda: time.time() + 7200)
    # the purged job's two inputs, its output and two copies, and the orphan: at most a tenth of each listing (at
    # least one) per pass, so the purged job's second input waits for the next pass
    assert await later.run_once() == 5
    # each job once per space its files are in: the whole-namespace walk leaves offload's own `_` spaces alone
    assert checked.count(live) == 1 and checked.count(purged) == 4, checked
    assert await later.run_once() == 1 and await later.run_once() == 0
    left = [k for k in objects(s3, bucket) if k != STORE_MARKER]
    assert f"results/{purged}.json" in left and custom in left
    assert all(job_of_key("sweep-live", k) == live for k in left if k not in (f"results/{purged}.json", custom))
    assert pending_uploads(s3, bucket) == [] and multipart["UploadId"]
    assert (await client.get(live)).input["f"]["size"] == 7


def test_cli_attach_uploads_and_enqueues_a_reference(
    backend_url: str, s3: RcloneS3, bucket: str, tmp_path: Path
) -> None:
    import yaml
    from typer.testing import CliRunner

    from offload.cli.app import app

    config = tmp_path / "offload.yaml"
    config.write_text(yaml.safe_dump({"storage": {**s3.settings(bucket), "max_input_file_bytes": 1000}}))
    talk = tmp_path / "talk.mp3"
    talk.write_bytes(b"ID3 not really an mp3")
    runner = CliRunner()

    def enqueue(*args: str) -> Any:
        return runner.invoke(
            app, ["enqueue", "--queue", "cli-files", "--url", backend_url, "--config", str(config), *args]
        )

    done = enqueue("--input", '{"lang": "en"}', "--attach", f"audio={talk}", "--json")
    assert done.exit_code == 0, done.output
    job_id = json.loads(done.stdout)["id"]

    async def record() -> Any:
        async with AsyncClient(backend_url) as c:
            return await c.get(job_id)

    job = asyncio.run(record())
    assert job.input["lang"] == "en" and job.input["audio"]["sha256"] == hashlib.sha256(talk.read_bytes()).hexdigest()
    assert job.input["audio"]["content_type"] == "audio/mpeg"
    keys = objects(s3, bucket)
    assert keys == [job.input["audio"][REF_KEY]]
    missing = enqueue("--attach", f"audio={tmp_path / 'nope.wav'}")
    assert missing.exit_code == 1 and "nope.wav: not a readable file" in missing.output
    clash = enqueue("--input", '{"audio": 1}', "--attach", f"audio={talk}")
    assert clash.exit_code == 1 and "already has a field 'audio'" in clash.output
    big = tmp_path / "big.bin"
    big.write_bytes(b"x" * 1001)
    too_big = enqueue("--attach", f"blob={big}")
    assert too_big.exit_code == 1 and "over the 1000-byte limit" in too_big.output
    assert objects(s3, bucket) == keys  # no failed attempt left anything


KILLED_UPLOADER = """
import json, sys
from offload import Client, File

with Client(sys.argv[1], storage=json.loads(sys.argv[2])) as client:
    client.enqueue("killed", {"f": File(sys.stdin.buffer, name="pipe.bin")})
"""


async def test_producer_killed_mid_upload_leaves_no_job_and_the_sweep_clears_its_parts(
    backend_url: str, storage: S3Storage, s3: RcloneS3, bucket: str
) -> None:
    """SIGKILL while a multipart upload is under way: no job (the enqueue never ran), no object (it was never
    completed); its parts are invisible but cost storage until the sweep aborts the upload."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", KILLED_UPLOADER, backend_url, json.dumps(s3.settings(bucket)),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.stdin is not None
    proc.stdin.write(os.urandom(12 * MiB))  # past the multipart threshold: the upload has started
    await proc.stdin.drain()
    deadline = time.monotonic() + 60
    while not pending_uploads(s3, bucket):
        assert time.monotonic() < deadline, "the uploader never started a multipart upload"
        await asyncio.sleep(0.05)
    proc.kill()
    await proc.wait()
    async with AsyncClient(backend_url) as c:
        store = await c.store()
        assert await queue_jobs(store, "killed") == 0
        assert objects(s3, bucket) == [] and len(pending_uploads(s3, bucket)) == 1
        sweep = FileSweep(storage, store, grace_s=3600, clock=lambda: time.time() + 7200)
        await sweep.run_once()
    assert pending_uploads(s3, bucket) == [] and objects(s3, bucket) == [STORE_MARKER]
