"""Job outputs and the files they point at.

Real providers return URLs to files they host and delete later (Replicate ~1 h, RunPod 30 min), so storage code
must copy them. The simulator's outputs carry such URLs, served by `GET /_sim/files/{name}`. A file's bytes are a
pure function of its name (`{job_id}-{index}.{ext}`), so nothing is stored per file, a copy can be verified by
fetching again, and the file disappears (404) when its job expires, just like the real thing.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from typing import Any

import orjson

CONTENT_TYPES = {
    "png": "image/png",
    "txt": "text/plain; charset=utf-8",
    "json": "application/json",
    "bin": "application/octet-stream",
}


def file_names(job_id: str, count: int, ext: str) -> list[str]:
    return [f"{job_id}-{i}.{ext}" for i in range(count)]


def file_urls(base_url: str, job_id: str, count: int, ext: str) -> list[str]:
    return [f"{base_url}/_sim/files/{name}" for name in file_names(job_id, count, ext)]


def output_for(base_url: str, job_id: str, payload: Any, count: int, ext: str) -> dict[str, Any]:
    """The output every family returns: the input echoed back (tests compare it) and the file URLs."""
    return {"echo": payload, "files": file_urls(base_url, job_id, count, ext)}


def parse_name(name: str) -> tuple[str, str] | None:
    """`{job_id}-{index}.{ext}` → (job_id, ext); None for names the simulator never hands out."""
    stem, dot, ext = name.rpartition(".")
    job_id, dash, index = stem.rpartition("-")
    if not (dot and dash and job_id and index.isdigit() and ext in CONTENT_TYPES):
        return None
    return job_id, ext


def file_bytes(name: str, ext: str, size: int) -> bytes:
    """Deterministic content: a real (1x1) PNG naming the file, text, JSON, or pseudo-random bytes."""
    if ext == "png":
        return _png(name)
    if ext == "txt":
        return f"simulated output file {name}\n".encode()
    if ext == "json":
        return orjson.dumps({"name": name, "simulated": True})
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.sha256(f"{name}:{counter}".encode()).digest()
        counter += 1
    return bytes(out[:size])


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _png(name: str) -> bytes:
    """A valid 1x1 grey PNG whose tEXt chunk holds the file name, so every file has distinct bytes."""
    shade = hashlib.sha256(name.encode()).digest()[0]
    ihdr = struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0)  # 1x1, 8-bit greyscale
    idat = zlib.compress(bytes([0, shade]))  # filter byte 0, one pixel
    text = b"Title\x00" + name.encode("latin-1", "replace")
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", ihdr)
        + _chunk(b"tEXt", text)
        + _chunk(b"IDAT", idat)
        + _chunk(b"IEND", b"")
    )
