"""A directory on local disk as object storage: the zero-setup default for development and the demo.

Every write goes to a temporary file in the target's directory, is fsynced, and is then renamed over the target
with `os.replace` (atomic on POSIX), and the directory is fsynced so the rename itself survives a power cut. A
crash at any point leaves either the previous object or the new one, never half a result; at worst a stray
`.<name>.<random>.tmp` file remains beside it, which readers never see because they only open exact key paths.

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

from offload.storage.base import ObjectNotFound, StorageError, dump_json, join_prefix, validate_key

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

    async def aclose(self) -> None:
        return None


def _atomic_write(path: Path, write: Any) -> None:
    """Write via a temp file in the same directory (same file system, so the rename is atomic), then replace."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:100]}.", suffix=TMP_SUFFIX, dir=path.parent)
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


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable; not every platform can open a directory, and that is no reason to fail."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
