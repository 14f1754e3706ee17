"""CPU per HTTP request at high concurrency: httpx's own pool, the `httpx-aiohttp` package, and offload's
transport (`offload/backends/transport.py`), measured side by side in one run.

Why this exists: the dispatch worker keeps thousands of polls in flight, and the HTTP client's own bookkeeping
decides how many fit on one core. offload keeps its own small aiohttp-backed transport only while it measures
faster than the library that does the same job; this script is that measurement.

A JSON server runs in a separate process (so its CPU is not counted); the client process sends N requests with C
in flight through each transport in turn (interleaved over `--reps` rounds) and reports the client's CPU seconds
per request. One run here (3,000 requests, 1,000 in flight, median of 3): offload's transport 0.41 ms through
the httpx API and 0.18 ms through its `send` fast path (the worker's submit/poll path), httpx-aiohttp 0.43 ms,
httpx's own pool 2.88 ms. The library is no faster through the same API, the fast path costs 0.42x of it, and
the library maps a request that was sent and then dropped by the server (aiohttp's ServerDisconnectedError) to
httpx.ConnectTimeout, i.e. "never sent": wrong for a worker that must not pay twice for a submit. So offload keeps
its own. Last line JSON: {"<transport>_cpu_ms": ..., ...} plus ratios against offload's transport.

    python bench/transport.py [--requests 5000] [--concurrency 1000] [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import ssl
import statistics
import time
from collections.abc import Awaitable, Callable

import httpx

from offload.backends.transport import AiohttpTransport as OffloadTransport

BODY = b'{"id": "abc", "status": "running", "output": null}'


def _serve(port: int, ready: multiprocessing.synchronize.Event) -> None:
    """A minimal keep-alive HTTP/1.1 server answering every request with the same small JSON body."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reply = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
            len(BODY),
            BODY,
        )
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                if length:
                    await reader.readexactly(length)
                writer.write(reply)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
        ready.set()
        await server.serve_forever()

    asyncio.run(main())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _drive(send: Callable[[], Awaitable[None]], requests: int, concurrency: int) -> float:
    """CPU seconds of this process per request, for `requests` calls with `concurrency` in flight."""
    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate:
            await send()

    cpu = time.process_time()
    await asyncio.gather(*(one() for _ in range(requests)))
    return (time.process_time() - cpu) / requests


async def _round(url: str, requests: int, concurrency: int) -> dict[str, float]:
    ctx = ssl.create_default_context()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(30.0)
    out: dict[str, float] = {}

    ours = OffloadTransport(max_connections=concurrency, ssl_context=ctx)
    async with httpx.AsyncClient(transport=ours, timeout=timeout) as client:
        await client.get(url)  # warm the pool's first connection
        out["offload_httpx_api"] = await _drive(lambda: _get(client, url), requests, concurrency)
        out["offload_send"] = await _drive(lambda: _send(ours, url), requests, concurrency)

    from httpx_aiohttp import AiohttpTransport as LibraryTransport

    library = LibraryTransport(limits=limits, verify=ctx)
    async with httpx.AsyncClient(transport=library, timeout=timeout) as client:
        await client.get(url)
        out["httpx_aiohttp"] = await _drive(lambda: _get(client, url), requests, concurrency)

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        await client.get(url)
        out["httpx_pool"] = await _drive(lambda: _get(client, url), requests, concurrency)
    return out


async def _get(client: httpx.AsyncClient, url: str) -> None:
    response = await client.get(url)
    response.json()


async def _send(transport: OffloadTransport, url: str) -> None:
    response = await transport.send("GET", url, headers={}, content=None, timeout=30.0)
    response.json()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    port = _free_port()
    ready = multiprocessing.Event()
    server = multiprocessing.Process(target=_serve, args=(port, ready), daemon=True)
    server.start()
    try:
        if not ready.wait(10):
            raise SystemExit("the JSON server did not start")
        url = f"http://127.0.0.1:{port}/v2/x/status/abc"
        rounds = [asyncio.run(_round(url, args.requests, args.concurrency)) for _ in range(args.reps)]
    finally:
        server.terminate()
        server.join(5)
    medians = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
    for name, value in medians.items():
        print(f"{name:>18}: {value * 1000:.3f} ms CPU per request")
    summary = {f"{name}_cpu_ms": round(value * 1000, 4) for name, value in medians.items()}
    base = medians["offload_httpx_api"]
    summary.update({f"{name}_vs_offload": round(value / base, 2) for name, value in medians.items()})
    summary.update({"requests": args.requests, "concurrency": args.concurrency, "reps": args.reps})
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
