"""Alerts reach a real webhook receiver (an HTTP server on a free port) and a real SMTP sink (aiosmtpd), with
retries, a cooldown shared through Redis, and the queue monitors (dead-letter growth, latency)."""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Iterator
from email import message_from_bytes
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from aiosmtpd.controller import Controller
from support.admin_redis import AdminRedis, redis_admin
from support.autoscale_helpers import Clock, make_scaler, queue_block
from support.eventually import eventually_sync
from support.servers import free_port

from offload.autoscale.alert_settings import AlertSettings, alert_settings
from offload.autoscale.alerts import RETRY_CAP_S, Alerter, _retry_wait
from offload.connection import connect
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore


class Receiver:
    """Records JSON POSTs; answers 500 to the first `fail_first` of them (to prove retries)."""

    def __init__(self, fail_first: int = 0) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.hits = 0
        self.fail_first = fail_first
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                body = self.rfile.read(length)
                outer.hits += 1
                if outer.hits <= outer.fail_first:
                    self.send_response(500)
                    self.end_headers()
                    return
                outer.bodies.append({"json": json.loads(body), "auth": self.headers.get("X-Token")})
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Sink:
    def __init__(self) -> None:
        self.messages: list[bytes] = []

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:  # aiosmtpd's hook name
        self.messages.append(envelope.content)
        return "250 OK"


@pytest.fixture
def smtp() -> Iterator[tuple[Sink, int]]:
    sink = Sink()
    port = free_port()
    controller = Controller(sink, hostname="127.0.0.1", port=port)
    controller.start()
    yield sink, port
    controller.stop()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rec = Receiver(fail_first=2)
    yield rec
    rec.close()


@pytest.fixture
async def r(fast_valkey_url: str) -> AsyncIterator[AdminRedis]:
    client = redis_admin(await connect(fast_valkey_url))
    yield client
    await client.aclose()


async def test_webhook_and_email_delivery_with_retries_and_cooldown(
    r: AdminRedis, receiver: Receiver, smtp: tuple[Sink, int]
) -> None:
    sink, port = smtp
    clock = Clock()
    settings = alert_settings(
        {
            "webhooks": [{"url": receiver.url, "headers": {"X-Token": "t0k"}}],
            "email": {"host": "127.0.0.1", "port": port, "from_addr": "offload@example.com", "to": ["ops@example.com"]},
            "cooldown": "10m",
        }
    )
    alerter = Alerter(settings, r, clock)
    assert await alerter.alert("boot_timeout", "gpu", "instance as-1 had no ready worker")
    assert not await alerter.alert("boot_timeout", "gpu", "again")  # within the cooldown
    other = Alerter(settings, r, clock)  # another server: the cooldown is shared through Redis
    assert not await other.alert("boot_timeout", "gpu", "again")
    await alerter.drain()
    assert receiver.hits == 3 and len(receiver.bodies) == 1  # two 500s, then delivered
    doc = receiver.bodies[0]
    assert doc["auth"] == "t0k" and doc["json"]["kind"] == "boot_timeout" and doc["json"]["subject"] == "gpu"
    eventually_sync(lambda: len(sink.messages) == 1)
    mail = message_from_bytes(sink.messages[0])
    assert mail["Subject"] == "[offload] boot_timeout: gpu" and "as-1 had no ready worker" in mail.get_payload()
    clock.advance(601)
    assert await alerter.alert("boot_timeout", "gpu", "after the cooldown")
    await alerter.aclose()
    await other.aclose()


async def test_queue_monitors_dead_letter_growth_and_latency(r: AdminRedis, receiver: Receiver) -> None:
    clock = Clock()
    store = QueueStore(r, clock_ms=lambda: int(clock() * 1000))
    alerter = Alerter(
        alert_settings(
            {
                "webhooks": [{"url": receiver.url, "kinds": ["dead_letter_growth", "queue_latency"]}],
                "dead_letter_growth": 3,
                "queue_latency": "5m",
                "cooldown": 0,
            }
        ),
        r,
        clock,
    )
    await store.enqueue_many("q1", [JobSpec(input=i, max_attempts=1) for i in range(5)])
    await alerter.monitor(store, ["q1"])  # baseline
    jobs = await store.claim("q1", "w", 3)
    for j in jobs:
        await store.fail(j.id, j.token, "boom", retryable=False)
    clock.advance(400)
    await alerter.monitor(store, ["q1"])
    await alerter.drain()
    kinds = sorted(b["json"]["kind"] for b in receiver.bodies)
    assert kinds == ["dead_letter_growth", "queue_latency"]
    await alerter.aclose()


async def test_scaler_failures_reach_the_webhook(r: AdminRedis, receiver: Receiver) -> None:
    clock = Clock()
    s, _ = make_scaler(r, clock, queue_block(boot_timeout="2m"), alerts={"webhooks": [{"url": receiver.url}]})
    await QueueStore(r).enqueue("gpu", JobSpec(input=1))
    for _ in range(6):
        await s.tick()
        clock.advance(30)
    await s.alerter.drain()
    assert [b["json"]["kind"] for b in receiver.bodies] == ["boot_timeout"]
    await s.aclose()


async def test_a_boot_timeout_reaches_an_autoscale_failure_filter(r: AdminRedis, receiver: Receiver) -> None:
    """A machine that never booted is an autoscale failure: a target filtering on `autoscale_failure` gets it.
    Before the fix it was sent only as `boot_timeout`, which such a filter missed."""
    clock = Clock()
    s, _ = make_scaler(
        r,
        clock,
        queue_block(boot_timeout="2m"),
        alerts={"webhooks": [{"url": receiver.url, "kinds": ["autoscale_failure"]}]},
    )
    await QueueStore(r).enqueue("gpu", JobSpec(input=1))
    for _ in range(6):
        await s.tick()
        clock.advance(30)
    await s.alerter.drain()
    assert [b["json"]["kind"] for b in receiver.bodies] == ["boot_timeout"]
    await s.aclose()


def test_one_delivery_retries_for_seconds_not_minutes() -> None:
    """The waits between the tries of one alert are capped: at the most tries `attempts` allows, the last waits
    were 51 s and 102 s before (an evaluation's alert held a dead target for minutes)."""
    most = AlertSettings.model_fields["attempts"].metadata
    tries = next(m.le for m in most if hasattr(m, "le"))
    waits = [_retry_wait(n) for n in range(tries - 1)]
    assert waits[:3] == [0.2, 0.4, 0.8] and max(waits) == RETRY_CAP_S and sum(waits) < 30, waits
