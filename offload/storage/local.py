"""A directory on local disk as object storage: the zero-setup default for development and the demo.

Every write goes to a temporary file in the target's directory, is made durable, and is then renamed over the
target with `os.replace` (atomic on POSIX), and the directory is made durable so the rename itself survives a
power cut (as is the parent of each directory the write had to make). A crash at any point leaves either the
previous object or the new one, never half a result; at worst a stray `.<name>.<random>.tmp` file remains beside
it, which readers never see because they only open exact key paths.

File IO blocks, so it never runs on the event loop: objects up to `INLINE_BYTES` are written by the group-commit
lanes (fsyncs.py, `_commit`: a burst's writes made durable together), larger ones in asyncio's default thread
pool, which is already bounded (min(32, CPUs + 4)).
Content types are not kept: a file system has nowhere standard to put them, and nothing reads them back locally.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import itertools
import os
import secrets
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from offload.storage.base import (
    ObjectInfo,
    ObjectNotFound,
    Put,
    StorageError,
    dump_json,
    join_prefix,
    validate_key,
    write_stream,
)
from offload.storage.fsyncs import GroupCommit, Pending

TMP_SUFFIX = ".tmp"
COPY_CHUNK = 1 << 20
INLINE_BYTES = 1 << 20  # objects up to this size are written by the group-commit lanes (see _small_write)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
_TOKEN = secrets.token_hex(6)  # this process's temp-file names (see _temp_beside)
_SERIAL = itertools.count()


def _new_token() -> None:
    """A forked child names its temp files apart from its parent's (O_EXCL would catch a clash, at a retry)."""
    global _TOKEN
    _TOKEN = secrets.token_hex(6)


os.register_at_fork(after_in_child=_new_token)


class LocalStorage:
    """Objects are plain files under `root/prefix/key`."""

    def __init__(self, root: str | os.PathLike[str], prefix: str = "") -> None:
        self.root = Path(root).expanduser().resolve()
        self.prefix = prefix.strip("/")
        self._base = os.fspath(self.root / self.prefix) if self.prefix else os.fspath(self.root)

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r}, prefix={self.prefix!r})"

    def _path(self, key: str) -> Path:
        return self.root / join_prefix(self.prefix, validate_key(key))

    def _target(self, key: str) -> str:
        """`_path` as a string, for the writes: a burst of outputs builds thousands of them on the event loop."""
        return os.path.join(self._base, validate_key(key))

    def location(self, key: str) -> str:
        return self._target(key)

    async def put_json(self, key: str, obj: Any) -> str:
        return await self.put_bytes(key, dump_json(obj), "application/json")

    async def put_bytes(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> str:
        path = self._target(key)
        if len(data) <= INLINE_BYTES:
            await _small_write(path, data)
        else:
            await asyncio.to_thread(_atomic_write, path, lambda fd: _write_all(fd, data))
        return path

    async def put_fileobj(self, key: str, fileobj: IO[bytes], content_type: str = "application/octet-stream") -> str:
        path = self._target(key)
        small = _small_remainder(fileobj)
        if small is not None:
            await _small_write(path, small)
        else:
            await asyncio.to_thread(_atomic_write, path, lambda fd: _copy_into(fd, fileobj))
        return path

    async def put_all(self, puts: Sequence[Put]) -> list[str]:
        targets = [self._target(put.key) for put in puts]
        if all(len(put.data) <= INLINE_BYTES for put in puts):
            await _GROUP.write_many([(target, put.data) for target, put in zip(targets, puts, strict=True)])
        else:  # a large one is written by a thread of its own: one after the other, each durable before the next
            for put in puts:
                await self.put_bytes(put.key, put.data, put.content_type)
        return targets

    async def get_bytes(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return await asyncio.to_thread(path.read_bytes)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(f"no object at {path}") from None
        except OSError as exc:
            raise StorageError(f"reading {path} failed: {exc.strerror or exc}") from None

    async def exists(self, key: str) -> bool:
        return await asyncio.to_thread(self._path(key).is_file)

    async def presigned_url(self, key: str, expires_s: int = 3600) -> str:
        """A `file://` URL; nothing expires locally, so `expires_s` is ignored."""
        return self._path(key).as_uri()

    async def download(self, key: str, path: Path) -> tuple[int, str]:
        source = self._path(key)

        def copy() -> tuple[int, str]:
            try:
                with source.open("rb") as f:
                    return write_stream(path, iter(lambda: f.read(1 << 20), b""))
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                raise ObjectNotFound(f"no object at {source}") from None

        return await asyncio.to_thread(copy)

    async def head(self, key: str) -> ObjectInfo | None:
        path = self._path(key)
        try:
            stat = await asyncio.to_thread(path.stat)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return ObjectInfo(key, stat.st_size, None, stat.st_mtime) if path.is_file() else None

    async def delete(self, key: str) -> None:
        path = self._path(key)
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            await asyncio.to_thread(path.unlink)

    async def list_objects(self, prefix: str, limit: int = 1000, after: str = "") -> list[ObjectInfo]:
        """Keys are file paths, so a prefix is a directory plus the start of a name in it."""
        base = self.root / self.prefix if self.prefix else self.root

        def listing() -> list[ObjectInfo]:
            head = prefix.rpartition("/")[0]
            directory = base / head if head else base
            if not directory.is_dir():
                return []
            found: list[ObjectInfo] = []
            for path in sorted(directory.rglob("*")):
                rel = path.relative_to(base).as_posix()
                if rel <= after or not rel.startswith(prefix) or path.name.endswith(TMP_SUFFIX):
                    continue
                if path.is_file():
                    stat = path.stat()
                    found.append(ObjectInfo(rel, stat.st_size, None, stat.st_mtime))
                    if len(found) >= limit:
                        break
            return found

        return await asyncio.to_thread(listing)

    async def presigned_put_url(self, key: str, expires_s: int, content_type: str, size: int) -> str | None:
        """A directory cannot take an HTTP PUT: files over the HTTP API need S3 storage."""
        return None

    async def abort_uploads(self, prefix: str, older_than_s: float) -> int:
        """Local writes go through temp files that a failure removes; there are no multipart uploads."""
        return 0

    async def aclose(self) -> None:
        return None


def _small_remainder(fileobj: IO[bytes]) -> bytes | None:
    """The rest of `fileobj` when it is seekable and at most INLINE_BYTES long (a spooled copy of a provider's
    file, typically), else None (it is then streamed in a thread)."""
    try:
        if not fileobj.seekable():
            return None
        here = fileobj.tell()
        size = fileobj.seek(0, os.SEEK_END) - here
        fileobj.seek(here)
    except (AttributeError, OSError, ValueError):  # not a real file object: streamed, as any other
        return None
    return fileobj.read() if size <= INLINE_BYTES else None


# The group-commit lanes every local store of the process shares (see fsyncs.py); the lambda looks `_commit` up
# at call time.
_GROUP = GroupCommit(lambda batch: _commit(batch))
GROUP_MIN = 8  # a batch of at least this many writes is made durable with syncfs(2), two calls in all
_LIBC = ctypes.CDLL(None, use_errno=True)
_SYNCFS: Callable[[int], int] | None = getattr(_LIBC, "syncfs", None)


def _syncfs_reports_errors(release: str) -> bool:
    """syncfs(2) reports writeback errors since Linux 5.8; before, it returned 0 whatever was lost."""
    try:
        major, minor = (int(part) for part in release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (5, 8)


if sys.platform != "linux" or not _syncfs_reports_errors(os.uname().release):
    _SYNCFS = None


async def _small_write(target: str, data: bytes) -> None:
    """`_atomic_write` for a small object, done by a group-commit lane (fsyncs.py) together with every other
    small write in flight: the event loop only hands the bytes over and waits."""
    await _GROUP.write(target, data)


def _commit(batch: list[Pending]) -> None:
    """Write a batch of small objects atomically and durably: each to a temp file, then made durable, then
    renamed over its target, then the renames and any directories made durable. A large batch (`GROUP_MIN`) is
    made durable with one syncfs(2) per step and file system (the whole file system's dirty data and journal
    in one call: far less kernel CPU than fsyncing each file and directory; docs/explanation/performance.md,
    *Local storage*);
    a small one, or where syncfs cannot report a lost write, fsyncs each file, then each directory once. A
    failure fails the writes it concerns, never the whole batch, and removes their temp files."""
    grouped = _SYNCFS is not None and len(batch) >= GROUP_MIN
    for p in batch:
        _stage(p, grouped)
    staged = [p for p in batch if p.error is None]
    if grouped:
        _sync_groups(staged)
    for p in staged:
        if p.error is None:
            _rename(p)
    renamed = [p for p in staged if p.error is None]
    if grouped:
        _sync_groups(renamed)
        return
    synced: set[str] = set()
    for p in renamed:  # every rename of the batch has happened: each directory once
        for directory in (os.path.dirname(p.target), *(os.path.dirname(d) for d in reversed(p.made))):
            if directory not in synced:
                synced.add(directory)
                _fsync_dir(directory)


def _stage(p: Pending, grouped: bool) -> None:
    """Write `p`'s bytes to a temp file beside its target: fsynced now, or (`grouped`) noting its file system
    for the batch's syncfs."""
    try:
        fd, p.tmp, p.made = _open_temp(p.target, os.path.dirname(p.target))
    except StorageError as exc:
        p.error = exc
        return
    try:
        try:
            _write_all(fd, p.data)
        except BaseException:
            os.close(fd)
            raise
        if grouped:
            try:
                p.device = os.fstat(fd).st_dev  # the file system its batch's syncfs must cover
            finally:
                os.close(fd)
        else:
            _sync_and_close(fd)  # closes it, also when the fsync fails
    except OSError as exc:
        _failed(p, exc)


def _rename(p: Pending) -> None:
    """Put a staged write in place, unless its caller gave up or its group already failed."""
    if p.abandoned:  # the caller gave up before the rename: the previous object stays
        _failed(p, None)
        return
    if p.orphaned:  # an earlier write of its group failed: never an output without its files
        _failed(p, None, f"writing {p.target} skipped: an earlier object of the same write failed")
        return
    try:
        os.replace(p.tmp, p.target)
    except OSError as exc:
        _failed(p, exc)


def _sync_groups(batch: list[Pending]) -> None:
    """One `_syncfs` per file system the batch's writes are on (each noted when its temp file was written); a
    failure fails that file system's writes."""
    by_device: dict[int, list[Pending]] = {}
    for p in batch:
        by_device.setdefault(p.device, []).append(p)
    for writes in by_device.values():
        try:
            fd = os.open(os.path.dirname(writes[0].target), os.O_RDONLY)
            try:
                _syncfs(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            for p in writes:
                _failed(p, exc)


def _syncfs(fd: int) -> None:
    """syncfs(2) on the file system holding `fd` (only called where `_SYNCFS` is set)."""
    assert _SYNCFS is not None
    if _SYNCFS(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _failed(p: Pending, exc: OSError | None, reason: str = "") -> None:
    """Fail one write of a batch (`exc` None and no `reason`: its caller gave up) and remove its temp file, if it
    is still there."""
    with contextlib.suppress(OSError):
        os.unlink(p.tmp)
    if exc is not None:
        p.error = StorageError(f"writing {p.target} failed: {exc.strerror or exc}")
    elif reason:
        p.error = StorageError(reason)
    else:
        p.error = asyncio.CancelledError()


def _sync_and_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: str, write: Callable[[int], None]) -> None:
    """Write via a temp file in the same directory (same file system, so the rename is atomic), then replace.
    Directories are made only when the temp file cannot be created (one syscall less per write into an existing
    one), and each one made here is fsynced into its parent too: a file in a directory whose own entry is lost
    to a power cut is lost with it.

    Plain `os` calls on a file descriptor and string paths, not `tempfile.mkstemp` and a file object: this runs in
    a thread while the worker's event loop needs the GIL, and each Python step here is taken from the loop (see
    docs/explanation/performance.md, *Local storage*). The temp file is created with mode 0644 under the process
    umask, as any other file is."""
    target = os.fspath(path)
    directory = os.path.dirname(target)
    fd, tmp, made = _open_temp(target, directory)
    try:
        try:
            write(fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise StorageError(f"writing {target} failed: {exc.strerror or exc}") from None
        raise
    _fsync_dir(directory)
    for made_dir in reversed(made):  # innermost first; the outermost's parent existed before
        _fsync_dir(os.path.dirname(made_dir))


def _open_temp(target: str, directory: str) -> tuple[int, str, list[str]]:
    """A temp file beside `target`, its directories made when missing: (fd, temp path, directories made, outermost
    first). Directories are made only when the temp file cannot be created (one syscall less per write into an
    existing one)."""
    made: list[str] = []
    try:
        try:
            fd, tmp = _temp_beside(target)
        except FileNotFoundError:
            made = _make_dirs(directory)
            fd, tmp = _temp_beside(target)
    except OSError as exc:
        raise StorageError(f"cannot write under {directory}: {exc.strerror or exc}") from None
    return fd, tmp, made


def _temp_beside(target: str) -> tuple[int, str]:
    """A new temp file next to `target`, named `.<name>.<process token>-<n>.tmp`: unique within the process by the
    counter, across processes by the token, and O_EXCL settles the rest (a stray file of a process long gone)."""
    head, name = os.path.split(target)
    prefix = os.path.join(head, f".{name[:100]}.{_TOKEN}-")
    for _ in range(100):
        tmp = f"{prefix}{next(_SERIAL)}{TMP_SUFFIX}"
        try:
            return os.open(tmp, _CREATE, 0o644), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temp file name", prefix)


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """`os.write` may write less than it was given (a signal, a full pipe): loop until all of it is out."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _copy_into(fd: int, fileobj: IO[bytes]) -> None:
    while chunk := fileobj.read(COPY_CHUNK):
        _write_all(fd, chunk)


def _make_dirs(directory: str) -> list[str]:
    """`directory` and its missing parents, outermost first; returns the ones this call made or found made
    meanwhile by a concurrent writer (whose parent fsync may not have happened yet). Made from the inside out:
    a `mkdir` that finds its parent missing is itself the test, so a key's new directories cost one call each
    and one more per level that was missing, not a stat of every level first."""
    missing: list[str] = []
    level = directory
    while True:
        try:
            os.mkdir(level)
        except FileNotFoundError:
            parent = os.path.dirname(level)
            if parent == level:
                raise
            missing.append(level)
            level = parent
            continue
        except FileExistsError:
            pass  # a concurrent writer made it: its parent's fsync is still ours to wait for
        break
    for child in reversed(missing):  # outermost first
        with contextlib.suppress(FileExistsError):
            os.mkdir(child)
    return [level, *reversed(missing)]


def _fsync_dir(directory: str | Path) -> None:
    """Make the rename durable; not every platform can open a directory, and that is no reason to fail."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
