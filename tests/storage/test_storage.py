"""Result storage against real servers: a real S3 endpoint (`rclone serve s3`), the provider simulator's expiring
file URLs, and a tiny http.server for file hosts that fail. Results must be readable with plain boto3 at the
tutorial's `results/<id>.json`, copied files must carry their Content-Type, and no error may leak a secret."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import httpx
import pytest
from pydantic import SecretStr
from support.procs import die_with_parent
from support.s3server import RcloneS3, wait_port_closed
from support.servers import closed_port

from bench import web
from bench.chaos.faketime import ClockFile
from offload.backends import new_client
from offload.backends.transport import fast_path
from offload.egress import FilePolicy
from offload.errors import ConfigError
from offload.storage import (
    InvalidKey,
    LocalStorage,
    ObjectNotFound,
    Put,
    S3StorageSettings,
    Storage,
    StorageConfigError,
    StorageError,
    create_storage,
    files_prefix,
    store_output,
)
from offload.storage.outputs import PlainGet
from offload.storage.s3 import S3Storage  # the s3 extra: not imported with offload.storage
from offload.testing.sim import SimConfig, running_sim

PNG = b"\x89PNG\r\n\x1a\n"
LOCAL = FilePolicy(allow_private=True)  # the file hosts here are on loopback: a local stack's opt-in
GENERIC = r"^output file {n} could not be copied \(the worker's log says why\)$"


def logged(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == "offload.storage")


@pytest.fixture
def bucket(s3: RcloneS3) -> str:
    name = f"t-{secrets.token_hex(6)}"
    s3.make_bucket(name)
    return name


@pytest.fixture
async def storage(s3: RcloneS3, bucket: str) -> AsyncIterator[S3Storage]:
    store = create_storage(s3.settings(bucket, max_attempts=1))
    assert isinstance(store, S3Storage)
    yield store
    await store.aclose()


def test_server_fixture_stops_by_pid(tmp_path: Path) -> None:
    server = RcloneS3(tmp_path / "d").start()
    port, pid = server.port, server._proc.pid  # type: ignore[union-attr]
    server.stop()
    assert wait_port_closed(port, 2.0)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_server_dies_with_a_sigkilled_parent(tmp_path: Path) -> None:
    """atexit cannot run on SIGKILL; the server must not outlive the test process anyway."""
    code = (
        "import sys, time; sys.path.insert(0, sys.argv[2]); from support.s3server import RcloneS3; "
        "s = RcloneS3(__import__('pathlib').Path(sys.argv[1])).start(); print(s._proc.pid, s.port, flush=True); "
        "time.sleep(60)"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "d"), str(Path(__file__).parents[1])],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert parent.stdout is not None
        pid, port = map(int, parent.stdout.readline().split())
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
    assert wait_port_closed(port, 5.0)
    assert _gone(pid)


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie waiting for whoever inherited it (here: not our child to reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


# ---------------------------------------------------------------- S3


async def test_s3_json_and_bytes_round_trip(s3: RcloneS3, bucket: str, storage: S3Storage) -> None:
    assert isinstance(storage, Storage)
    loc = await storage.put_json("results/j1.json", {"ok": True, "n": [1, 2], "s": "ü"})
    assert loc == f"s3://{bucket}/results/j1.json" == storage.location("results/j1.json")
    assert json.loads(await storage.get_bytes("results/j1.json")) == {"ok": True, "n": [1, 2], "s": "ü"}
    await storage.put_json("results/big.json", {"n": 2**70})  # beyond 64 bits: providers do return these
    assert json.loads(await storage.get_bytes("results/big.json")) == {"n": 2**70}
    await storage.put_bytes("blobs/a.bin", b"\x00\x01binary", "application/x-test")
    assert await storage.get_bytes("blobs/a.bin") == b"\x00\x01binary"
    assert await storage.exists("blobs/a.bin") and not await storage.exists("blobs/missing.bin")
    with pytest.raises(ObjectNotFound, match=r"blobs/missing\.bin"):
        await storage.get_bytes("blobs/missing.bin")
    with pytest.raises(InvalidKey):
        await storage.put_bytes("../escape", b"x")
    # Plain boto3 (the tutorial's reader) sees the same objects, with their content types; rclone keeps plain files.
    head = s3.client().head_object(Bucket=bucket, Key="results/j1.json")
    assert head["ContentType"] == "application/json"
    assert (s3.dir / bucket / "blobs" / "a.bin").read_bytes() == b"\x00\x01binary"


async def test_s3_prefix_and_presigned_url(s3: RcloneS3, bucket: str) -> None:
    store = create_storage(s3.settings(bucket, prefix="/env/prod/"))
    try:
        loc = await store.put_bytes("r/x.txt", b"hello", "text/plain")
        assert loc == f"s3://{bucket}/env/prod/r/x.txt"
        url = await store.presigned_url("r/x.txt", expires_s=60)
        assert s3.secret_key not in url
        async with web.async_client() as http:  # no credentials: the signature is in the URL
            r = await http.get(url)
            unsigned = await http.get(f"{s3.endpoint_url}/{bucket}/env/prod/r/x.txt")
        assert r.status_code == 200 and r.content == b"hello"
        assert unsigned.status_code in (400, 403)
    finally:
        await store.aclose()


def _leaks(exc: BaseException, *secrets_: str) -> bool:
    text = "".join(traceback.format_exception(exc)) + repr(exc)
    return any(s in text for s in secrets_)


async def test_s3_wrong_credentials_name_the_setting_without_leaking(s3: RcloneS3, bucket: str) -> None:
    bad_secret = "wrong-" + secrets.token_hex(12)
    cases = [
        ({"secret_access_key": bad_secret}, "storage.secret_access_key"),
        ({"access_key_id": "AKNOTKNOWN12345"}, "storage.access_key_id"),
    ]
    for override, setting in cases:
        store = create_storage({**s3.settings(bucket, max_attempts=1), **override})
        assert s3.secret_key not in repr(store) and bad_secret not in repr(store)
        try:
            with pytest.raises(StorageConfigError, match=setting) as put_err:
                await store.put_json("results/x.json", {"a": 1})
            with pytest.raises(StorageConfigError, match=r"storage\.access_key_id") as head_err:
                await store.exists("results/x.json")  # HEAD: a bare 403, no error code
        finally:
            await store.aclose()
        for err in (put_err.value, head_err.value):
            assert not _leaks(err, s3.secret_key, bad_secret)
            assert isinstance(err, ConfigError) and not isinstance(err, StorageError)


SKEWED_CALLS = textwrap.dedent("""
    import asyncio, json, sys
    from offload.storage import create_storage

    async def main():
        store = create_storage(json.loads(sys.argv[1]))
        try:
            for call in (lambda: store.put_json("results/x.json", {"a": 1}), lambda: store.exists("results/x.json")):
                try:
                    await call()
                    print("answered")
                except Exception as exc:
                    print(type(exc).__name__, getattr(exc, "permanent", None), exc)
        finally:
            await store.aclose()

    asyncio.run(main())
""")


async def test_s3_a_host_clock_hours_off_is_named_not_the_keys(s3: RcloneS3, bucket: str, tmp_path: Path) -> None:
    """A worker whose clock is 3 h off (behind: rclone answers AccessDenied; ahead: RequestTimeTooSkewed; a HEAD
    has no code at all) is told its clock is off, by how much, as an error to retry once the clock is right: not
    a key's permissions to fix. A process under libfaketime, against the real server."""
    for offset, side in ((-3 * 3600, "behind"), (3 * 3600, "ahead of")):
        clock = ClockFile(tmp_path / f"clock{offset}", offset)
        args = [sys.executable, "-c", SKEWED_CALLS, json.dumps(s3.settings(bucket, max_attempts=1))]
        out = await asyncio.to_thread(subprocess.run, args, env=clock.env(), capture_output=True, text=True, timeout=60)
        lines = out.stdout.splitlines()
        assert len(lines) == 2, out.stderr[-2000:]
        for line in lines:
            assert line.startswith("ClockRefused False "), line
            assert f"this host's clock is 3.0 h {side} " in line and "permission" not in line, line
            assert "whichever of the two is wrong" in line, line  # the storage server's clock may be the wrong one
            assert s3.secret_key not in line


async def test_s3_missing_bucket_and_unreachable_endpoint(s3: RcloneS3) -> None:
    store = create_storage(s3.settings("no-such-bucket-here", max_attempts=1))
    try:
        with pytest.raises(StorageConfigError, match=r"storage\.bucket: bucket 'no-such-bucket-here' does not exist"):
            await store.put_json("results/x.json", {})
    finally:
        await store.aclose()
    closed = RcloneS3(s3.dir.parent / "unused")  # never started: nothing listens on a closed port
    closed.port = closed_port()
    store = create_storage(closed.settings("bkt", max_attempts=1, connect_timeout=1))
    try:
        started = time.monotonic()
        with pytest.raises(StorageError) as err:
            await store.put_json("results/x.json", {})
        assert time.monotonic() - started < 5
        assert not err.value.permanent and "cannot reach" in str(err.value)
        assert not _leaks(err.value, closed.secret_key)
    finally:
        await store.aclose()


async def test_s3_create_bucket_if_missing(s3: RcloneS3) -> None:
    name = f"new-{secrets.token_hex(5)}"
    store = S3Storage(
        S3StorageSettings(
            bucket=name,
            endpoint_url=s3.endpoint_url,
            access_key_id=s3.access_key,
            secret_access_key=SecretStr(s3.secret_key),
        )
    )
    try:
        assert await store.create_bucket_if_missing() is True
        assert await store.create_bucket_if_missing() is False
        await store.put_json("k.json", [1])
        assert (s3.dir / name / "k.json").read_bytes() == b"[1]"
    finally:
        await store.aclose()


async def test_s3_many_concurrent_puts_use_a_bounded_pool(storage: S3Storage) -> None:
    """500 jobs finishing together must not mean 500 threads; also reports put latency against rclone."""
    before = threading.active_count()
    peak = before

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, threading.active_count())
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    started = time.perf_counter()
    locs = await asyncio.gather(*(storage.put_json(f"results/c{i}.json", {"i": i}) for i in range(500)))
    elapsed = time.perf_counter() - started
    watcher.cancel()
    assert len(set(locs)) == 500
    assert peak - before <= storage.settings.max_threads + 2
    one = time.perf_counter()
    for i in range(20):
        await storage.put_json(f"results/s{i}.json", {"i": i})
    serial_ms = (time.perf_counter() - one) / 20 * 1000
    print(f"\nrclone s3: 500 concurrent puts {500 / elapsed:.0f}/s, serial put {serial_ms:.1f} ms")


# ---------------------------------------------------------------- local


async def test_local_round_trip(tmp_path: Path) -> None:
    store = create_storage({"kind": "local", "path": str(tmp_path / "res")})
    assert isinstance(store, LocalStorage) and isinstance(store, Storage)
    loc = await store.put_json("results/j.json", {"a": 1})
    assert loc == str(tmp_path / "res" / "results" / "j.json")
    assert json.loads(await asyncio.to_thread(Path(loc).read_bytes)) == {"a": 1}
    assert await store.get_bytes("results/j.json") == b'{"a":1}'
    assert await store.exists("results/j.json") and not await store.exists("results/other.json")
    assert not await store.exists("results")  # a directory is not an object
    url = await store.presigned_url("results/j.json")
    assert url == Path(loc).as_uri() and url.startswith("file://")
    with pytest.raises(ObjectNotFound):
        await store.get_bytes("results/other.json")
    with pytest.raises(InvalidKey):
        await store.put_json("a/../../etc/passwd", {})


async def test_local_writes_fsync_every_directory_they_make_into_its_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file is durable only once the entries leading to it are: a write that makes `a/b/c/` fsyncs the file's
    directory and the parent of each directory it made (innermost first); a write into an existing directory
    fsyncs that directory alone, and makes no directory. Also when two writers make the same new directories at
    once: both finish, and each fsyncs the parents (the other's may not have happened when it acks)."""
    from offload.storage import local

    synced: list[Path] = []
    real = local._fsync_dir

    def record(directory: str | Path) -> None:
        synced.append(Path(directory))
        real(directory)

    monkeypatch.setattr(local, "_fsync_dir", record)
    files_synced: list[int] = []
    real_sync = local._sync_and_close

    def record_file(fd: int) -> None:
        files_synced.append(fd)
        real_sync(fd)

    monkeypatch.setattr(local, "_sync_and_close", record_file)  # the small-object road's file fsync
    store = LocalStorage(tmp_path / "root")
    (tmp_path / "root").mkdir()
    await store.put_bytes("a/b/c/one.json", b"1")
    root = tmp_path / "root"
    assert synced == [root / "a/b/c", root / "a/b", root / "a", root]
    synced.clear()
    await store.put_bytes("a/b/c/two.json", b"2")
    assert synced == [root / "a/b/c"]
    synced.clear()
    await asyncio.gather(store.put_bytes("x/y/1.json", b"1"), store.put_bytes("x/y/2.json", b"2"))
    assert (root / "x/y/1.json").read_bytes() == b"1" and (root / "x/y/2.json").read_bytes() == b"2"
    assert synced.count(root / "x") >= 1 and synced.count(root) >= 1, synced
    assert len(files_synced) == 4  # every small write fsynced its file before the rename


def _listing_becomes(directory: Path, names: list[str], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while sorted(os.listdir(directory)) != names:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _fds_back_to(count: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while len(os.listdir("/proc/self/fd")) > count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _hold_sync(monkeypatch: pytest.MonkeyPatch, name: str) -> tuple[threading.Event, threading.Event]:
    """Make local storage's sync `name` (`_syncfs` or `_sync_and_close`) wait, before it syncs, until the second
    event is set; the first is set once a lane is held there (before any of its batch's renames)."""
    from offload.storage import local

    entered, release = threading.Event(), threading.Event()
    real = getattr(local, name)

    def held(fd: int) -> None:
        entered.set()
        release.wait(10)
        real(fd)

    monkeypatch.setattr(local, name, held)
    return entered, release


@pytest.mark.parametrize("grouped", [True, False], ids=["syncfs", "fsync-each"])
async def test_local_small_writes_cancelled_before_their_rename_leak_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, grouped: bool
) -> None:
    """A small write waits on its group-commit lane: cancelling the task while the lane is held in its sync (a
    worker stopping), or before the lane took it, leaves the previous object, no temp file and no descriptor,
    with the batch made durable by syncfs and by an fsync of each file alike."""
    from offload.storage import local

    store = LocalStorage(tmp_path)
    await store.put_bytes("r/out.json", b"old")
    fds_before = len(os.listdir("/proc/self/fd"))
    if grouped:
        assert local._SYNCFS is not None  # Linux >= 5.8, as CI: the road a burst takes
        monkeypatch.setattr(local, "GROUP_MIN", 1)
    else:
        monkeypatch.setattr(local, "GROUP_MIN", 10**9)
    entered, release = _hold_sync(monkeypatch, "_syncfs" if grouped else "_sync_and_close")
    tasks = [asyncio.create_task(store.put_bytes("r/out.json", b"new %d" % i)) for i in range(20)]
    assert await asyncio.to_thread(entered.wait, 10)
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    release.set()
    assert await asyncio.to_thread(_fds_back_to, fds_before)  # the held syncs ran, and closed their files
    # the lanes remove the temp files of writes given up before their rename
    assert await asyncio.to_thread(_listing_becomes, tmp_path / "r", ["out.json"]), os.listdir(tmp_path / "r")
    assert (tmp_path / "r" / "out.json").read_bytes() == b"old"


async def test_local_burst_is_made_durable_with_one_syncfs_per_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """200 small writes at once (a burst of outputs) are made durable with far fewer syncs than writes (two per
    lane batch, the temp files' and the renames'), not an fsync per file and per directory, and every object
    holds its own bytes, each in directories made for it."""
    from offload.storage import local

    assert local._SYNCFS is not None  # Linux >= 5.8, as CI
    calls: list[int] = []
    real = local._syncfs
    per_file: list[int] = []
    real_file = local._sync_and_close

    def counted(fd: int) -> None:
        calls.append(fd)
        real(fd)

    def counted_file(fd: int) -> None:
        per_file.append(fd)
        real_file(fd)

    monkeypatch.setattr(local, "_syncfs", counted)
    monkeypatch.setattr(local, "_sync_and_close", counted_file)
    store = LocalStorage(tmp_path)
    keys = [f"results/j{i}/files/1/0-out.png" for i in range(200)]
    await asyncio.gather(*(store.put_bytes(k, k.encode()) for k in keys))
    for k in keys:
        assert (tmp_path / k).read_bytes() == k.encode()
    assert calls, "a burst of 200 writes took no grouped sync"
    assert len(calls) + len(per_file) < 200, (len(calls), len(per_file))
    assert not [n for n in os.listdir(tmp_path / "results" / "j0" / "files" / "1") if n.endswith(".tmp")]


async def test_local_burst_across_two_file_systems_syncs_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two local stores on different file systems (a directory and /dev/shm) written in one burst: syncfs(2)
    flushes one file system only, so a batch holding writes of both syncs each, and every object is there."""
    from offload.storage import local

    shm = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        assert os.stat(shm).st_dev != os.stat(tmp_path).st_dev
        monkeypatch.setattr(local, "GROUP_MIN", 1)
        devices: set[int] = set()
        real = local._syncfs

        def recorded(fd: int) -> None:
            devices.add(os.fstat(fd).st_dev)
            real(fd)

        monkeypatch.setattr(local, "_syncfs", recorded)
        disk, memory = LocalStorage(tmp_path), LocalStorage(shm)
        writes = [store.put_bytes(f"r/{i}.json", b"%d" % i) for i in range(40) for store in (disk, memory)]
        await asyncio.gather(*writes)
        assert devices == {os.stat(tmp_path).st_dev, os.stat(shm).st_dev}
        assert all((root / "r" / f"{i}.json").read_bytes() == b"%d" % i for i in range(40) for root in (tmp_path, shm))
    finally:
        shutil.rmtree(shm, ignore_errors=True)


async def test_local_failed_syncfs_fails_its_writes_and_keeps_the_previous_objects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A grouped sync that fails (EIO) before the renames fails every write it covered with the reason, renames
    none of them, and removes their temp files; the lanes go on serving the next writes."""
    from offload.storage import local

    monkeypatch.setattr(local, "GROUP_MIN", 1)
    store = LocalStorage(tmp_path)
    await asyncio.gather(*(store.put_bytes(f"r/{i}.json", b"old") for i in range(10)))

    def failing(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(local, "_syncfs", failing)
    results = await asyncio.gather(*(store.put_bytes(f"r/{i}.json", b"new") for i in range(10)), return_exceptions=True)
    assert all(isinstance(r, StorageError) and "Input/output error" in str(r) for r in results), results
    assert sorted(os.listdir(tmp_path / "r")) == sorted(f"{i}.json" for i in range(10))
    assert all((tmp_path / "r" / f"{i}.json").read_bytes() == b"old" for i in range(10))
    monkeypatch.undo()
    assert await store.put_bytes("r/0.json", b"later") == str(tmp_path / "r" / "0.json")
    assert (tmp_path / "r" / "0.json").read_bytes() == b"later"


def test_syncfs_is_trusted_only_where_it_reports_lost_writes() -> None:
    """Before Linux 5.8 syncfs(2) returned 0 even when writeback failed: there each file is fsynced instead."""
    from offload.storage.local import _syncfs_reports_errors

    assert _syncfs_reports_errors("5.8.0") and _syncfs_reports_errors("6.1.0-18-amd64")
    assert not _syncfs_reports_errors("5.4.0-150-generic") and not _syncfs_reports_errors("4.19.0")
    assert not _syncfs_reports_errors("weird")


async def test_local_failed_fsync_fails_the_write_and_keeps_the_previous_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An fsync that fails (EIO) fails that write alone with the reason, before its rename; the writes
    batched with it on the lane succeed (a small batch: each file fsynced)."""
    from offload.storage import local

    monkeypatch.setattr(local, "GROUP_MIN", 10**9)

    store = LocalStorage(tmp_path)
    await store.put_bytes("r/out.json", b"old")
    real = local._sync_and_close
    doomed: set[int] = set()

    def failing(fd: int) -> None:
        if fd in doomed:
            doomed.discard(fd)  # before the close: the other write may be given the same number once it is free
            os.close(fd)
            raise OSError(5, "Input/output error")
        real(fd)

    monkeypatch.setattr(local, "_sync_and_close", failing)
    real_temp = local._temp_beside

    def marked(target: str) -> tuple[int, str]:
        fd, tmp = real_temp(target)
        if target.endswith("out.json"):
            doomed.add(fd)
        return fd, tmp

    monkeypatch.setattr(local, "_temp_beside", marked)
    results = await asyncio.gather(
        store.put_bytes("r/out.json", b"new"), store.put_bytes("r/other.json", b"fine"), return_exceptions=True
    )
    assert isinstance(results[0], StorageError) and "Input/output error" in str(results[0])
    assert results[1] == str(tmp_path / "r" / "other.json")
    assert (tmp_path / "r" / "out.json").read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path / "r")) == ["other.json", "out.json"]


async def test_local_write_under_a_file_names_the_directory(tmp_path: Path) -> None:
    """A key whose directory would have to go where a file is (`a` a file, key `a/b/c.json`): a clear
    StorageError naming the directory, for either size of object, and nothing written."""
    store = LocalStorage(tmp_path)
    await store.put_bytes("a", b"a file")
    for data in (b"small", b"x" * (2 << 20)):
        with pytest.raises(StorageError, match=r"cannot write under .*/a/b"):
            await store.put_bytes("a/b/c.json", data)
    assert sorted(os.listdir(tmp_path)) == ["a"] and (tmp_path / "a").read_bytes() == b"a file"


async def test_local_failed_write_keeps_the_previous_object(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    await store.put_bytes("r/out.bin", b"old" * 1000)

    class Exploding:
        def __init__(self) -> None:
            self.calls = 0

        def read(self, n: int = -1) -> bytes:
            self.calls += 1
            if self.calls > 2:
                raise OSError(28, "No space left on device")
            return b"new" * 100

    with pytest.raises(StorageError, match="No space left"):
        await store.put_fileobj("r/out.bin", Exploding())  # type: ignore[arg-type]
    assert (tmp_path / "r" / "out.bin").read_bytes() == b"old" * 1000
    assert os.listdir(tmp_path / "r") == ["out.bin"]  # the temp file was removed


async def test_local_temp_names_never_clobber_a_stray_or_a_concurrent_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Temp files are made with O_EXCL: a stray temp file of the same name (a SIGKILLed process's, or a forked
    child's with the same counter) is skipped, not truncated, and 20 writers of one key at once all finish,
    leaving one whole version and no temp file."""
    import itertools

    from offload.storage import local

    store = LocalStorage(tmp_path)
    await store.put_bytes("r/x.bin", b"first")
    monkeypatch.setattr(local, "_SERIAL", itertools.count(7))
    stray = tmp_path / "r" / f".x.bin.{local._TOKEN}-7{local.TMP_SUFFIX}"
    stray.write_bytes(b"someone else's")
    await store.put_bytes("r/x.bin", b"second")
    assert (tmp_path / "r" / "x.bin").read_bytes() == b"second"
    assert stray.read_bytes() == b"someone else's"
    stray.unlink()
    versions = [bytes([65 + i]) * 50_000 for i in range(20)]
    await asyncio.gather(*(store.put_bytes("r/x.bin", v) for v in versions))
    assert (tmp_path / "r" / "x.bin").read_bytes() in versions
    assert os.listdir(tmp_path / "r") == ["x.bin"]
    old = os.umask(0o027)
    try:
        await store.put_bytes("r/private.bin", b"p")
    finally:
        os.umask(old)
    assert (tmp_path / "r" / "private.bin").stat().st_mode & 0o777 == 0o640  # the umask applies, as to any file


CRASH_WRITER = textwrap.dedent("""
    import asyncio, sys
    from offload.storage.local import LocalStorage
    store = LocalStorage(sys.argv[1])
    async def main():
        i = 0
        while True:
            await store.put_bytes("r/big.bin", bytes([65 + i % 2]) * 4_000_000)
            i += 1
            if i == 1:
                print("ready", flush=True)
    asyncio.run(main())
""")


def test_local_write_survives_sigkill_mid_write(tmp_path: Path) -> None:
    """SIGKILL a process that keeps rewriting a 4 MB object: the object is always one whole version."""
    for delay in (0.05, 0.17):
        proc = subprocess.Popen(
            [sys.executable, "-c", CRASH_WRITER, str(tmp_path)],
            stdout=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        try:
            assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
            time.sleep(delay)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        data = (tmp_path / "r" / "big.bin").read_bytes()
        assert len(data) == 4_000_000 and data in (b"A" * 4_000_000, b"B" * 4_000_000)


# ---------------------------------------------------------------- outputs with provider files


class _FileHost(BaseHTTPRequestHandler):
    """Provider-style file host whose failures the tests choose by path."""

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path == "/files/report.txt":
            self._send(200, b"report body\n", "text/plain; charset=utf-8")
        elif path == "/files/image":  # no extension: the copy gets one from the Content-Type
            self._send(200, PNG + b"pixels", "image/png")
        elif path == "/big.bin":
            self._send(200, b"x" * 5000, "application/octet-stream")
        elif path == "/files/private.txt":  # like replicate.delivery: the API token is required
            authorized = self.headers.get("Authorization") == "Token r8-test"
            self._send(200 if authorized else 401, b"private" if authorized else b"no", "text/plain")
        elif path == "/slow.bin":  # headers at once, then the body stalls
            self.send_response(200)
            self.send_header("Content-Length", "10")
            self.end_headers()
            self.wfile.write(b"12345")
            self.wfile.flush()
            time.sleep(1.0)
            self.wfile.write(b"67890")
        elif path == "/gone.png":
            self._send(404, b"expired", "text/plain")
        elif path == "/moved":  # a redirect to the URL in the query (a provider's CDN hop)
            self.send_response(302)
            self.send_header("Location", unquote(self.path.split("?to=", 1)[1]))
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/gzipped.txt":  # encoded whatever the client asked for
            body = gzip.compress(b"plain words " * 100)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif path.startswith("/echo"):  # what reached the host: the raw request target and the headers
            seen = {"target": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}}
            self._send(200, json.dumps(seen).encode(), "application/json")
        else:
            self._send(500, b"boom", "text/plain")

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def file_host() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FileHost)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


Road = Callable[[], AbstractAsyncContextManager[tuple[httpx.AsyncClient, PlainGet | None]]]


@pytest.fixture(params=["httpx", "aiohttp"])
def road(request: pytest.FixtureRequest) -> Road:
    """Both ways a file is fetched on the worker's egress client: through httpx (its redirects and decoding),
    and straight on its aiohttp transport, which takes the plain GETs itself (`plain`) and hands redirects and
    encoded bodies back to httpx."""

    @contextlib.asynccontextmanager
    async def open_road() -> AsyncIterator[tuple[httpx.AsyncClient, PlainGet | None]]:
        http = new_client(timeout=10, agent="offload-test/1", egress=True)
        try:
            yield http, (fast_path(http) if request.param == "aiohttp" else None)
        finally:
            await http.aclose()

    return open_road


async def test_store_output_copies_simulator_files(s3: RcloneS3, bucket: str, storage: S3Storage) -> None:
    """End to end with the provider simulator: its file URLs expire with the job, our copies do not."""
    config = SimConfig.model_validate({"default": {"latency": 0.05, "files_per_job": 2, "file_type": "png"}})
    with running_sim(config) as base:
        async with web.async_client(base_url=base, headers={"Authorization": "Bearer k"}, timeout=10) as http:
            remote = (await http.post("/jobs", json={"prompt": "cat", "ref": "not a url"})).json()["id"]
            for _ in range(200):
                body = (await http.get(f"/jobs/{remote}")).json()
                if body["status"] == "succeeded":
                    break
                await asyncio.sleep(0.02)
            output = body["output"]
            originals = {u: (await http.get(u)).content for u in output["files"]}
            job_id = "job-7"
            files = new_client(timeout=10, egress=True)
            try:  # the simulator is the backend: its own origin may be on loopback
                own = FilePolicy.of(str(base))
                stored = await store_output(storage, f"results/{job_id}.json", output, files, policy=own)
            finally:
                await files.aclose()
            assert (await http.post("/_sim/reset")).status_code == 200  # the provider forgets the job
            assert [(await http.get(u)).status_code for u in output["files"]] == [404, 404]

    assert stored.location == f"s3://{bucket}/results/job-7.json"
    assert [f.url for f in stored.files] == output["files"]
    doc = json.loads(s3.client().get_object(Bucket=bucket, Key="results/job-7.json")["Body"].read())
    assert doc["echo"] == {"prompt": "cat", "ref": "not a url"}
    names = [u.rsplit("/", 1)[1] for u in output["files"]]
    expected = [f"s3://{bucket}/results/job-7/files/{i}-{n}" for i, n in enumerate(names)]
    assert doc["files"] == expected
    assert doc["_offload_files"] == dict(zip(output["files"], expected, strict=True))
    for i, name in enumerate(names):
        obj = s3.client().get_object(Bucket=bucket, Key=f"results/job-7/files/{i}-{name}")
        assert obj["ContentType"] == "image/png"
        assert obj["Body"].read() == originals[output["files"][i]]
        assert originals[output["files"][i]].startswith(PNG)


async def test_store_output_rewrites_nested_and_duplicate_urls(
    s3: RcloneS3, bucket: str, storage: S3Storage, file_host: str, road: Road
) -> None:
    text_url, image_url = f"{file_host}/files/report.txt?token=s3cr3t", f"{file_host}/files/image"
    output = [image_url, {"deep": [text_url, image_url]}, f"see {text_url}", 3, None]  # a Replicate-style list
    async with road() as (http, plain):
        stored = await store_output(storage, "results/j2.json", output, http, plain=plain, policy=LOCAL)
    loc0 = f"s3://{bucket}/results/j2/files/0-image.png"
    loc1 = f"s3://{bucket}/results/j2/files/1-report.txt"
    assert [(f.location, f.content_type, f.size) for f in stored.files] == [
        (loc0, "image/png", len(PNG) + 6),
        (loc1, "text/plain; charset=utf-8", 12),
    ]
    doc = json.loads(await storage.get_bytes("results/j2.json"))
    assert doc == [loc0, {"deep": [loc1, loc0]}, f"see {text_url}", 3, None]  # text containing a URL is text
    assert stored.file_map == {image_url: loc0, text_url: loc1}
    head = s3.client().head_object(Bucket=bucket, Key="results/j2/files/1-report.txt")
    assert head["ContentType"] == "text/plain; charset=utf-8"


async def test_store_output_without_files_is_the_tutorial_layout(
    s3: RcloneS3, bucket: str, storage: S3Storage, file_host: str
) -> None:
    output = {"text": "done", "link": f"{file_host}/files/report.txt", "meta": "http://169.254.169.254/latest/"}
    async with web.async_client() as http:  # nothing is fetched here but the listed host
        plain = await store_output(storage, "results/a.json", output, http, copy_files=False)
        listed = FilePolicy(hosts=(".replicate.delivery",))
        other = await store_output(storage, "results/b.json", output, http, policy=listed)
    async with new_client(egress=True) as http:
        own = FilePolicy(allow_private=True, hosts=("127.0.0.1",))
        await store_output(storage, "results/c.json", output, http, policy=own)
    reader = s3.client()
    for stored, key in ((plain, "results/a.json"), (other, "results/b.json")):
        assert stored.files == []
        assert json.loads(reader.get_object(Bucket=bucket, Key=key)["Body"].read()) == output
    mine = json.loads(reader.get_object(Bucket=bucket, Key="results/c.json")["Body"].read())
    assert mine["link"].startswith("s3://") and mine["meta"] == output["meta"]  # never fetch instance metadata
    assert files_prefix("results/a.json") == "results/a/files/" and files_prefix("out/x") == "out/x.files/"


@pytest.mark.parametrize(("path", "permanent", "message"), [
    ("/boom.png", False, "HTTP 500"),
    ("/gone.png", True, "expired"),
    ("/big.bin", True, "limit"),
])  # fmt: skip
async def test_store_output_file_failure_raises_before_writing(
    storage: S3Storage,
    file_host: str,
    path: str,
    permanent: bool,
    message: str,
    road: Road,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The error (what a producer sees) is one generic line; the reason is in the log, for the operator."""
    output = {"files": [f"{file_host}/files/report.txt", f"{file_host}{path}?sig=topsecret"]}
    async with road() as (http, plain):
        with pytest.raises(StorageError, match=GENERIC.format(n=2)) as err:
            await store_output(storage, "results/f.json", output, http, max_file_bytes=1000, plain=plain, policy=LOCAL)
    assert err.value.permanent is permanent
    assert message in logged(caplog) and path in logged(caplog)
    assert "topsecret" not in str(err.value) + logged(caplog)  # signed query strings are redacted
    assert not await storage.exists("results/f.json")  # no output, so the job cannot be marked succeeded


async def test_store_output_stalled_file_times_out_as_transient(
    storage: S3Storage, file_host: str, road: Road, caplog: pytest.LogCaptureFixture
) -> None:
    async with road() as (http, plain):
        with pytest.raises(StorageError, match=GENERIC.format(n=1)) as err:
            await store_output(
                storage,
                "results/t.json",
                {"f": f"{file_host}/slow.bin"},
                http,
                file_timeout_s=0.2,
                plain=plain,
                policy=LOCAL,
            )
    assert not err.value.permanent and not await storage.exists("results/t.json")
    assert "longer than 0.2s" in logged(caplog)


async def test_store_output_unreachable_file_host_is_transient(
    storage: S3Storage, road: Road, caplog: pytest.LogCaptureFixture
) -> None:
    output = {"file": f"http://127.0.0.1:{closed_port()}/x.png"}
    async with road() as (http, plain):
        with pytest.raises(StorageError, match=GENERIC.format(n=1)) as err:
            await store_output(storage, "results/u.json", output, http, plain=plain, policy=LOCAL)
    assert not err.value.permanent and "ConnectError" in logged(caplog)


async def test_store_output_sends_auth_headers_only_to_their_host(
    storage: S3Storage, file_host: str, road: Road, caplog: pytest.LogCaptureFixture
) -> None:
    auth = {"127.0.0.1": {"Authorization": "Token r8-test"}}
    async with road() as (http, plain):
        stored = await store_output(
            storage,
            "results/p.json",
            {"f": f"{file_host}/files/private.txt"},
            http,
            auth_headers=auth,
            plain=plain,
            policy=LOCAL,
        )
        assert await storage.get_bytes(stored.files[0].key) == b"private"
        other_host = file_host.replace("127.0.0.1", "localhost")  # same server, another host name: no token
        with pytest.raises(StorageError, match=GENERIC.format(n=1)) as err:
            await store_output(
                storage,
                "results/q.json",
                {"f": f"{other_host}/files/private.txt"},
                http,
                auth_headers=auth,
                plain=plain,
                policy=LOCAL,
            )
    assert err.value.permanent and "HTTP 401" in logged(caplog)


async def test_store_output_on_local_storage(tmp_path: Path, file_host: str, road: Road) -> None:
    store = LocalStorage(tmp_path)
    output = {"img": f"{file_host}/files/image"}
    async with road() as (http, plain):
        stored = await store_output(store, "results/l.json", output, http, plain=plain, policy=LOCAL)
    copy = tmp_path / "results" / "l" / "files" / "0-image.png"
    assert copy.read_bytes() == PNG + b"pixels"
    assert json.loads((tmp_path / "results" / "l.json").read_bytes()) == {
        "img": str(copy),
        "_offload_files": {output["img"]: str(copy)},
    }
    assert stored.location == str(tmp_path / "results" / "l.json")


async def test_store_output_on_local_storage_writes_small_files_with_the_json_in_one_batch(
    tmp_path: Path, file_host: str, road: Road, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small copied files wait in memory and go to the lanes together with the output JSON, as one group commit
    with the JSON last; a file beyond the per-output room (`HOLD_BYTES`) is written on its own, before."""
    from offload.storage import local, outputs

    batches: list[list[str]] = []
    real = local._commit

    def recorded(batch: list[Any]) -> None:
        batches.append([os.path.relpath(p.target, tmp_path) for p in batch])
        real(batch)

    monkeypatch.setattr(local, "_commit", recorded)
    store = LocalStorage(tmp_path)
    output = {"txt": f"{file_host}/files/report.txt", "img": f"{file_host}/files/image"}
    async with road() as (http, plain):
        await store_output(store, "results/a.json", output, http, plain=plain, policy=LOCAL)
        assert batches == [["results/a/files/0-report.txt", "results/a/files/1-image.png", "results/a.json"]]
        batches.clear()
        monkeypatch.setattr(outputs, "HOLD_BYTES", len(b"report body\n"))  # room for the text file only
        await store_output(store, "results/b.json", output, http, plain=plain, policy=LOCAL, run="3")
    # the run is a prefix of the file's name, not a directory: one inode less per job on local storage
    assert batches == [["results/b/files/r3-1-image.png"], ["results/b/files/r3-0-report.txt", "results/b.json"]]
    stored = json.loads((tmp_path / "results" / "b.json").read_bytes())
    assert (tmp_path / "results" / "b" / "files" / "r3-0-report.txt").read_bytes() == b"report body\n"
    assert stored["img"] == str(tmp_path / "results" / "b" / "files" / "r3-1-image.png")
    assert (tmp_path / "results" / "b" / "files" / "r3-1-image.png").read_bytes() == PNG + b"pixels"
    assert sorted(os.listdir(tmp_path / "results" / "b" / "files")) == ["r3-0-report.txt", "r3-1-image.png"]


@pytest.mark.parametrize("grouped", [True, False], ids=["syncfs", "fsync-each"])
async def test_local_put_all_writes_nothing_after_a_failed_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, grouped: bool
) -> None:
    """`put_all` of a file and the output JSON that links it: when the file cannot be written (a plain file
    where its directory should be), the JSON is not replaced either, the error names the file, and no temp file
    is left; a later object of another caller in the same batch is not held back by it."""
    from offload.storage import local

    monkeypatch.setattr(local, "GROUP_MIN", 1 if grouped else 10**9)
    store = LocalStorage(tmp_path)
    await store.put_bytes("results/x.json", b"old")
    (tmp_path / "blocked").write_bytes(b"a file, not a directory")
    group = store.put_all([Put("blocked/0-out.png", b"png"), Put("results/x.json", b"new")])
    results = await asyncio.gather(group, store.put_bytes("results/y.json", b"other"), return_exceptions=True)
    assert isinstance(results[0], StorageError) and "blocked" in str(results[0]), results[0]
    assert results[1] == str(tmp_path / "results" / "y.json")
    assert (tmp_path / "results" / "x.json").read_bytes() == b"old"
    assert (tmp_path / "results" / "y.json").read_bytes() == b"other"
    assert sorted(os.listdir(tmp_path / "results")) == ["x.json", "y.json"]
    ok = await store.put_all([Put("results/x/files/0-a.png", b"a"), Put("results/x.json", b"new")])
    assert ok == [str(tmp_path / "results" / "x" / "files" / "0-a.png"), str(tmp_path / "results" / "x.json")]
    assert (tmp_path / "results" / "x.json").read_bytes() == b"new"


async def test_local_put_all_cancelled_in_its_sync_keeps_every_previous_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's files and JSON given up while their lane is held in its sync (a worker stopping): neither the
    files nor the JSON replace the previous ones, and no temp file is left."""
    from offload.storage import local

    monkeypatch.setattr(local, "GROUP_MIN", 1)
    store = LocalStorage(tmp_path)
    await store.put_all([Put("r/f/0-a.png", b"old a"), Put("r.json", b"old")])
    entered, release = _hold_sync(monkeypatch, "_syncfs")
    task = asyncio.create_task(store.put_all([Put("r/f/0-a.png", b"new a"), Put("r.json", b"new")]))
    assert await asyncio.to_thread(entered.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    assert await asyncio.to_thread(_listing_becomes, tmp_path / "r" / "f", ["0-a.png"])
    assert (tmp_path / "r" / "f" / "0-a.png").read_bytes() == b"old a"
    assert (tmp_path / "r.json").read_bytes() == b"old"
    # the lane removes the batch's temp files in order, the JSON's after the file's: polled as the other was
    assert await asyncio.to_thread(_listing_becomes, tmp_path, ["r", "r.json"]), os.listdir(tmp_path)


async def test_s3_put_all_never_sends_the_last_after_a_failure(storage: S3Storage, bucket: str) -> None:
    """On S3 the others go at once, then the last: when one of the others fails, the last is not sent."""
    await storage.put_bytes("results/s.json", b"old")
    with pytest.raises(InvalidKey):
        await storage.put_all(
            [Put("results/s/files/0-a.png", b"a"), Put("x" * 2000, b"b"), Put("results/s.json", b"new")]
        )
    assert await storage.get_bytes("results/s.json") == b"old"
    done = await storage.put_all([Put("results/s/files/0-a.png", b"a", "image/png"), Put("results/s.json", b"new")])
    assert done == [f"s3://{bucket}/results/s/files/0-a.png", f"s3://{bucket}/results/s.json"]
    assert await storage.get_bytes("results/s.json") == b"new"
    assert await storage.get_bytes("results/s/files/0-a.png") == b"a"


async def test_store_output_sends_the_url_as_given_and_asks_for_the_file_unencoded(
    tmp_path: Path, file_host: str, road: Road
) -> None:
    """A signed URL's bytes are what its signature covers: the request target that reaches the host is the
    URL's own, percent-escapes and all, on either road. The worker's road asks for the file unencoded and
    carries the client's User-Agent and the host's auth header, as httpx's would."""
    store = LocalStorage(tmp_path)
    url = f"{file_host}/echo/a%2Fb%7Ec~d(1)?X-Amz-Signature=ab%2Bcd&list=1,2&e=%3D"
    async with road() as (http, plain):
        stored = await store_output(
            store,
            "results/e.json",
            {"f": url},
            http,
            auth_headers={"127.0.0.1": {"X-Token": "t"}},
            plain=plain,
            policy=LOCAL,
        )
        agent = http.headers["user-agent"]
    seen = json.loads(await store.get_bytes(stored.files[0].key))
    assert seen["target"] == url.removeprefix(file_host)
    assert seen["headers"]["x-token"] == "t" and seen["headers"]["user-agent"] == agent
    if plain is not None:
        assert seen["headers"]["accept-encoding"] == "identity"  # taken by aiohttp, not handed to httpx


async def test_store_output_redirects_and_encoded_bodies_take_httpx_rules(
    tmp_path: Path, file_host: str, road: Road
) -> None:
    """A redirect to another origin drops Authorization (httpx's rule, kept on the worker's road by handing the
    redirect back to httpx), and a gzip body a host sends regardless is stored decoded: the file, not its
    transfer."""
    store = LocalStorage(tmp_path)
    other = file_host.replace("127.0.0.1", "localhost")
    auth = {"127.0.0.1": {"Authorization": "Token r8-test"}}
    output = {"hop": f"{file_host}/moved?to={quote(other + '/echo/x', safe='')}", "z": f"{file_host}/gzipped.txt"}
    async with road() as (http, plain):
        stored = await store_output(store, "results/r.json", output, http, auth_headers=auth, plain=plain, policy=LOCAL)
    hop, z = stored.files
    seen = json.loads(await store.get_bytes(hop.key))
    assert seen["target"] == "/echo/x" and "authorization" not in seen["headers"]
    assert await store.get_bytes(z.key) == b"plain words " * 100 and z.size == 1200


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(("settings", "message"), [
    ({"kind": "s3"}, "storage.bucket: Field required"),
    ({"kind": "s3", "bucket": " "}, "storage.bucket: String should have at least 1 character"),
    ({"kind": "gcs", "bucket": "b"}, "storage.kind: must be one of 'local', 's3', got 'gcs'"),
    ({"kind": "s3", "bucket": "bkt", "endpoint_ulr": "http://x"}, "storage.endpoint_ulr: unknown setting"),
    ({"kind": "s3", "bucket": "bkt", "access_key_id": "AK"}, "storage: access_key_id and secret_access_key: set both"),
    ({"kind": "s3", "bucket": "bkt", "endpoint_url": "not a url"}, "storage.endpoint_url: must be an http"),
    ({"kind": "s3", "bucket": "bkt", "max_threads": 0}, "storage.max_threads: Input should be greater than or equal"),
    ({"kind": "s3", "bucket": "bkt", "read_timeout": -1}, "storage.read_timeout: Input should be greater than 0"),
    ({"kind": "s3", "bucket": "bkt", "addressing_style": "sideways"}, "storage.addressing_style"),
    ({"kind": "local", "bucket": "bkt"}, "storage.bucket: unknown setting"),
])  # fmt: skip
def test_create_storage_names_the_bad_setting(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        create_storage(settings)


async def test_the_yaml_storage_block_reaches_the_store_typed(s3: RcloneS3, bucket: str, tmp_path: Path) -> None:
    """offload.yaml can set the S3 pool and timeouts (they used to be accepted only by create_storage, which the
    config never let them reach), and the validated model is what builds the store: the secret stays a SecretStr
    until boto3's session, and nothing is dumped and checked again."""
    from offload.config import load_settings

    (tmp_path / "offload.yaml").write_text(
        textwrap.dedent(f"""
        storage:
          kind: s3
          endpoint_url: {s3.endpoint_url}
          bucket: {bucket}
          access_key_id: {s3.access_key}
          secret_access_key: ${{S3_SECRET}}
          max_threads: 4
          connect_timeout: 2
          read_timeout: 7
          max_attempts: 1
        """)
    )
    settings = load_settings(tmp_path / "offload.yaml", env={"S3_SECRET": s3.secret_key})
    assert isinstance(settings.storage, S3StorageSettings)
    assert s3.secret_key not in repr(settings) and s3.secret_key not in str(settings.model_dump())
    store = create_storage(settings.storage)
    try:
        assert isinstance(store, S3Storage) and store.settings is settings.storage
        config = vars(store._client.meta.config)  # botocore sets these by setattr: its stubs do not declare them
        assert (config["max_pool_connections"], config["connect_timeout"], config["read_timeout"]) == (4, 2, 7)
        assert config["retries"]["total_max_attempts"] == 2  # the first try and max_attempts retries
        assert store._pool._max_workers == 4
        assert await store.put_json("results/m.json", {}) == f"s3://{bucket}/results/m.json"
    finally:
        await store.aclose()


def test_a_storage_mapping_is_validated_by_the_same_model(tmp_path: Path) -> None:
    """A programmatic caller's mapping goes through the model offload.yaml does: defaults filled, nothing else."""
    store = create_storage({"path": str(tmp_path)})  # kind defaults to local, as in offload.yaml
    assert isinstance(store, LocalStorage) and store.root == tmp_path.resolve()
    with pytest.raises(ConfigError, match=r"^storage\.path: Input should be a valid string"):
        create_storage({"kind": "local", "path": None})
