"""SSRF through the provider-file copy, on real servers: a producer whose provider echoes its
input names internal URLs (an HTTP listener on loopback stands in for an internal service), and the dispatch worker
must fetch none of them, nor follow a redirect to one; nothing lands in the bucket, and every such job ends with the
same generic error whether the port was open, closed or the address refused. The local stack (the provider's own
origin, the result store's) keeps working, `allow_private_hosts` opts a backend in, `file_hosts` limits copies
to named hosts on every hop, and a generated walk of address forms x settings checks the connection rule itself
(without a packet sent: the rule runs before a socket exists)."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import re
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import httpx
import pytest
from support.s3server import RcloneS3
from support.servers import closed_port

from bench import web
from offload.config import Settings, load_settings
from offload.connection import connect
from offload.errors import ConfigError
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.testing.sim.config import SimConfig
from offload.testing.sim.server import running_sim
from offload.worker.run import run_worker

BUCKET = "egress"
SECRET = b"INTERNAL-" + secrets.token_hex(8).encode()
GENERIC = "storing the output failed: output file 1 could not be copied (the worker's log says why)"


class Listener:
    """A real HTTP server on loopback: what it was asked (method, path, Host, User-Agent), its answers by path."""

    def __init__(self, answer: Any) -> None:
        self.requests: list[tuple[str, str, str, str]] = []
        seen = self.requests

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                seen.append((self.command, self.path, self.headers.get("Host", ""), self.headers.get("User-Agent", "")))
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                status, headers, data = answer(self.command, self.path, body)
                self.send_response(status)
                for name, value in {"Content-Length": str(len(data)), **headers}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _any

            def log_message(self, *args: Any) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self._server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def by_worker(self) -> list[tuple[str, str, str, str]]:
        """The requests a dispatch worker made (its User-Agent), not the simulator, which, as a provider would,
        fetches loopback URLs in its inputs."""
        return [r for r in self.requests if r[3].startswith("offload/")]

    @contextmanager
    def running(self) -> Iterator[Listener]:
        thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._server.shutdown()
            self._server.server_close()


def internal_service() -> Listener:
    """Stands in for what a worker can reach and a producer must not: answers every GET with a secret."""
    return Listener(lambda method, path, body: (200, {"Content-Type": "text/plain"}, SECRET))


def echo_provider() -> Listener:
    """A hostile provider on the tutorial's job API: the output is the input; `/moved?to=` redirects anywhere,
    and `/files/ok.txt` is a file of its own (the local-stack case: a provider serving its own files)."""
    jobs: dict[str, Any] = {}

    def answer(method: str, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        json_type = {"Content-Type": "application/json"}
        if method == "POST" and path == "/jobs":
            job_id = secrets.token_hex(4)
            jobs[job_id] = json.loads(body)
            return 200, json_type, json.dumps({"id": job_id}).encode()
        if method == "GET" and path.startswith("/jobs/"):
            output = jobs[path.rsplit("/", 1)[1]]
            return 200, json_type, json.dumps({"status": "succeeded", "output": output}).encode()
        if path.startswith("/moved?to="):
            return 302, {"Location": unquote(path.split("?to=", 1)[1])}, b""
        if path == "/files/ok.txt":
            return 200, {"Content-Type": "text/plain"}, b"the provider's own file"
        return 404, {}, b""

    return Listener(answer)


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    with running_sim(SimConfig.model_validate({"default": {"latency": 0.05}})) as url:
        yield str(url)


@pytest.fixture
def internal() -> Iterator[Listener]:
    with internal_service().running() as listener:
        yield listener


@pytest.fixture
def provider() -> Iterator[Listener]:
    with echo_provider().running() as listener:
        yield listener


@pytest.fixture
async def store(valkey_url: str) -> AsyncIterator[QueueStore]:
    redis = await connect(valkey_url)
    yield QueueStore(redis)
    await redis.aclose()


def settings_for(valkey_url: str, s3: RcloneS3, base_url: str, **backend: Any) -> Settings:
    return Settings.model_validate(
        {
            "redis_url": valkey_url,
            "storage": s3.settings(BUCKET),
            "backends": {"gpu": {"kind": "http-job", "base_url": base_url, "api_key": "k", **backend}},
            "queues": {"q": {"backend": "gpu", "poll_interval": 0.2, "poll_timeout": 5, "max_attempts": 1}},
        }
    )


@asynccontextmanager
async def worker(settings: Settings) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(run_worker(settings, "q", stop=stop, install_signals=False, grace_s=5))
    try:
        yield
    finally:
        stop.set()
        await task


async def run_jobs(
    settings: Settings, store: QueueStore, inputs: dict[str, Any], timeout: float = 90
) -> dict[str, Any]:
    """Enqueue one job per input and serve them until every one has ended: name -> job."""
    ids = dict(zip(inputs, await store.enqueue_many("q", [JobSpec(input=i) for i in inputs.values()]), strict=True))
    async with worker(settings):
        deadline = time.monotonic() + timeout
        while True:
            jobs = {name: await store.get(job_id) for name, job_id in ids.items()}
            if all(job.state.terminal for job in jobs.values()):
                return jobs
            if time.monotonic() > deadline:
                raise AssertionError({n: (j.state.value, j.error) for n, j in jobs.items()})
            await asyncio.sleep(0.1)


def bucket_objects(s3: RcloneS3) -> dict[str, bytes]:
    client = s3.client()
    listing = client.list_objects_v2(Bucket=BUCKET).get("Contents", [])
    return {o["Key"]: client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read() for o in listing}


def assert_nothing_leaked(s3: RcloneS3, internal: Listener) -> None:
    assert internal.by_worker == []  # the worker never reached the internal service
    leaked = [key for key, body in bucket_objects(s3).items() if SECRET in body]
    assert leaked == []


async def test_echoed_internal_urls_are_never_fetched_and_every_failure_reads_the_same(
    valkey_url: str, s3: RcloneS3, sim: str, internal: Listener, store: QueueStore, caplog: pytest.LogCaptureFixture
) -> None:
    """The simulator echoes its input: an open internal port (by address, by a name that resolves to loopback,
    by its v4-mapped IPv6 literal) and a closed one. None is fetched, nothing lands in the bucket, and the producer
    reads the same error for each: no port scan through the job error. The simulator's own files are still
    copied (the local stack's provider on loopback is the backend's own origin)."""
    caplog.set_level(logging.WARNING, logger="offload.storage")
    closed = closed_port()
    targets = {
        "open port": f"{internal.url}/admin?token=hush",
        "name for loopback": f"http://localhost:{internal.port}/admin",
        "v4-mapped literal": f"http://[::ffff:127.0.0.1]:{internal.port}/admin",
        "another loopback address": f"http://127.0.0.2:{internal.port}/admin",
        "closed port": f"http://127.0.0.1:{closed}/admin",
    }
    inputs: dict[str, Any] = {name: {"prompt": "x", "image": url} for name, url in targets.items()}
    inputs["control"] = {"prompt": "no URL in it"}
    jobs = await run_jobs(settings_for(valkey_url, s3, sim), store, inputs)

    assert_nothing_leaked(s3, internal)
    outcomes = {name: (jobs[name].state.value, jobs[name].error) for name in targets}
    assert outcomes == dict.fromkeys(targets, ("dead", GENERIC))  # dead at once: another run would be refused too
    control = jobs["control"]
    assert control.state.value == "succeeded", control.error
    output = json.loads(s3.client().get_object(Bucket=BUCKET, Key=control.output_key)["Body"].read())
    (copy,) = output["_offload_files"].values()  # the simulator's file, copied from its own origin
    assert copy.startswith(f"s3://{BUCKET}/results/q:_files/")
    # the operator's log says which address and why, with no query string
    reasons = [r.getMessage() for r in caplog.records if "not copied" in r.getMessage()]
    assert len(reasons) == len(targets) and all("a loopback or private address" in r for r in reasons), reasons
    assert not any("hush" in r for r in reasons)


async def test_a_redirect_to_an_internal_address_is_refused_at_the_hop(
    valkey_url: str, s3: RcloneS3, provider: Listener, internal: Listener, store: QueueStore
) -> None:
    """The provider's own file URL is fetched (its origin is the backend's), but a redirect from it to an
    internal address, by number or by name, is checked as a new connection and refused."""
    hop = f"{provider.url}/moved?to="
    inputs = {
        "own file": {"f": f"{provider.url}/files/ok.txt"},
        "redirect by address": {"f": hop + quote(f"{internal.url}/secret", safe="")},
        "redirect by name": {"f": hop + quote(f"http://localhost:{internal.port}/secret", safe="")},
    }
    jobs = await run_jobs(settings_for(valkey_url, s3, provider.url), store, inputs)

    assert_nothing_leaked(s3, internal)
    own = jobs["own file"]
    assert own.state.value == "succeeded", own.error
    assert b"the provider's own file" in bucket_objects(s3).values()
    for name in ("redirect by address", "redirect by name"):
        assert (jobs[name].state.value, jobs[name].error) == ("dead", GENERIC)


async def test_file_hosts_limits_copies_to_named_hosts_on_every_hop(
    valkey_url: str, s3: RcloneS3, provider: Listener, store: QueueStore
) -> None:
    """`file_hosts: [127.0.0.1]`: a URL on another host is left as it is (not fetched), and a redirect from a
    listed host to an unlisted one is refused: the same server under its other name is never asked."""
    other = f"http://localhost:{provider.port}/files/ok.txt"
    inputs = {
        "listed and not": {"own": f"{provider.url}/files/ok.txt", "other": other},
        "hop to an unlisted host": {"f": f"{provider.url}/moved?to=" + quote(other, safe="")},
    }
    settings = settings_for(valkey_url, s3, provider.url, file_hosts=["127.0.0.1"])
    jobs = await run_jobs(settings, store, inputs)

    assert not [r for r in provider.requests if r[2].startswith("localhost")]
    both = jobs["listed and not"]
    assert both.state.value == "succeeded", both.error
    output = json.loads(s3.client().get_object(Bucket=BUCKET, Key=both.output_key)["Body"].read())
    assert output["other"] == other and output["own"].startswith(f"s3://{BUCKET}/")
    hop = jobs["hop to an unlisted host"]
    assert (hop.state.value, hop.error) == ("dead", GENERIC)


async def test_allow_private_hosts_opts_a_backend_in_but_never_past_link_local(
    valkey_url: str, s3: RcloneS3, sim: str, internal: Listener, store: QueueStore
) -> None:
    """`allow_private_hosts: true` (a self-hosted stack whose files are on another private host): the loopback
    service is fetched. The rule it relaxes still refuses link-local and metadata addresses (the walk below)."""
    settings = settings_for(valkey_url, s3, sim, allow_private_hosts=True)
    jobs = await run_jobs(settings, store, {"private file": {"image": f"{internal.url}/report.txt"}})
    job = jobs["private file"]
    assert job.state.value == "succeeded", job.error
    assert [r[1] for r in internal.by_worker] == ["/report.txt"]
    assert SECRET in bucket_objects(s3).values()


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("https://files.example", "backends.gpu.file_hosts"),
        ("files.example:443", "backends.gpu.file_hosts"),
        ("files.example/path", "backends.gpu.file_hosts"),
    ],
)
def test_a_bad_file_hosts_entry_fails_at_start_naming_the_field(entry: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "offload.yaml"
    backend = {"kind": "http-job", "base_url": "https://api.example", "file_hosts": [entry]}
    path.write_text(json.dumps({"backends": {"gpu": backend}}))
    with pytest.raises(ConfigError, match=f"^{message.replace('.', '[.]')}: .*{re.escape(entry)!s}.* not a host"):
        load_settings(path, env={})


# ---------------------------------------------------------------- the generated walk of address forms


def _networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """Every special-purpose network the standard library knows (its private, reserved, link-local, loopback,
    multicast, unspecified and shared tables), plus the cloud metadata hosts: generated, not hand-listed."""
    found: dict[str, ipaddress.IPv4Network | ipaddress.IPv6Network] = {}
    for constants in (ipaddress._IPv4Constants, ipaddress._IPv6Constants):  # type: ignore[attr-defined]
        for value in vars(constants).values():
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, ipaddress.IPv4Address | ipaddress.IPv6Address):
                    item = ipaddress.ip_network(item)
                if isinstance(item, ipaddress.IPv4Network | ipaddress.IPv6Network):
                    found[str(item)] = item
    for host in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200", "192.0.0.192"):
        net = ipaddress.ip_network(host)
        found[str(net)] = net
    return list(found.values())


def _spellings(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> list[str]:
    """`ip` as it may reach a socket: itself and, for IPv4, every IPv6 form that carries it."""
    if isinstance(ip, ipaddress.IPv6Address):
        return [str(ip)]
    n = int(ip)
    return [
        str(ip),
        f"::ffff:{ip}",
        f"::ffff:{n >> 16:x}:{n & 0xFFFF:x}",
        f"::{ip}" if n > 1 else str(ip),
        str(ipaddress.IPv6Address((0x64FF9B << 96) | n)),  # NAT64
        str(ipaddress.IPv6Address((0x2002 << 112) | (n << 80))),  # 6to4
    ]


def _expected(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, reach: Any) -> bool:
    """Whether the rule lets `ip` through at `reach`, from the docs' words (docs/explanation/security.md), not
    from the code under test."""
    never = ip.is_link_local or ip.is_multicast or ip.is_unspecified or str(ip) in (
        "169.254.169.254", "fd00:ec2::254", "100.100.100.200", "192.0.0.192"
    )  # fmt: skip
    local = ip.is_loopback or any(
        ip in ipaddress.ip_network(n)
        for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7")
        if ip.version == ipaddress.ip_network(n).version
    )
    public = ip.is_global and not ip.is_multicast and (ip.version == 4 or ip in ipaddress.ip_network("2000::/3"))
    return not never and (public or (reach.value == "local" and local))


def test_the_attackers_address_walk() -> None:
    """Every special-purpose network (first, second and last address), in every spelling that carries it, at each
    reach the settings give (the default; `allow_private_hosts` or the backend's own origin; a `file_hosts` list
    changes hosts, not addresses): the socket factory aiohttp calls with the address it is about to connect to
    lets exactly the docs' addresses through. No packet is sent: a refused address raises before a socket
    exists, an allowed one gets a socket that is closed unconnected."""
    from offload.egress import AddressRefused, FilePolicy, Reach, refusal, socket_factory

    policies = {
        "default": FilePolicy(),
        "allow_private_hosts": FilePolicy(allow_private=True),
        "own origin": FilePolicy.of("http://127.0.0.1:8000"),
        "file_hosts": FilePolicy(hosts=("files.example",)),
    }
    checked = 0
    for net in _networks():
        for ip in {net[0], net[min(1, net.num_addresses - 1)], net[-1]}:
            for spelling in _spellings(ip):
                for name, policy in policies.items():
                    reach = policy.reach("http", "127.0.0.1", 8000)
                    family = socket.AF_INET6 if ":" in spelling else socket.AF_INET
                    addr = (spelling, 80, 0, 0) if family == socket.AF_INET6 else (spelling, 80)
                    try:
                        socket_factory(reach)((family, socket.SOCK_STREAM, 6, "", addr)).close()
                        allowed = True
                    except AddressRefused as exc:
                        assert exc.address == spelling and str(exc) == "[Errno 13] refused by the egress rule"
                        allowed = False
                    assert allowed is _expected(ip, reach), (name, spelling, refusal(spelling, reach))
                    checked += 1
    assert checked > 1000
    for spelling in ("[::ffff:169.254.169.254]", "[::ffff:a9fe:a9fe]", "[fd00:ec2::254]"):  # the reported three
        host = spelling.strip("[]")
        assert refusal(host, Reach.PUBLIC) == refusal(host, Reach.LOCAL) == "a cloud metadata address"
    assert policies["file_hosts"].listed("files.example") and not policies["file_hosts"].listed("127.0.0.1")


async def test_an_egress_client_refuses_before_connecting_on_both_roads(internal: Listener, tmp_path: Path) -> None:
    """The transport itself, both ways a file is fetched: the plain aiohttp GET and httpx's road; a client
    without `egress` is not accepted for copies at all."""
    from offload.backends import new_client
    from offload.backends.transport import fast_path
    from offload.egress import AddressRefused, FilePolicy
    from offload.storage import LocalStorage, store_output

    http = new_client(timeout=5, egress=True, agent="offload/test")
    plain = fast_path(http)
    assert plain is not None
    try:
        url = f"{internal.url}/x"
        with pytest.raises(AddressRefused):
            async with plain.get_plain(url, headers={}, timeout=httpx.Timeout(5), policy=FilePolicy()):
                pass
        with pytest.raises(AddressRefused):
            await http.get(url)  # no policy on the request: public addresses only
        allowed = await http.get(url, extensions={"offload.egress": FilePolicy.of(internal.url)})
        assert allowed.content == SECRET
    finally:
        await http.aclose()
    assert len(internal.by_worker) == 1
    async with web.async_client() as unguarded:
        with pytest.raises(TypeError, match="egress client"):
            await store_output(LocalStorage(tmp_path), "results/x.json", {"f": url}, unguarded)
    assert len(internal.by_worker) == 1


def test_the_chaos_checker_names_an_internal_fetch_and_a_stored_copy() -> None:
    """The fault harness's `ssrf` invariants (bench/chaos/egress.py), on the evidence a run gathers."""
    from types import SimpleNamespace

    from bench.chaos import egress

    url = "http://localhost:9/internal/"
    refused = "storing the output failed: output file 1 could not be copied (the worker's log says why)"
    data = SimpleNamespace(
        internal_url=url,
        internal_hits=["/internal/job-2"],
        sent={"q:1": {"image": f"{url}job-1"}, "q:2": {"image": f"{url}job-2"}, "q:3": {"prompt": "plain"}},
        records={
            "q:1": {"state": "dead", "error": refused},
            "q:2": {"state": "succeeded", "output_key": "results/q:2.json"},
            "q:3": {"state": "succeeded"},
        },
        outputs={"results/q:2.json": json.dumps({"_offload_files": {f"{url}job-2": "s3://b/k"}}).encode()},
    )
    found: list[str] = []
    summary = egress.verdict(data, found.append)
    assert summary == {"ssrf_jobs": 2, "ssrf_refused": 1, "ssrf_fetched": 1, "ssrf_copied": 1}
    assert len(found) == 2 and "fetched the internal service" in found[0] and "q:2" in found[1]
    data.internal_hits, data.records["q:2"] = [], {"state": "dead", "error": refused}
    found.clear()
    assert egress.verdict(data, found.append)["ssrf_refused"] == 2 and found == []
