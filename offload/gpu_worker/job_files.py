"""Files for a GPU worker's handler, through URLs the server signs for the job it holds: no storage credentials
on the rented machine.

`ctx.download(ref, path)` and `ctx.open(ref)` fetch an input file (a `{"$file": ...}` reference in the job input)
through a presigned GET the server issues only for that job's own inputs, checking its size and SHA-256 on the
way. They block, for the usual synchronous handler running in its thread; an async handler awaits
`ctx.adownload` / `ctx.aopen` instead. A handler may return `offload.File(...)` values anywhere in its output:
each is PUT to a URL the server signs under the job's output prefix, and replaced by its reference before the
output is completed; the server checks at complete that every reference is the job's own and exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import tempfile
import threading
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import IO, Any, TypeVar

import httpx

from offload.errors import WorkerError
from offload.files import REF_KEY, File, files_in, is_reference, reference, replace
from offload.gpu_worker.server_api import ServerApi
from offload.http_client import make_client

T = TypeVar("T")
CHUNK = 1 << 20
SPOOL_BYTES = 8 << 20
_ETAG = re.compile(r"^[0-9a-f]{32}$")


class FileTransferError(WorkerError):
    """Downloading an input or uploading an output file failed: a failed attempt, tried again."""


class JobFiles:
    """The file side of one job's `JobContext`."""

    def __init__(self, api: ServerApi, loop: asyncio.AbstractEventLoop, worker_id: str, job_id: str, token: str):
        self.api, self.loop = api, loop
        self.worker_id, self.job_id, self.token = worker_id, job_id, token
        self._loop_thread = threading.get_ident()  # built on the loop's thread, where blocking calls would deadlock

    # -- inputs -----------------------------------------------------------------------------------

    async def adownload(self, ref: Any, path: str | os.PathLike[str]) -> Path:
        """Save an input file at `path` (written to a temp file beside it, renamed when complete and checked)."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name[:100]}.", suffix=".part", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                await self._fetch(ref, out)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return target

    async def aopen(self, ref: Any) -> IO[bytes]:
        """The input file as a readable binary file (in memory up to 8 MiB, else a temp file); close it after use."""
        spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)  # noqa: SIM115 - handed to the caller
        try:
            await self._fetch(ref, spool)
        except BaseException:
            spool.close()
            raise
        spool.seek(0)
        return spool

    def download(self, ref: Any, path: str | os.PathLike[str]) -> Path:
        return self._blocking(self.adownload(ref, path))

    def open(self, ref: Any) -> IO[bytes]:
        return self._blocking(self.aopen(ref))

    def _blocking(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.get_ident() == self._loop_thread:
            coro.close()
            raise RuntimeError("ctx.open/ctx.download block: from an async handler, await ctx.aopen/ctx.adownload")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _fetch(self, ref: Any, out: IO[bytes]) -> None:
        if not is_reference(ref):
            raise TypeError(f"expected a file reference ({{'$file': ...}}), got {type(ref).__name__}")
        reply = await self.api.call(
            f"/v1/workers/{self.worker_id}/jobs/{self.job_id}/files/url", {"token": self.token, "key": ref[REF_KEY]}
        )
        digest, size = hashlib.sha256(), 0
        async with make_client("file_transfer") as http, http.stream("GET", reply["url"]) as resp:
            if resp.status_code != 200:
                raise FileTransferError(f"downloading {ref[REF_KEY]}: HTTP {resp.status_code}")
            async for chunk in resp.aiter_raw(CHUNK):
                digest.update(chunk)
                size += len(chunk)
                await asyncio.to_thread(out.write, chunk)
        if ref.get("size") is not None and size != ref["size"]:
            raise FileTransferError(f"downloading {ref[REF_KEY]}: got {size} bytes, the reference says {ref['size']}")
        if ref.get("sha256") and digest.hexdigest() != ref["sha256"]:
            raise FileTransferError(f"downloading {ref[REF_KEY]}: SHA-256 mismatch")

    # -- outputs ----------------------------------------------------------------------------------

    async def upload_outputs(self, output: Any) -> Any:
        """`output` with every `File` uploaded under the job's output prefix and replaced by its reference."""
        found = files_in(output)
        if not found:
            return output
        refs: dict[int, dict[str, Any]] = {}
        async with make_client("file_transfer") as http:
            for index, (_, file) in enumerate(found):
                if id(file) not in refs:
                    refs[id(file)] = await self._upload(http, index, file)
        return replace(output, lambda v: refs[id(v)] if isinstance(v, File) else v)

    async def _upload(self, http: httpx.AsyncClient, index: int, file: File) -> dict[str, Any]:
        with contextlib.ExitStack() as stack:
            source = stack.enter_context(file.open())
            size = file.size_hint()
            if size is None:  # a stream: spool it to learn its size (a signed PUT needs the exact length)
                spool = stack.enter_context(tempfile.TemporaryFile())
                size = await asyncio.to_thread(_copy, source, spool)
                spool.seek(0)
                source = spool
            target = await self.api.call(
                f"/v1/workers/{self.worker_id}/jobs/{self.job_id}/files/upload",
                {
                    "token": self.token,
                    "index": index,
                    "name": file.name,
                    "size": size,
                    "content_type": file.content_type,
                },
            )
            sha, md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)

            async def body() -> AsyncIterator[bytes]:
                while chunk := await asyncio.to_thread(source.read, CHUNK):
                    sha.update(chunk)
                    md5.update(chunk)
                    yield chunk

            resp = await http.put(target["url"], content=body(), headers=target["headers"])
            if resp.status_code not in (200, 201, 204):
                raise FileTransferError(f"uploading output file {file.name}: HTTP {resp.status_code}")
            etag = resp.headers.get("etag", "").strip('"')
            if _ETAG.match(etag) and etag != md5.hexdigest():
                raise FileTransferError(f"uploading output file {file.name}: checksum mismatch (ETag {etag})")
            return reference(target["key"], size, sha.hexdigest(), file.content_type)
        raise AssertionError("unreachable")


def _copy(source: IO[bytes], dest: IO[bytes]) -> int:
    total = 0
    while chunk := source.read(CHUNK):
        dest.write(chunk)
        total += len(chunk)
    return total
