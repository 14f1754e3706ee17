"""README quickstart command 1: `offload demo` brings up the local stack (embedded Valkey, embedded S3, the
simulator, workers), runs a batch end to end, and `offload down` leaves nothing running."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson

from offload.local.stack import running_components


def offload(home: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OFFLOAD_REDIS_URL", "REDIS_URL", "OFFLOAD_CONFIG")}
    env["OFFLOAD_HOME"] = str(home / ".offload")
    return subprocess.run(
        [sys.executable, "-m", "offload", *args], cwd=home, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_demo_runs_the_pipeline_and_down_stops_everything(tmp_path: Path) -> None:
    try:
        run = offload(tmp_path, "demo", "--jobs", "12")
        assert run.returncode == 0, run.stderr
        assert "succeeded 12" in run.stdout and "offload result" in run.stdout
        comps = running_components(tmp_path / ".offload")
        assert {c.name for c in comps} == {"s3", "simulator", "worker-1", "worker-2"}
        secret = orjson.loads((tmp_path / ".offload" / "s3-credentials.json").read_bytes())["secret_access_key"]
        for comp in comps:  # no command line, which any local user can read (`ps`), carries the S3 secret
            cmdline = Path(f"/proc/{comp.pid}/cmdline").read_bytes()
            assert cmdline and secret.encode() not in cmdline, comp.name
        listing = offload(tmp_path, "jobs", "demo", "--state", "succeeded", "--json")
        jobs = orjson.loads(listing.stdout)["jobs"]
        assert len(jobs) == 12
        out = tmp_path / "out.json"
        got = offload(tmp_path, "result", jobs[0]["id"], "--download", str(out))
        assert got.returncode == 0, got.stderr
        assert got.stdout.startswith("s3://results/results/") and "X-Amz-Signature" in got.stdout
        assert orjson.loads(out.read_bytes())["echo"] == jobs[0]["input"]
        # the stored object is a plain file under the embedded S3's data directory
        assert (tmp_path / ".offload" / "s3" / "results" / "results" / f"{jobs[0]['id']}.json").exists()
    finally:
        stopped = offload(tmp_path, "down")
    assert stopped.returncode == 0 and "valkey" in stopped.stdout
    assert running_components(tmp_path / ".offload") == []
