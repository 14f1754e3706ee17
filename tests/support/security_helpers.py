"""Helpers for the security tests: a real HTTP server that echoes what it is sent (a provider that reflects the
request, credentials included, into its error), a dump of everything stored in a Redis database, and a scan of
texts for secrets."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import redis


class Echo:
    """What the echo server received: (method, path, headers, body) per request."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str], str]] = []
        self.url = ""


@contextmanager
def echo_server() -> Iterator[Echo]:
    """GET /v2/pods answers an empty list (a RunPod account with no pods); every other request is refused with
    a 400 whose body repeats the request's headers and body, the way careless APIs do."""
    echo = Echo()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length).decode(errors="replace") if length else ""
            echo.requests.append((self.command, self.path, dict(self.headers), body))
            if self.command == "GET" and self.path.startswith("/v2/pods"):
                status, text = 200, "[]"
            else:
                status = 400
                text = f"pod request rejected: {body} headers: {dict(self.headers)}"
            data = text.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _answer

        def log_message(self, *args: Any) -> None:
            return None

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    echo.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield echo
    finally:
        httpd.shutdown()
        httpd.server_close()


def redis_dump(url: str) -> str:
    """Every key of the database and everything in it, as one text."""
    r = redis.Redis.from_url(url, decode_responses=True)
    out: list[str] = []
    try:
        for key in r.scan_iter(count=1000):
            kind = r.type(key)
            value: Any
            if kind == "string":
                value = r.get(key)
            elif kind == "hash":
                value = r.hgetall(key)
            elif kind == "list":
                value = r.lrange(key, 0, -1)
            elif kind == "set":
                value = sorted(r.smembers(key))
            elif kind == "zset":
                value = r.zrange(key, 0, -1, withscores=True)
            elif kind == "stream":
                value = r.xrange(key)
            else:
                value = kind
            out.append(f"{key} {json.dumps(value, default=str)}")
    finally:
        r.close()
    return "\n".join(out)


def leaks(secrets: dict[str, str], texts: Iterable[tuple[str, str]]) -> list[str]:
    """(secret name, where) for every secret found in any (where, text)."""
    return [f"{name} in {where}" for where, text in texts for name, value in secrets.items() if value in text]
