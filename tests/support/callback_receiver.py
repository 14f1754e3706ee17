"""A producer's webhook receiver for the completion-webhook tests: a real HTTP server on a free port (threads),
recording every POST (body bytes exactly as received, headers) and answering with the statuses it is told."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson


@dataclass
class Received:
    body: bytes
    headers: dict[str, str]
    status: int | str  # what the receiver answered; "held" for a request it never answered

    @property
    def job_id(self) -> str:
        return str(orjson.loads(self.body)["data"]["id"])


@dataclass
class Receiver:
    url: str
    answers: list[int] = field(default_factory=list)  # the next POSTs' statuses, in order; then `otherwise`
    otherwise: int = 200
    hold_first: bool = False  # the first POST waits for `release` and its client gets no answer in time
    release: threading.Event = field(default_factory=threading.Event)
    received: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def accepted(self, job_id: str | None = None) -> list[Received]:
        with self.lock:
            return [r for r in self.received if r.status == 200 and (job_id is None or r.job_id == job_id)]

    def of(self, job_id: str) -> list[Received]:
        with self.lock:
            return [r for r in self.received if r.job_id == job_id]


@contextmanager
def receiver() -> Iterator[Receiver]:
    state: list[Receiver] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            rec = state[0]
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            headers = {k.lower(): v for k, v in self.headers.items()}
            with rec.lock:
                held = rec.hold_first and not rec.received
                status: int | str = "held" if held else (rec.answers.pop(0) if rec.answers else rec.otherwise)
                rec.received.append(Received(body, headers, status))
            if held:
                rec.release.wait(60)
                return  # the connection closes unanswered
            assert isinstance(status, int)
            self.send_response(status)
            answer = b"receiver says no" if status >= 300 else b"ok"
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    state.append(Receiver(f"http://127.0.0.1:{httpd.server_address[1]}/hooks/offload"))
    thread = threading.Thread(target=httpd.serve_forever, name="callback-receiver", daemon=True)
    thread.start()
    try:
        yield state[0]
    finally:
        state[0].release.set()
        httpd.shutdown()
        httpd.server_close()
