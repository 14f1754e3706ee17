"""A test that times out leaves no process behind (support/procs.py): a pytest session of its own, whose one test
starts a Valkey, an S3 server (rclone), a child of its own and a detached process, then hangs until
pytest-timeout ends it, by an exception (`signal`, the default) or by `os._exit` (`thread`, where no finalizer or
atexit runs)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.procs import sweep

TESTS = Path(__file__).resolve().parents[1]
HANG = """
import subprocess, sys, time
from pathlib import Path
from support.procs import die_with_parent
from support.s3server import RcloneS3
from support.servers import ValkeyServer

def test_hangs(tmp_path):
    valkey = ValkeyServer(tmp_path / "valkey").start()
    s3 = RcloneS3(tmp_path / "s3").start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], preexec_fn=die_with_parent)
    detached = subprocess.Popen(["sleep", "600"], cwd=tmp_path, start_new_session=True)
    pids = [valkey.pid, s3._proc.pid, child.pid, detached.pid]
    Path({out!r}).write_text(" ".join(map(str, pids)))
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _session(tmp_path: Path, method: str) -> tuple[subprocess.CompletedProcess[str], list[int]]:
    inner, out = tmp_path / method, tmp_path / f"{method}.pids"
    inner.mkdir()
    (inner / "pytest.ini").write_text("[pytest]\n")
    (inner / "test_hang.py").write_text(HANG.format(out=str(out)))
    cmd = [sys.executable, "-m", "pytest", "-q", "-c", str(inner / "pytest.ini"), "--rootdir", str(inner)]
    cmd += ["-p", "no:cacheprovider", "-p", "no:valkey", "-p", "support.procs", "--basetemp", str(inner / "tmp")]
    cmd += ["--timeout", "10", "--timeout-method", method, str(inner / "test_hang.py")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    proc = subprocess.run(cmd, env=env, cwd=inner, capture_output=True, text=True, timeout=120)
    assert out.exists(), f"the hanging test never started its processes:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc, [int(p) for p in out.read_text().split()]


def _left(pids: list[int], within: float = 10.0) -> list[int]:
    """The pids still alive once the kernel has had `within` seconds to deliver the parent-death signals."""
    deadline = time.monotonic() + within
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
@pytest.mark.parametrize("method", ["signal", "thread"])
def test_a_timed_out_test_leaves_no_process_behind(tmp_path: Path, method: str) -> None:
    proc, pids = _session(tmp_path, method)
    children = pids[:3]  # Valkey, rclone, the test's child: each with the parent-death signal
    try:
        assert "Timeout" in proc.stdout + proc.stderr, proc.stdout[-3000:]
        if method == "signal":  # the session ends as usual: its last finalizer sweeps the detached one too
            assert _left(pids) == []
        else:  # os._exit: only the kernel acts; a detached grandchild is out of its reach (the next sweep's)
            assert _left(children) == []
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_the_sweep_takes_what_works_in_or_names_its_directory_and_nothing_else(tmp_path: Path) -> None:
    mine, neighbour = tmp_path / "popen-gw1", tmp_path / "popen-gw10"  # two xdist workers' directories
    for d in (mine, neighbour):
        d.mkdir()
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    inside = subprocess.Popen(sleeper, cwd=mine)
    naming = subprocess.Popen([*sleeper, f"--dir={mine}/data"], cwd=tmp_path)
    next_door = subprocess.Popen([*sleeper, str(neighbour)], cwd=neighbour)
    try:
        assert sorted(sweep(mine)) == sorted([inside.pid, naming.pid])
        assert _left([inside.pid, naming.pid]) == [] and _alive(next_door.pid)
    finally:
        for p in (inside, naming, next_door):
            p.kill()
            p.wait()
