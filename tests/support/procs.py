"""Every process a test session starts dies with it, however it ends (a pytest plugin: tests/conftest.py loads it).

Two nets. A child a helper starts gets the kernel's parent-death signal (`die_with_parent`, PR_SET_PDEATHSIG):
SIGKILLed when the thread that started it dies, even by SIGKILL or pytest-timeout's `os._exit`, where no atexit
or finalizer runs. Fixtures run on the main thread, so that is the session. And at the session's end, any process
of this user still working in, or naming, the session's temporary directory is SIGKILLed: the grandchildren
(`offload up` detaches its Valkey) a test that timed out left behind."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent() -> None:
    """A Popen `preexec_fn`: the child gets SIGKILL when the thread that started it ends. Loaded before the fork
    (`_LIBC`), so the child only makes one system call."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def interruptible() -> None:
    """A Popen `preexec_fn` for a child a test will Ctrl-C: `die_with_parent`, and SIGINT unblocked at its default,
    so the child's Python installs its KeyboardInterrupt handler whatever the session's process inherited or set
    (a Python started with SIGINT ignored never raises KeyboardInterrupt)."""
    die_with_parent()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def signal_state(pid: int | str = "self") -> str:
    """The signal masks of a process (blocked, ignored, caught), for a test's failure message."""
    with contextlib.suppress(OSError):
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        return " ".join(line for line in lines if line.startswith(("SigBlk", "SigIgn", "SigCgt", "State")))
    return "gone"


def preexec() -> Callable[[], None] | None:
    """`die_with_parent` when called on the main thread, which lives as long as the session; None on another
    (a server started in `asyncio.to_thread`), whose end would kill the child with it: the sweep covers those."""
    return die_with_parent if threading.current_thread() is threading.main_thread() else None


def _names(pid: int, root: str) -> bool:
    """`root` ends with a separator, so /tmp/x/popen-gw1/ never matches popen-gw10's processes."""
    proc = Path("/proc") / str(pid)
    with contextlib.suppress(OSError):
        if (os.readlink(proc / "cwd") + os.sep).startswith(root):
            return True
    with contextlib.suppress(OSError):
        return any(
            (arg + os.sep.encode()).startswith(root.encode()) or root.encode() in arg
            for arg in (proc / "cmdline").read_bytes().split(b"\0")
        )
    return False


def sweep(root: Path) -> list[int]:
    """SIGKILL this user's processes, other than this one and its ancestors, that work in `root` or name it on
    their command line; the pids killed."""
    spared = {os.getpid(), os.getppid()}
    uid, prefix, killed = os.getuid(), str(root.resolve()) + os.sep, []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in spared:
            continue
        with contextlib.suppress(OSError):
            if entry.stat().st_uid == uid and _names(int(entry.name), prefix):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
    return killed


@pytest.fixture(scope="session", autouse=True)
def no_process_outlives_the_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """First set up, last torn down: every fixture's server is stopped by then; what is left is a leak."""
    root = tmp_path_factory.getbasetemp()
    atexit.register(sweep, root)  # a session ended by KeyboardInterrupt or an exception in a hook
    yield
    left = sweep(root)
    if left:
        print(f"\nsupport.procs: SIGKILLed {len(left)} process(es) the session left behind: {left}", file=sys.stderr)
