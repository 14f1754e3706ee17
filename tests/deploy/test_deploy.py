"""The systemd units: verified by systemd-analyze (where it exists); the worker's stop timeout covers its drain, and
the server unit runs `offload server` on port 8000 from its own 0600 env file, sandboxed."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from offload.backends.settings import DEFAULT_TIMEOUT
from offload.worker.drain import RECORD_S

UNITS = Path(__file__).parents[2] / "deploy" / "systemd"
UNIT = UNITS / "offload-worker@.service"
SERVER_UNIT = UNITS / "offload-server.service"


def _found(pattern: str, text: str, flags: int = 0) -> str:
    """The first group of `pattern` in `text`, which must hold it."""
    match = re.search(pattern, text, flags)
    assert match is not None, pattern
    return match[1]


def test_stop_timeout_covers_the_whole_drain() -> None:
    """systemd's SIGKILL must not come before the drain ends: the grace, or the submit calls out awaited until the
    default backend timeout + RECORD_S (whichever is longer), then the metrics flush (2 s) and the release (a
    lease, 10 s). A SIGKILL inside the drain costs what a cut does."""
    text = UNIT.read_text()
    grace = int(re.search(r"--grace (\d+)", text).group(1))  # type: ignore[union-attr]
    stop = int(re.search(r"TimeoutStopSec=(\d+)", text).group(1))  # type: ignore[union-attr]
    assert stop >= max(grace, DEFAULT_TIMEOUT + RECORD_S) + 2 + 10 + 5
    assert re.search(r"^KillMode=mixed$", text, re.M), "SIGTERM to the worker only"
    assert "Restart=always" in text and "EnvironmentFile=/etc/offload/worker.env" in text


def test_worker_unit_names_no_queue_the_env_file_does() -> None:
    """`offload worker` serves OFFLOAD_QUEUE, else the configuration's queues (tests/worker/test_worker_cli.py); a
    `--queue ${OFFLOAD_QUEUE}` here would make an env file without OFFLOAD_QUEUE fail to start."""
    exec_start = _found(r"^ExecStart=(.+)$", UNIT.read_text(), re.M)
    assert exec_start == "/opt/offload/venv/bin/offload worker --grace 60"


def test_server_unit_runs_the_server_on_port_8000_unprivileged() -> None:
    text = SERVER_UNIT.read_text()
    exec_start = _found(r"^ExecStart=(.+)$", text, re.M)
    assert exec_start == "/opt/offload/venv/bin/offload server --host ${OFFLOAD_SERVER_HOST} --port 8000"
    for line in (
        "EnvironmentFile=/etc/offload/server.env",
        "User=offload",
        "Restart=always",
        "NoNewPrivileges=true",
        "ProtectSystem=strict",
        "CapabilityBoundingSet=",
        "WantedBy=multi-user.target",
    ):
        assert re.search(rf"^{re.escape(line)}$", text, re.M), line


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
@pytest.mark.parametrize(
    ("unit", "instance"), [(UNIT, "offload-worker@1.service"), (SERVER_UNIT, "offload-server.service")]
)
def test_unit_passes_systemd_analyze_verify(tmp_path: Path, unit: Path, instance: str) -> None:
    # verify checks that ExecStart exists, so point it at a real executable in a copy of the unit
    offload = shutil.which("offload") or str(Path(__file__).parents[2] / ".venv" / "bin" / "offload")
    copy = tmp_path / unit.name
    copy.write_text(unit.read_text().replace("/opt/offload/venv/bin/offload", offload))
    target = tmp_path / instance
    if target != copy:
        target.symlink_to(copy)
    out = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(target)], capture_output=True, text=True, timeout=60
    )
    problems = [
        line for line in out.stderr.splitlines() if "offload-" in line and "Failed to" not in line.split(":", 1)[0]
    ]
    assert out.returncode == 0, out.stderr
    assert problems == [], problems
