"""Input files the simulator fetches, as a provider does with a URL it is given (Replicate and fal download file
inputs; a RunPod handler would).

Every string in a submitted input that is, in its entirety, an http(s) URL on a loopback host is downloaded in the
background, streamed and hashed, and the result is kept per remote job: `GET /_sim/jobs/{id}/inputs` answers
`{"pending": n, "files": [{"url", "status", "size", "sha256"}]}` (the URL without its query, whose signature is a
credential). Values under a key naming a webhook are callbacks, not files, and are left alone. Only loopback
hosts: the simulator stands in for a provider next to offload in tests and demos, and must never reach out to
whatever host an input happens to name.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import re
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import httpx

from offload.http_client import make_client

_URL = re.compile(r"https?://[^\s\"'<>]+", re.IGNORECASE)
CHUNK = 1 << 20


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            if "webhook" not in str(k).lower():  # a callback address, not a file to fetch
                yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


def _loopback(url: str) -> bool:
    try:
        host = urlsplit(url).hostname or ""
    except ValueError:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _shown(url: str) -> str:
    """scheme://host[:port]/path: a presigned URL's query is its credential (the simulator stands alone, so it does
    not borrow offload.redact's copy of this rule)."""
    p = urlsplit(url)
    return f"{p.scheme}://{p.hostname}{f':{p.port}' if p.port else ''}{p.path}"


def input_urls(payload: Any) -> list[str]:
    return list(dict.fromkeys(s for s in _strings(payload) if _URL.fullmatch(s) and _loopback(s)))


class InputFetcher:
    """Downloads of submitted input URLs, by remote job id. Single event loop, like the rest of the simulator."""

    def __init__(self) -> None:
        self.files: dict[str, list[dict[str, Any]]] = {}
        self.pending: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def watch(self, job_id: str, payload: Any) -> None:
        urls = input_urls(payload)
        if not urls:
            return
        self.files[job_id] = []
        self.pending[job_id] = len(urls)
        for url in urls:
            task = asyncio.get_running_loop().create_task(self._fetch(job_id, url))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _fetch(self, job_id: str, url: str) -> None:
        entry: dict[str, Any] = {"url": _shown(url), "status": None, "size": 0, "sha256": None}
        digest = hashlib.sha256()
        try:
            async with (
                make_client("sim_fetch") as http,
                http.stream("GET", url) as resp,
            ):
                entry["status"] = resp.status_code
                async for chunk in resp.aiter_raw(CHUNK):
                    digest.update(chunk)
                    entry["size"] += len(chunk)
            if entry["status"] == 200:
                entry["sha256"] = digest.hexdigest()
        except httpx.HTTPError as exc:
            entry["error"] = type(exc).__name__
        finally:
            if job_id in self.files:
                self.files[job_id].append(entry)
                self.pending[job_id] -= 1

    def view(self, job_id: str) -> dict[str, Any] | None:
        if job_id not in self.files:
            return None
        return {"pending": self.pending[job_id], "files": list(self.files[job_id])}

    def clear(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.files.clear()
        self.pending.clear()
