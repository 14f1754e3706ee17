"""The `ssrf` fault: a hostile producer's inputs name an internal service (a recording HTTP listener on loopback,
by the name `localhost`), which the simulator echoes into their outputs. No dispatch worker may fetch it, and no
stored output may hold a copy of it: the copy's egress rule refuses it (offload/egress.py), and the job is dead with
the generic line."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson

REFUSED = "could not be copied (the worker's log says why)"  # the generic line (offload/storage/outputs.py)


class Internal:
    """The internal service: answers every GET with a secret and records each request a dispatch worker made (its
    User-Agent; the simulator, as a provider would, fetches loopback URLs in its inputs too)."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        hits = self.hits

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.headers.get("User-Agent", "").startswith("offload/"):
                    hits.append(self.path)
                body = b"internal secret"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://localhost:{self._server.server_address[1]}/internal/"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def hostile(job_input: dict[str, Any], url: str, input_id: str) -> dict[str, Any]:
    """`job_input` naming the internal service, where the simulator's echo keeps it a whole string."""
    target = job_input.get("metadata", job_input)  # a chat body echoes as text: its URL is never a file
    target["image"] = f"{url}{input_id}"
    return job_input


def verdict(data: Any, find: Callable[[str], None]) -> dict[str, Any]:
    """ssrf_fetched (requests that reached the internal service from a worker) and ssrf_copied (stored outputs
    with a copy of it) must be 0; ssrf_refused counts the hostile jobs dead with the generic line."""
    url = data.internal_url
    if url is None:
        return {}
    hostile = [j for j, sent in data.sent.items() if url in orjson.dumps(sent).decode()]
    copied = []
    for job_id in hostile:
        h = data.records.get(job_id) or {}
        stored = data.outputs.get(h.get("output_key") or f"results/{job_id}.json")
        if (
            h.get("state") == "succeeded"
            and stored is not None
            and b'"_offload_files"' in stored
            and url.encode() in stored
        ):
            copied.append(job_id)
    for path in data.internal_hits[:5]:
        find(f"ssrf: a dispatch worker fetched the internal service ({path})")
    for job_id in copied[:5]:
        find(f"ssrf: {job_id}'s stored output holds a copy of the internal service")
    refused = sum(1 for j in hostile if REFUSED in (data.records.get(j) or {}).get("error", ""))
    return {
        "ssrf_jobs": len(hostile),
        "ssrf_refused": refused,
        "ssrf_fetched": len(data.internal_hits),
        "ssrf_copied": len(copied),
    }
