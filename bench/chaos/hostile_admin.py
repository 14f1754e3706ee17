"""`--autoscale --faults hostile`: a hostile admin key and a hostile rented machine, every round of the autoscale
scenario, against the operator's own configuration (a provider made with the CLI, a vault credential for
github.com, an offload.yaml block with a deployment and an `instance.env` secret).

The admin key makes a provider of its own at a listener that records everything it is sent, points a block at
it (naming the operator's vault credential first), sends the offload.yaml block back masked with that provider,
and tries to change and delete the operator's provider. The machine (holding the worker key rented machines get)
registers as each live instance without its token, with another machine's, and for another queue. Invariants:
no operator secret ever reaches the listener, every attack is refused with the status the rule gives, and a
machine's own token still registers it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from bench import web
from bench.chaos.procs import HOST


class Listener:
    """An HTTP server that answers 400 to everything and keeps every request's path, headers and body."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        listener = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length).decode(errors="replace") if length else ""
                listener.seen.append(f"{self.command} {self.path} {dict(self.headers)} {body}")
                self.send_response(400)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _answer

            def log_message(self, *args: Any) -> None:
                return None

        self.httpd = ThreadingHTTPServer((HOST, 0), Handler)
        self.url = f"http://{HOST}:{self.httpd.server_address[1]}"

    @contextlib.contextmanager
    def running(self) -> Iterator[Listener]:
        thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.httpd.shutdown()
            self.httpd.server_close()


Call = Callable[[str, str, Any], httpx.Response]


class Attacker:
    """The hostile admin key and machine; `refusals` records every attack whose answer broke its rule."""

    def __init__(self, call: Call, listener: Listener, queue: str, attack_queue: str) -> None:
        self.call, self.listener, self.queue, self.attack_queue = call, listener, queue, attack_queue
        self.round = 0
        self.attacks = 0
        self.refusals: list[str] = []  # attacks that were not refused as they must be
        self.foreign_registrations = 0  # registrations as an instance the machine was not rented as, accepted
        self.own_registrations = 0  # a machine's own token: accepted (the rule still lets machines in)
        self.own_refused: list[str] = []

    def _expect(self, what: str, status: int, response: httpx.Response) -> None:
        self.attacks += 1
        if response.status_code != status:
            self.refusals.append(f"{what}: {response.status_code} (want {status}) {response.text[:200]}")

    def admin_round(self) -> None:
        """One round of the admin key's attack (a provider of its own per round: names never repeat)."""
        self.round += 1
        evil = f"evil-{self.round}"
        config = {"api_key": "attacker-0123456789", "base_url": self.listener.url, "gpu_name": "RTX 4090"}
        self._expect("create its provider", 201, self.call("POST", "/v1/autoscale/providers", {
            "name": evil, "type": "vastai", "config": config}))  # fmt: skip
        block = {
            "enabled": True,
            "provider": evil,
            "max_workers": 1,
            "poll_interval": "0.3s",
            "instance": {"image": "ghcr.io/attacker/dump-env:1"},
            "deployment": {
                "git_url": "https://github.com/attacker/x.git",
                "startup_cmd": "env",
                "git_credential": "gh",
            },
        }
        path = f"/v1/autoscale/queues/{self.attack_queue}"
        self._expect("name the vault credential", 403, self.call("PUT", path, block))
        del block["deployment"]["git_credential"]  # type: ignore[attr-defined]
        self._expect("a block on its provider", 200, self.call("PUT", path, block))
        self.call("POST", f"/v1/queues/{self.attack_queue}/jobs", {"input": self.round})
        shown = self.call("GET", f"/v1/autoscale/queues/{self.queue}", None).json()["autoscale"]
        shown.pop("deployment", None)
        self._expect(
            "offload.yaml's masked env with its provider",
            422,
            self.call("PUT", f"/v1/autoscale/queues/{self.queue}", {**shown, "provider": evil}),
        )
        self._expect("move the operator's provider", 403, self.call("PATCH", "/v1/autoscale/providers/v", {
            "base_url": self.listener.url, "api_key": "attacker-0123456789"}))  # fmt: skip
        self._expect("delete the operator's provider", 403, self.call("DELETE", "/v1/autoscale/providers/v", None))

    def machine_round(self, server: str, worker_key: str, machines: list[tuple[str, str]]) -> None:
        """Register as each (instance id, its token) the wrong ways, then the right one."""
        headers = {"Authorization": f"Bearer {worker_key}"}
        with web.client(base_url=server, headers=headers, timeout=30) as c:
            for i, (inst, token) in enumerate(machines):
                other = machines[(i + 1) % len(machines)][1] if len(machines) > 1 else "x" + token[1:]
                for body in (
                    {"instance_id": inst},
                    {"instance_id": inst, "instance_token": other if other != token else "x" + token[1:]},
                    {"instance_id": "as-00000000000000ff", "instance_token": token},
                ):
                    r = c.post("/v1/workers/register", json={"queues": [self.queue], **body})
                    self.attacks += 1
                    if r.status_code != 403:
                        self.foreign_registrations += 1
                        self.refusals.append(f"register as {body}: {r.status_code}")
                r = c.post(
                    "/v1/workers/register", json={"queues": [self.queue], "instance_id": inst, "instance_token": token}
                )
                if r.status_code == 201:
                    self.own_registrations += 1
                    c.post(f"/v1/workers/{r.json()['worker_id']}/deregister", json={"release": True})
                else:
                    self.own_refused.append(f"{inst}: {r.status_code} {r.text[:200]}")

    def leaked(self, secrets: dict[str, str]) -> list[str]:
        """The operator's secrets (by name) found in anything the listener received."""
        return sorted({name for name, value in secrets.items() for seen in self.listener.seen if value in seen})
