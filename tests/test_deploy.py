"""The systemd unit: verified by systemd-analyze (where it exists), and its stop timeout covers the grace."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

UNIT = Path(__file__).parent.parent / "deploy" / "systemd" / "offload-worker@.service"


def test_stop_timeout_covers_the_grace_period() -> None:
    text = UNIT.read_text()
    grace = int(re.search(r"--grace (\d+)", text).group(1))  # type: ignore[union-attr]
    stop = int(re.search(r"TimeoutStopSec=(\d+)", text).group(1))  # type: ignore[union-attr]
    assert stop > grace
    assert "Restart=always" in text and "EnvironmentFile=/etc/offload/worker.env" in text


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify checks that ExecStart exists, so point it at a real executable in a copy of the unit
    offload = shutil.which("offload") or str(Path(__file__).parent.parent / ".venv" / "bin" / "offload")
    unit = tmp_path / "offload-worker@.service"
    unit.write_text(UNIT.read_text().replace("/opt/offload/venv/bin/offload", offload))
    instance = tmp_path / "offload-worker@1.service"
    instance.symlink_to(unit)
    out = subprocess.run(["systemd-analyze", "verify", "--man=no", str(instance)], capture_output=True, text=True,
                         timeout=60)
    problems = [line for line in out.stderr.splitlines()
                if "offload-worker" in line and "Failed to" not in line.split(":", 1)[0]]
    assert out.returncode == 0, out.stderr
    assert problems == [], problems
