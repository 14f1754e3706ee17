"""The wheel's Valkey runs with jemalloc preloaded where the machine has it (offload.local.embedded.server_env).

`make test` installs Debian's libjemalloc2 when it is missing, so these tests see a machine that has it; the
other case (a machine without it) is the loader lookup answering None.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from offload import Client
from offload.errors import ConfigError
from offload.local.embedded import (
    ALLOCATOR_VAR,
    _jemalloc,
    allocator,
    data_dir,
    ensure_embedded,
    server_argv,
    server_binary,
    server_env,
    stop_embedded,
)


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def _pid(home: Path) -> int:
    return int(json.loads((home / "valkey" / "server.json").read_text())["pid"])


@pytest.fixture
def no_jemalloc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The loader finds no jemalloc (a machine without libjemalloc2)."""
    _jemalloc.cache_clear()
    monkeypatch.setattr("ctypes.util.find_library", lambda name: None)
    yield
    _jemalloc.cache_clear()


def test_this_machine_has_jemalloc() -> None:
    """What the rest assumes: `make test` put libjemalloc2 here, and the loader finds it by name."""
    lib = _jemalloc()
    assert lib is not None and lib.startswith("libjemalloc.so")
    assert allocator({}) == "jemalloc" and allocator({ALLOCATOR_VAR: "libc"}) == "libc"


@pytest.mark.usefixtures("no_jemalloc")
def test_without_jemalloc_the_embedded_valkey_says_it_runs_on_glibc(
    tmp_home: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A machine without libjemalloc2 gets glibc's malloc by default, and is told so once per start, with the
    package to install (the variable unset, or blank, which server_env reads as unset); asking for libc
    explicitly starts it without the notice."""
    try:
        for asked in (None, " "):
            if asked is None:
                monkeypatch.delenv(ALLOCATOR_VAR, raising=False)
            else:
                monkeypatch.setenv(ALLOCATOR_VAR, asked)
            with caplog.at_level("WARNING", logger="offload.embedded"):
                ensure_embedded()
            assert "libjemalloc" not in _maps(_pid(tmp_home))
            notices = [r.getMessage() for r in caplog.records if r.name == "offload.embedded"]
            assert len(notices) == 1 and "glibc" in notices[0] and "libjemalloc2" in notices[0], (asked, notices)
            assert stop_embedded()
            caplog.clear()
        monkeypatch.setenv(ALLOCATOR_VAR, "libc")
        with caplog.at_level("WARNING", logger="offload.embedded"):
            ensure_embedded()
        assert not [r for r in caplog.records if r.name == "offload.embedded"]
    finally:
        stop_embedded()


def test_jemalloc_is_preloaded_and_other_preloads_are_kept() -> None:
    lib = _jemalloc()
    assert server_env({})["LD_PRELOAD"] == lib
    env = server_env({"LD_PRELOAD": "libmine.so", "PATH": "/bin"})
    assert env["LD_PRELOAD"] == f"{lib} libmine.so" and env["PATH"] == "/bin"


def test_libc_keeps_glibc_and_the_variable_does_not_reach_the_server() -> None:
    env = server_env({ALLOCATOR_VAR: " LIBC ", "PATH": "/bin"})
    assert env == {"PATH": "/bin"}


def test_a_bad_allocator_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=rf"{ALLOCATOR_VAR}: expected one of jemalloc, libc, got 'tcmalloc'"):
        server_env({ALLOCATOR_VAR: "tcmalloc"})


@pytest.mark.usefixtures("no_jemalloc")
def test_without_jemalloc_the_default_runs_glibc_and_asking_for_it_is_an_error() -> None:
    assert "LD_PRELOAD" not in server_env({}) and allocator({}) == "libc"
    with pytest.raises(ConfigError, match=rf"{ALLOCATOR_VAR}: jemalloc was asked for and is not on this machine"):
        server_env({ALLOCATOR_VAR: "jemalloc"})


def test_the_embedded_valkey_runs_on_jemalloc_and_keeps_its_jobs_across_a_kill(tmp_home: Path) -> None:
    """The server really maps jemalloc (the preload took), serves the queue, and its AOF replays after a SIGKILL
    under the same allocator: the allocator changes nothing that the queue keeps."""
    try:
        # AOF `always`: every write reaches the file before its reply. Under `everysec` a busy disk lets Valkey
        # postpone the write past the reply for up to 2 s, so a kill may lose the last second (the documented cost).
        ensure_embedded(appendfsync="always")
        pid = _pid(tmp_home)
        assert "libjemalloc" in _maps(pid)
        with Client() as client:
            ids = client.enqueue_many("demo", [{"n": i} for i in range(200)])
        os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)  # this process started it: reap it, or /proc/pid stays as a zombie
        url = ensure_embedded()  # started again: the AOF is replayed
        assert "libjemalloc" in _maps(_pid(tmp_home)) and _pid(tmp_home) != pid
        with Client(url) as client:
            assert client.stats("demo").counts["queued"] == 200
            assert client.get(ids[-1]).input == {"n": 199}
    finally:
        assert stop_embedded()


def test_libc_is_kept_by_the_embedded_valkey_when_asked(tmp_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALLOCATOR_VAR, "libc")
    try:
        ensure_embedded()
        assert "libjemalloc" not in _maps(_pid(tmp_home))
        assert data_dir() == tmp_home
    finally:
        assert stop_embedded()


def test_every_valkey_started_from_the_wheel_gets_one_argv(tmp_path: Path) -> None:
    """server_argv is the one place for the flags (the embedded default, the tests' servers, the fault harness,
    every benchmark): offload's persistence unless told otherwise, in the foreground, extra flags last (a later
    flag wins in Valkey's argv, so a caller can override one of ours)."""
    argv = server_argv(6399, tmp_path, extra=("--appendfsync", "always"))
    assert argv[0] == str(server_binary()) and argv[1:7] == [
        "--port",
        "6399",
        "--bind",
        "127.0.0.1",
        "--dir",
        str(tmp_path),
    ]
    assert argv[7:13] == ["--appendonly", "yes", "--appendfsync", "everysec", "--save", ""]
    assert argv[-4:] == ["--daemonize", "no", "--appendfsync", "always"]
    bare = server_argv(6399, tmp_path, bind="0.0.0.0", appendfsync=None)  # Valkey's own persistence defaults
    assert "--appendonly" not in bare and "--save" not in bare and bare[4] == "0.0.0.0"
