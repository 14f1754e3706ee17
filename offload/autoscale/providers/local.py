"""`local`: "rents" a machine by starting a real `offload worker --handler` process on this host.

Because it runs commands here, it can only be set up by the operator (offload.yaml or the CLI), never over
the HTTP API (see offload/autoscale/operator_only.py), and the process gets a minimal environment.

It is how the demo and the end-to-end tests run the whole loop (rent, register with the instance id, work,
drain, destroy) without a cloud account. Processes start in their own session, so they outlive a server
restart, and their pid plus kernel start time are kept in Redis, so the next leader can still find and stop
them and a recycled pid is never mistaken for one of ours.

With a queue `deployment` the "machine" runs the deployment script (clone, setup_cmd, worker) in a work directory
of its own per instance (`<deploy_dir>/<label>`), removed when the machine is destroyed. Only the operator can
set that up (offload.yaml or the CLI): these commands run on the control-plane host.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
from pydantic import Field

from offload.autoscale import keyspace
from offload.autoscale.providers.base import (
    LaunchSpec,
    Machine,
    MachineState,
    NotOurs,
    Provider,
    ProviderConfig,
    ProviderError,
    is_ours,
)
from offload.clock import Clock
from offload.env import process_env
from offload.redis_client import RedisClient

log = logging.getLogger("offload.autoscale.local")
# What a worker process inherits from the server's environment: how to run Python and find the handler, nothing
# else. Never the vault master key, the Redis URL, the admin key or backend and storage credentials.
PASS_ENV = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TMPDIR",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
)


def worker_env(server_env: Mapping[str, str], launch: Mapping[str, str]) -> dict[str, str]:
    """The environment of a spawned worker: PASS_ENV from the server's, then what the autoscaler ships (the
    server URL, the worker key, the queue, the instance id, the queue's instance.env)."""
    return {**{k: server_env[k] for k in PASS_ENV if k in server_env}, **launch}


class LocalConfig(ProviderConfig):
    handler: str | None = Field(None, description="module:function; else the queue's instance.handler")
    python: str = Field(sys.executable, description="the interpreter that runs `-m offload worker`")
    workdir: str | None = Field(None, description="working directory (the handler's module must import there)")
    log_dir: str | None = Field(None, description="one log file per machine; default: discard output")
    concurrency: int = Field(1, ge=1)
    grace: float = Field(30.0, ge=0, description="seconds a draining worker may finish in-flight jobs")
    stop_timeout: float = Field(10.0, ge=0, description="after SIGTERM on destroy, SIGKILL after this")
    price_per_hour: float = Field(0.0, ge=0)
    deploy_dir: str | None = Field(
        None, description="where per-instance deployment work dirs go (default: a directory under the system temp dir)"
    )


def _start_time(pid: int) -> str | None:
    """The kernel's start time of a pid (field 22 of /proc/pid/stat); None if it does not exist or is a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


class LocalProvider(Provider):
    type = "local"
    real = False
    Config = LocalConfig

    def __init__(self, name: str, config: LocalConfig, redis: RedisClient, clock: Clock = time.time) -> None:
        super().__init__(name)
        self.config = config
        self.redis = redis
        self.clock = clock
        self.key = keyspace.machines("local", name)
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    def _workdir(self, label: str) -> Path:
        root = Path(self.config.deploy_dir or Path(tempfile.gettempdir()) / "offload-local" / self.name)
        return root / label

    async def create(self, spec: LaunchSpec) -> Machine:
        handler = self.config.handler or spec.handler
        if not handler and not spec.script:
            raise ProviderError(
                "local: no handler (set the provider's `handler`, the queue's instance.handler or a deployment)",
                retryable=False,
            )
        server = spec.env.get("OFFLOAD_SERVER")
        if not server or not spec.env.get("OFFLOAD_TOKEN"):
            raise ProviderError("local: the server URL and a worker key are needed to start a worker", retryable=False)
        provider_id = "local-" + secrets.token_hex(6)
        env = worker_env(process_env(), spec.env)  # minimal: never the vault key, Redis URL or backend secrets
        cwd, workdir = self.config.workdir, None
        if spec.script:  # deploy from git: its own work dir, the worker started by the script
            workdir = self._workdir(spec.label)
            workdir.mkdir(parents=True, exist_ok=True)
            cmd, cwd = ["sh", "-c", spec.script], str(workdir)
            env.update(OFFLOAD_WORKDIR=str(workdir), OFFLOAD_PYTHON=self.config.python)
        else:
            assert handler is not None
            cmd = [
                self.config.python,
                "-m",
                "offload",
                "worker",
                "--handler",
                handler,
                "--queue",
                spec.queue,
                "--server",
                server,
                "--concurrency",
                str(self.config.concurrency),
                "--grace",
                str(self.config.grace),
            ]
        log_path = str(Path(self.config.log_dir) / f"{spec.label}.log") if self.config.log_dir else None
        try:
            proc = await asyncio.to_thread(self._spawn, cmd, env, log_path, cwd)
        except OSError as exc:
            raise ProviderError(f"local: cannot start the worker: {exc}", retryable=False) from None
        self._children[proc.pid] = proc
        record = {
            "id": provider_id,
            "label": spec.label,
            "pid": proc.pid,
            "start": _start_time(proc.pid),
            "created": self.clock(),
            "log": log_path,
            "queue": spec.queue,
            "workdir": str(workdir) if workdir else None,
        }
        await self.redis.hset(self.key, provider_id, orjson.dumps(record))
        log.info("local: started worker pid %d for %s (queue %s)", proc.pid, spec.label, spec.queue)
        return self._machine(record)

    def _spawn(
        self, cmd: list[str], env: dict[str, str], log_path: str | None, cwd: str | None
    ) -> subprocess.Popen[bytes]:
        if log_path is None:
            return subprocess.Popen(
                cmd,
                env=env,
                cwd=cwd,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            return subprocess.Popen(
                cmd,
                env=env,
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def _alive(self, record: dict[str, Any]) -> bool:
        pid = int(record["pid"])
        child = self._children.get(pid)
        if child is not None and child.poll() is not None:
            return False
        return _start_time(pid) == record.get("start") and record.get("start") is not None

    def _machine(self, r: dict[str, Any]) -> Machine:
        state = MachineState.RUNNING if self._alive(r) else MachineState.TERMINATED
        return Machine(
            provider_id=r["id"],
            label=r["label"],
            state=state,
            price_per_hour=self.config.price_per_hour,
            host_id="localhost",
            raw=r,
        )

    async def list(self) -> builtins.list[Machine]:
        raw = await self.redis.hgetall(self.key)
        return [m for m in (self._machine(orjson.loads(v)) for v in raw.values()) if is_ours(m.label)]

    async def _record(self, provider_id: str) -> dict[str, Any] | None:
        raw = await self.redis.hget(self.key, provider_id)
        return None if raw is None else dict(orjson.loads(raw))

    async def destroy(self, provider_id: str) -> None:
        record = await self._record(provider_id)
        if record is None:
            return
        if not is_ours(record.get("label")):
            raise NotOurs(provider_id, record.get("label", ""))
        pid = int(record["pid"])
        if self._alive(record):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)
            deadline = time.monotonic() + self.config.stop_timeout
            while self._alive(record) and time.monotonic() < deadline:  # noqa: ASYNC110 - polling a pid
                await asyncio.sleep(0.05)
            if self._alive(record):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        child = self._children.pop(pid, None)
        if child is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(5)
        if record.get("workdir"):
            await asyncio.to_thread(shutil.rmtree, record["workdir"], True)
        await self.redis.hdel(self.key, provider_id)
        log.info("local: stopped worker pid %d (%s)", pid, record.get("label"))
