"""A directory on local disk as object storage: the zero-setup default for development and the demo.

Every write goes to a temporary file in the target's directory, is fsynced, and is then renamed over the target
with `os.replace` (atomic on POSIX), and the directory is fsynced so the rename itself survives a power cut (as
is the parent of each directory the write had to make). A crash at any point leaves either the previous object
or the new one, never half a result; at worst a stray `.<name>.<random>.tmp` file remains beside it, which
readers never see because they only open exact key paths.

File IO blocks, so it runs in asyncio's default thread pool, which is already bounded (min(32, CPUs + 4)).
Content types are not kept: a file system has nowhere standard to put them, and nothing reads them back locally.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import IO, Any

from offload.storage.base import (
    ObjectInfo,
    ObjectNotFound,
    StorageError,
    dump_json,
    join_prefix,
    validate_key,
    write_stream,
)

TMP_SUFFIX = ".tmp"


class LocalStorage:
    """Objects are plain files under `root/prefix/key`."""

    def __init__(self, root: str | os.PathLike[str], prefix: str = "") -> None:
        self.root = Path(root).expanduser().resolve()
        self.prefix = prefix.strip("/")

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r}, prefix={self.prefix!r})"

    def _path(self, key: str) -> Path:
        return self.root / join_prefix(self.prefix, validate_key(key))

    def location(self, key: str) -> str:
        return str(self._path(key))

    async def put_json(self, key: str, obj: Any) -> str:
        return await self.put_bytes(key, dump_json(obj), "application/json")

    async def put_bytes(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> str:
        path = self._path(key)
        await asyncio.to_thread(_atomic_write, path, lambda f: f.write(data))
        return str(path)

    async def put_fileobj(self, key: str, fileobj: IO[bytes], content_type: str = "application/octet-stream") -> str:
        path = self._path(key)
        await asyncio.to_thread(_atomic_write, path, lambda f: shutil.copyfileobj(fileobj, f, 1 << 20))
        return str(path)

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


def _atomic_write(path: Path, write: Any) -> None:
    """Write via a temp file in the same directory (same file system, so the rename is atomic), then replace.
    Directories are made only when the temp file cannot be created (one syscall less per write into an existing
    one), and each one made here is fsynced into its parent too: a file in a directory whose own entry is lost
    to a power cut is lost with it."""
    made: list[Path] = []
    try:
        try:
            fd, tmp = _temp_beside(path)
        except FileNotFoundError:
            made = _make_dirs(path.parent)
            fd, tmp = _temp_beside(path)
    except OSError as exc:
        raise StorageError(f"cannot write under {path.parent}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results should be readable like any other file
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise StorageError(f"writing {path} failed: {exc.strerror or exc}") from None
        raise
    _fsync_dir(path.parent)
    for directory in reversed(made):  # innermost first; the outermost's parent existed before
        _fsync_dir(directory.parent)


def _temp_beside(path: Path) -> tuple[int, str]:
    return tempfile.mkstemp(prefix=f".{path.name[:100]}.", suffix=TMP_SUFFIX, dir=path.parent)


def _make_dirs(directory: Path) -> list[Path]:
    """`directory` and its missing parents, outermost first; returns the ones this call made or found made
    meanwhile by a concurrent writer (whose parent fsync may not have happened yet)."""
    missing: list[Path] = []
    while not directory.is_dir():
        missing.append(directory)
        if directory.parent == directory:
            break
        directory = directory.parent
    made = []
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            d.mkdir()
        made.append(d)
    return made


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable; not every platform can open a directory, and that is no reason to fail."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
