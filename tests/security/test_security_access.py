"""Who may hold what of a server (and how long an expired registration lasts): failed
authentication is limited per address and per key id and never refuses a valid key, also behind a trusted
proxy; a trickled body is cut with a 408 while other clients are served; streams, long-polls and requests are
capped per key, and requests without a key per address; streams and long-polls stop serving a revoked key
within seconds, and a claim never hands out a job after its key's revocation; expired GPU-worker registrations
leave the index. Real servers over TCP, real Valkey, raw sockets for the slow bodies."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import threading
import time
from typing import Any

import httpx
import pytest
from support.eventually import eventually_sync
from support.server_helpers import client, make_key, new_queue, server
from support.servers import ValkeyServer

from bench import web
from offload.config import Settings
from offload.errors import ConfigError
from offload.queue.keyspace import GPU_WORKERS, prefix
from offload.schema import parse, parse_networks
from offload.server.clientaddr import client_address

GUESS = "ofk_000000000000_guess"


def _get(url: str, token: str, headers: dict[str, str] | None = None, path: str = "/v1/queues") -> httpx.Response:
    return web.get(url + path, headers={"Authorization": f"Bearer {token}", **(headers or {})}, timeout=30)


def _forged(token: str) -> str:
    """The same key id with a wrong secret."""
    key_id = token.split("_")[1]
    return f"ofk_{key_id}_not-the-secret-{key_id}"


# -- failed authentication -------------------------------------------------------------------------------------


def test_an_address_past_the_failure_limit_still_gets_its_valid_keys_served(own_valkey: ValkeyServer) -> None:
    """21 bad keys from an address got every request from it a 429 for a minute, valid admin, producer and
    worker keys included. Now only its bad keys are refused."""
    with server(own_valkey.url, auth_fail_limit=20) as (url, boot):
        q = new_queue("lock")
        producer, worker = make_key(url, boot, "producer", [q]), make_key(url, boot, "worker", [q])
        statuses = [_get(url, GUESS).status_code for _ in range(21)]
        assert statuses == [401] * 20 + [429], statuses
        refused = _get(url, "ofk_111111111111_another-guess")
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1, refused.text
        assert refused.json()["error"] == "too_many_requests" and "address" in refused.json()["detail"]
        with client(url, boot) as admin:
            assert admin.get("/v1/queues").status_code == 200
            assert admin.post("/v1/keys", json={"scope": "viewer"}).status_code == 201
        with client(url, producer) as p:
            assert p.post(f"/v1/queues/{q}/jobs", json={"input": 1}).status_code == 201
        with client(url, worker) as w:
            assert w.post("/v1/workers/register", json={"queues": [q]}).status_code == 201
        assert _get(url, GUESS).status_code == 429  # and its bad keys are still refused


def test_wrong_secrets_for_one_key_id_are_limited_per_key_id_not_refusing_the_key(own_valkey: ValkeyServer) -> None:
    """Guesses at one key's secret spread over many addresses (behind a trusted proxy) are counted per key id:
    past the limit they get 429; the real key is still served, and other key ids are not affected."""
    settings = {"server": {"trusted_proxies": ["127.0.0.0/8"]}}
    with server(own_valkey.url, settings=settings, auth_fail_limit=5) as (url, boot):
        q = new_queue("keyid")
        producer, other = make_key(url, boot, "producer", [q]), make_key(url, boot, "viewer", [q])
        forged = _forged(producer)
        statuses = [_get(url, forged, {"X-Forwarded-For": f"203.0.113.{i}"}).status_code for i in range(1, 8)]
        assert statuses == [401] * 5 + [429, 429], statuses  # no address failed more than once
        refused = _get(url, forged, {"X-Forwarded-For": "203.0.113.99"})
        assert refused.status_code == 429 and "key id" in refused.json()["detail"], refused.text
        assert _get(url, producer, {"X-Forwarded-For": "203.0.113.3"}).status_code == 200
        with client(url, producer) as p:
            assert p.post(f"/v1/queues/{q}/jobs", json={"input": 1}).status_code == 201
        assert _get(url, _forged(other), {"X-Forwarded-For": "203.0.113.50"}).status_code == 401
        r = own_valkey.client()
        try:
            assert r.exists(f"offload:authfail:key:{producer.split('_')[1]}")
            assert not r.exists("offload:authfail:key:000000000000")  # unknown ids make no counters
        finally:
            r.close()


def test_trusted_proxies_name_the_client_and_nothing_else_does(own_valkey: ValkeyServer) -> None:
    """Behind the reverse proxy the docs recommend, every client had the proxy's address, so 21 bad keys
    from anyone locked out everyone. `server.trusted_proxies` makes the right-most untrusted hop the client."""
    settings = {"server": {"trusted_proxies": ["127.0.0.1/32"]}}
    r = own_valkey.client()
    try:
        with server(own_valkey.url, settings=settings, auth_fail_limit=3) as (url, boot):

            def bad(**headers: str) -> int:
                return _get(url, GUESS, headers).status_code

            assert [bad(**{"X-Forwarded-For": "203.0.113.7"}) for _ in range(4)] == [401, 401, 401, 429]
            assert bad(**{"X-Forwarded-For": "198.51.100.1, 203.0.113.7"}) == 429  # a client's own prefix: ignored
            assert bad(**{"X-Forwarded-For": "203.0.113.7, 127.0.0.1"}) == 429  # a trusted hop is skipped
            assert bad(**{"X-Forwarded-For": "203.0.113.8"}) == 401  # another client of the same proxy
            assert _get(url, boot, {"X-Forwarded-For": "203.0.113.7"}).status_code == 200
            forwarded = [bad(Forwarded=f'for="[2001:db8:1:2::{i}]:4711";proto=https') for i in range(1, 4)]
            assert forwarded == [401, 401, 401]
            assert bad(Forwarded='for="[2001:db8:1:2::99]"') == 429  # the same /64
            assert bad(Forwarded='for="[2001:db8:1:3::1]"') == 401
            assert r.exists("offload:authfail:ip:203.0.113.7", "offload:authfail:ip:2001:db8:1:2::/64") == 2
            assert not r.exists("offload:authfail:ip:198.51.100.1", "offload:authfail:ip:127.0.0.1")
        with server(own_valkey.url, auth_fail_limit=3) as (url, _):  # no trusted proxy: the headers mean nothing
            assert _get(url, GUESS, {"X-Forwarded-For": "192.0.2.1"}).status_code == 401
            assert r.exists("offload:authfail:ip:127.0.0.1") and not r.exists("offload:authfail:ip:192.0.2.1")
    finally:
        r.close()


def test_client_address_reading_and_the_setting() -> None:
    trusted = parse_networks(["10.0.0.0/8", "::1"])
    xff = b"x-forwarded-for"
    assert client_address("192.0.2.9", [(xff, b"203.0.113.1")], trusted) == "192.0.2.9"  # not a proxy: peer
    assert client_address("10.1.1.1", [(xff, b"203.0.113.1, 10.2.2.2")], trusted) == "203.0.113.1"
    assert client_address("10.1.1.1", [(xff, b"1.1.1.1"), (xff, b"203.0.113.1")], trusted) == "203.0.113.1"
    assert client_address("10.1.1.1", [(xff, b"unknown")], trusted) == "10.1.1.1"
    assert client_address("10.1.1.1", [(xff, b"10.3.3.3")], trusted) == "10.3.3.3"  # all trusted: the first
    assert client_address("10.1.1.1", [(xff, b"[::ffff:203.0.113.4]:80")], trusted) == "203.0.113.4"
    fwd = [(b"forwarded", b'for=192.0.2.60;proto=http, for="[2001:db8::17]:47"')]
    assert client_address("::1", fwd, trusted) == "2001:db8::/64"
    assert client_address("10.1.1.1", [*fwd, (xff, b"203.0.113.5")], trusted) == "203.0.113.5"  # XFF first
    assert client_address(None, [], trusted) == "unknown"
    with pytest.raises(ConfigError, match=r"server\.trusted_proxies: 'proxy\.local' is not an IP"):
        parse(Settings, {"server": {"trusted_proxies": ["10.0.0.0/8", "proxy.local"]}})


# -- slow bodies, caps -----------------------------------------------------------------------------------------


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _open_post(url: str, path: str, token: str | None, length: int, first: bytes) -> socket.socket:
    """A raw connection that has sent a POST's headers and the first bytes of its body."""
    sock = socket.create_connection(_host_port(url), timeout=30)
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: t\r\n{auth}Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    )
    sock.sendall(head.encode() + first)
    return sock


def _trickle(sock: socket.socket, until: float, every: float = 0.1) -> bytes:
    """Send one byte of body every `every` s until the server answers; the answer and all that follows it, up
    to the server closing the connection (b"" if it never answered by `until`)."""
    got = b""
    while time.monotonic() < until:
        readable, _, _ = select.select([sock], [], [], every)
        if readable:
            sock.settimeout(max(0.1, until - time.monotonic()))
            with contextlib.suppress(ConnectionError, TimeoutError):
                while chunk := sock.recv(65536):
                    got += chunk
                return got + b"<closed>"
            return got
        with contextlib.suppress(OSError):
            sock.sendall(b"x")
    return got


def test_a_trickled_body_is_cut_with_408_while_others_are_served(valkey: ValkeyServer) -> None:
    """Bodies had no deadline: a client trickling one byte at a time held its connection (and request) for as
    long as it liked. Now each gets `body_timeout_s` plus what `body_min_rate` earns; a large body sent at a
    steady rate is not cut."""
    with server(valkey.url, body_timeout_s=2.0, body_min_rate=64 << 10) as (url, boot):
        q = new_queue("loris")
        producer = make_key(url, boot, "producer", [q])
        socks = [_open_post(url, f"/v1/queues/{q}/jobs", producer, 4096, b'{"input": "') for _ in range(6)]
        answers: list[bytes] = [b""] * len(socks)
        until = time.monotonic() + 40

        def run(i: int) -> None:
            answers[i] = _trickle(socks[i], until)

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(socks))]
        try:
            for t in threads:
                t.start()
            with client(url, producer) as p:  # others are served meanwhile
                assert p.post(f"/v1/queues/{q}/jobs", json={"input": "quick"}).status_code == 201
                assert web.get(f"{url}/healthz", timeout=10).status_code == 200
                steady = _steady_post(url, f"/v1/queues/{q}/jobs", producer, 400 << 10)
                assert steady.startswith(b"HTTP/1.1 201"), steady[:300]  # 2.5 s at 160 KiB/s: past 2 s, not cut
            for t in threads:
                t.join(45)
        finally:
            for s in socks:
                s.close()
        for answer in answers:
            assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
            assert b'"error":"timeout"' in answer and answer.endswith(b"<closed>"), answer  # answered, then closed
        with client(url, boot) as admin:
            assert admin.get(f"/v1/queues/{q}").json()["counts"]["queued"] == 2  # nothing of the trickled ones


def _steady_post(url: str, path: str, token: str, size: int) -> bytes:
    """A JSON body of `size` bytes sent in 16 KiB parts every 0.1 s; the answer's first bytes."""
    body = b'{"input": "' + b"y" * (size - 14) + b'"}'
    with _open_post(url, path, token, len(body), b"") as sock:
        for i in range(0, len(body), 16 << 10):
            sock.sendall(body[i : i + (16 << 10)])
            time.sleep(0.1)  # the client's pace (what is tested), not a synchronisation
        return sock.recv(4096)


def _stream(url: str, token: str, path: str) -> Any:
    """An open SSE response (entered) and its client; close both with `_close`."""
    c = web.client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    cm = c.stream("GET", path)
    return c, cm, cm.__enter__()


def _close(opened: Any) -> None:
    c, cm, _ = opened
    cm.__exit__(None, None, None)
    c.close()


def test_streams_long_polls_and_requests_are_capped_per_key(valkey: ValkeyServer) -> None:
    """Nothing bounded what one key held: any key could open streams and long-polls until the server's
    connection limit answered 503 for everyone. Now past its caps a key gets 429 (Retry-After, JSON) and other
    keys are served; a slot comes back when its stream ends."""
    with server(valkey.url, max_streams_per_key=3, max_requests_per_key=4, max_wait_s=20) as (url, boot):
        q = new_queue("cap")
        with client(url, boot) as admin:
            assert admin.post(f"/v1/queues/{q}/jobs", json={"input": 0}).status_code == 201
        producer, viewer = make_key(url, boot, "producer", [q]), make_key(url, boot, "viewer", [q])
        opened = [_stream(url, producer, f"/v1/queues/{q}/events") for _ in range(3)]
        extra: list[Any] = []
        trickle: socket.socket | None = None
        try:
            assert [o[2].status_code for o in opened] == [200, 200, 200]
            extra.append(_stream(url, producer, f"/v1/queues/{q}/events"))
            over = extra[-1][2]
            assert over.status_code == 429 and over.headers["Retry-After"] == "1", over.status_code
            over.read()
            assert over.json()["error"] == "too_many_requests" and "max_streams_per_key" in over.json()["detail"]
            job = next(iter(_get(url, producer, path=f"/v1/queues/{q}/jobs?state=queued").json()["jobs"]))["id"]
            assert _get(url, producer, path=f"/v1/jobs/{job}/wait?timeout=5").status_code == 429  # a long-poll
            extra.append(_stream(url, viewer, f"/v1/queues/{q}/events"))  # another key: its own caps
            assert extra[-1][2].status_code == 200
            assert _get(url, producer, path=f"/v1/queues/{q}").status_code == 200  # a 4th request: under 4
            trickle = _open_post(url, f"/v1/queues/{q}/jobs", producer, 100, b"{")  # holds the 4th
            capped = eventually_sync(
                lambda: (r := _get(url, producer, path=f"/v1/queues/{q}")).status_code == 429 and r, 15
            )
            assert "max_requests_per_key" in capped.json()["detail"], capped.text
            _close(opened.pop())
            trickle.close()
            trickle = None
            eventually_sync(
                lambda: _get(url, producer, path=f"/v1/queues/{q}").status_code == 200, 15, "a request slot back"
            )
            extra.append(
                eventually_sync(lambda: _reopen(url, producer, f"/v1/queues/{q}/events"), 15, "a stream slot back")
            )
        finally:
            for o in opened + extra:
                _close(o)
            if trickle is not None:
                trickle.close()
        _claims_are_capped(url, boot)


def _reopen(url: str, token: str, path: str) -> Any:
    o = _stream(url, token, path)
    if o[2].status_code == 200:
        return o
    _close(o)
    return None


def _claims_are_capped(url: str, boot: str) -> None:
    """A worker key's claim long-polls count as its streams."""
    q = new_queue("capw")
    worker = make_key(url, boot, "worker", [q])
    with client(url, worker) as w:
        wid = w.post("/v1/workers/register", json={"queues": [q]}).json()["worker_id"]
    answers: list[httpx.Response] = []

    def claim() -> None:
        with client(url, worker) as c:
            answers.append(c.post(f"/v1/workers/{wid}/claim", json={"queue": q, "max": 1, "wait": 20}))

    threads = [threading.Thread(target=claim, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    refused = eventually_sync(lambda: [a for a in answers if a.status_code == 429], 15, "one claim over the cap")
    assert len(refused) == 1 and "max_streams_per_key" in refused[0].json()["detail"], [a.text for a in answers]
    with client(url, boot) as admin:
        for i in range(3):
            assert admin.post(f"/v1/queues/{q}/jobs", json={"input": i}).status_code == 201
    for t in threads:
        t.join(30)
    assert sorted(len(a.json()["jobs"]) for a in answers if a.status_code == 200) == [1, 1, 1]


def test_requests_without_a_key_are_capped_per_address(own_valkey: ValkeyServer) -> None:
    """Requests that present no key (health checks, webhooks, the dashboard's files) count against their client
    address; one that presents a valid key never does. Held open here by a job store that stopped answering
    (SIGSTOP): /readyz waits up to 2 s for it."""
    with server(own_valkey.url, max_requests_per_address=2) as (url, boot):
        assert own_valkey.pid is not None
        stop = threading.Event()

        def ready_checks() -> None:
            while not stop.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    web.get(f"{url}/readyz", timeout=30)

        threads = [threading.Thread(target=ready_checks, daemon=True) for _ in range(4)]
        os.kill(own_valkey.pid, signal.SIGSTOP)
        try:
            for t in threads:
                t.start()
            refused = eventually_sync(lambda: (r := web.get(f"{url}/healthz", timeout=30)).status_code == 429 and r, 20)
            assert refused.headers["Retry-After"] == "1" and refused.json()["error"] == "too_many_requests"
            assert "max_requests_per_address" in refused.json()["detail"]
            whoami = _get(url, boot, path="/v1/dashboard/whoami")  # a valid key: not counted per address
            assert whoami.status_code == 200, whoami.text
        finally:
            stop.set()
            os.kill(own_valkey.pid, signal.SIGCONT)
            for t in threads:
                t.join(30)
        eventually_sync(lambda: web.get(f"{url}/healthz", timeout=10).status_code == 200, 15, "healthz answered again")


# -- revocation -------------------------------------------------------------------------------------------------


def test_a_claim_long_poll_hands_out_nothing_once_its_key_is_revoked(valkey: ValkeyServer) -> None:
    """A claim long-poll opened before its key's revocation handed out the next job for up to 60 s."""
    r = valkey.client()
    with server(valkey.url, max_wait_s=30) as (url, boot), client(url, boot) as admin:
        q = new_queue("revclaim")
        created = admin.post("/v1/keys", json={"scope": "worker", "queues": [q]}).json()
        with client(url, created["token"]) as w:
            wid = w.post("/v1/workers/register", json={"queues": [q]}).json()["worker_id"]
            answer: list[httpx.Response] = []
            t = threading.Thread(
                target=lambda: answer.append(
                    w.post(f"/v1/workers/{wid}/claim", json={"queue": q, "max": 1, "wait": 25})
                ),
                daemon=True,
            )
            t.start()
            eventually_sync(lambda: r.exists(prefix(q) + "idle"), 15, "the claim to find the queue empty and wait")
            assert admin.delete(f"/v1/keys/{created['id']}").status_code == 204
            job = admin.post(f"/v1/queues/{q}/jobs", json={"input": "for a live key only"}).json()["id"]
            t.join(30)
        assert answer and answer[0].status_code == 401, answer[0].text if answer else "no answer"
        record = admin.get(f"/v1/jobs/{job}").json()
        assert record["state"] == "queued", record
    r.close()


def test_streams_and_waits_stop_serving_a_revoked_key_within_seconds(valkey: ValkeyServer) -> None:
    """An event stream re-checked its key every 5 s and a wait never did (up to its whole timeout)."""
    with server(valkey.url, max_wait_s=50) as (url, boot), client(url, boot) as admin:
        q = new_queue("revstream")
        job = admin.post(f"/v1/queues/{q}/jobs", json={"input": 1}).json()["id"]
        created = admin.post("/v1/keys", json={"scope": "producer", "queues": [q]}).json()
        waited: list[tuple[int, float]] = []
        lines: list[str] = []
        ended: list[float] = []

        def wait() -> None:
            r = _get(url, created["token"], path=f"/v1/jobs/{job}/wait?timeout=45")
            waited.append((r.status_code, time.monotonic()))

        def follow() -> None:
            with client(url, created["token"]) as c, c.stream("GET", f"/v1/queues/{q}/events") as s:
                for line in s.iter_lines():
                    lines.append(line)
            ended.append(time.monotonic())

        threading.Thread(target=wait, daemon=True).start()
        threading.Thread(target=follow, daemon=True).start()
        eventually_sync(lambda: any("connected" in line for line in lines), 15, "the stream to open")
        revoked_at = time.monotonic()
        assert admin.delete(f"/v1/keys/{created['id']}").status_code == 204
        eventually_sync(lambda: ended and waited, 20, "the stream and the wait to end")
        assert "event: revoked" in lines
        assert ended[0] - revoked_at < 4.0, ended[0] - revoked_at  # re-checked every second
        assert waited[0][0] == 401 and waited[0][1] - revoked_at < 6.0, waited


# -- expired registrations ------------------------------------------------------------------------------------


def test_expired_worker_registrations_leave_the_index(own_valkey: ValkeyServer) -> None:
    """A worker's record expired with its heartbeats, but its index entry stayed until someone listed the
    workers: registrations piled up in `offload:rworkers` (and in every autoscaler tick that reads it)."""
    r = own_valkey.client(decode_responses=True)
    stop = threading.Event()
    with server(own_valkey.url, worker_lease_ms=1000) as (url, boot):  # registrations live 10 s unbeaten
        q = new_queue("prune")
        worker = make_key(url, boot, "worker", [q])
        with client(url, worker) as w:
            silent = [w.post("/v1/workers/register", json={"queues": [q]}).json()["worker_id"] for _ in range(20)]
            live = w.post("/v1/workers/register", json={"queues": [q]}).json()["worker_id"]

        def beat() -> None:
            with client(url, worker) as c:
                while not stop.wait(0.3):
                    assert c.post(f"/v1/workers/{live}/heartbeat", json={"jobs": []}).status_code == 200

        beater = threading.Thread(target=beat, daemon=True)
        beater.start()
        try:
            assert set(silent) <= set(r.zrange(GPU_WORKERS, 0, -1))
            eventually_sync(lambda: not set(silent) & set(r.zrange(GPU_WORKERS, 0, -1)), 60, "expired entries pruned")
            assert live in r.zrange(GPU_WORKERS, 0, -1) and beater.is_alive()
        finally:
            stop.set()
            beater.join(10)
    r.close()
