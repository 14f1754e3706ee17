"""Handlers for `offload worker --handler tests.support.handlers:...` in the GPU-worker tests (real subprocesses)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import struct
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import offload
from offload.gpu_worker import JobContext, PermanentError

LOADS = {"count": 0}


def load() -> dict[str, Any]:
    """The load hook: counts its own calls, so a test can see it ran once per process."""
    LOADS["count"] += 1
    return {"model": "tiny", "loads": LOADS["count"]}


def echo(input: Any, ctx: JobContext) -> dict[str, Any]:
    """Sync, with context. OFFLOAD_TEST_SLOW=S makes every job take S seconds (crash and drain tests)."""
    slow = float(os.environ.get("OFFLOAD_TEST_SLOW", "0") or 0)
    if slow:
        time.sleep(slow)
    loaded = ctx.loaded or {}
    return {
        "echo": input,
        "job": ctx.id,
        "attempt": ctx.attempt,
        "pid": os.getpid(),
        "loads": loaded.get("loads"),
        "load_calls": LOADS["count"],
    }


def hang_or_echo(input: Any, ctx: JobContext) -> Any:
    """Sync: an input {"hang": true} blocks its thread for good (a deadlocked CUDA call, a read that never returns),
    anything else is echoed at once. The hung thread writes nothing: only the server's timeout ends its job."""
    if isinstance(input, dict) and input.get("hang"):
        threading.Event().wait()
    return {"echo": input, "job": ctx.id, "pid": os.getpid()}


def boom(input: Any) -> Any:
    """Sync, input only: always fails (retried per the job's policy)."""
    raise RuntimeError(f"boom on {input!r}")


def bad_input(input: Any) -> Any:
    raise PermanentError("this input can never work")


async def async_echo(input: Any, ctx: JobContext) -> dict[str, Any]:
    await asyncio.sleep(0.01)
    return {"async": True, "echo": input, "job": ctx.id}


async def async_slow(input: Any, ctx: JobContext) -> Any:
    """Runs until cancelled (the cancel test)."""
    await asyncio.sleep(120)
    return input


BLOB_MIB = 50


def blob_bytes(seed: str, mib: int = BLOB_MIB) -> Iterator[bytes]:
    """Deterministic pseudo-random MiB blocks (fast: one hash per MiB), so a test can rebuild what `files` wrote."""
    base = hashlib.sha256(seed.encode()).digest() * 32768
    for i in range(mib):
        yield hashlib.sha256(f"{seed}:{i}".encode()).digest() + base[32:]


def tiny_png(seed: str) -> bytes:
    """A valid 1x1 PNG whose pixel depends on `seed`."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    shade = hashlib.sha256(seed.encode()).digest()[0]
    ihdr = struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(bytes([0, shade])))
        + chunk(b"IEND", b"")
    )


def files(input: Any, ctx: JobContext) -> dict[str, Any]:
    """Reads its referenced input both ways (open and download) and returns an image and a 50 MiB blob as Files."""
    with ctx.open(input["audio"]) as f:
        data = f.read()
    out = Path(tempfile.mkdtemp(prefix="handler-"))
    copy = ctx.download(input["audio"], out / "copy.bin")
    if copy.read_bytes() != data:
        raise PermanentError("ctx.download and ctx.open disagree")
    seed = hashlib.sha256(data).hexdigest()
    (out / "render.png").write_bytes(tiny_png(seed))
    with (out / "weights.bin").open("wb") as f:
        for block in blob_bytes(seed):
            f.write(block)
    return {
        "input_sha256": seed,
        "image": offload.File(out / "render.png"),
        "extra": {"blob": offload.File(out / "weights.bin"), "note": "two files"},
        "source": input["audio"],
    }


async def files_async(input: Any, ctx: JobContext) -> dict[str, Any]:
    """The async forms: `await ctx.aopen(ref)` / `ctx.adownload`; the blocking ones refuse on the loop."""
    with await ctx.aopen(input["f"]) as f:
        data = f.read()
    saved = await ctx.adownload(input["f"], Path(tempfile.mkdtemp()) / "f.bin")
    try:
        ctx.open(input["f"])
    except RuntimeError as exc:
        refused = str(exc)
    else:
        refused = ""
    return {
        "upper": offload.File(data.upper(), name="upper.txt"),
        "same": saved.read_bytes() == data,
        "refused": refused,
    }


def logged_echo(input: Any, ctx: JobContext) -> dict[str, Any]:
    """`echo`, and one line per run appended to OFFLOAD_TEST_RUNLOG (the job id): a test counts the runs a GPU
    worker did, including any whose result the store refused."""
    out = echo(input, ctx)
    with open(os.environ["OFFLOAD_TEST_RUNLOG"], "a") as log:
        log.write(ctx.id + "\n")
    return out
