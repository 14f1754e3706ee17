"""The peer benchmark's runner end to end at a tiny size, offload only (the peers' venvs are not installed here):
every workload through the same code path as the full run (offload's 30 s jobs both polling and with webhooks),
and the page, plots and JSON it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_peers_bench_offload_only(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = [
        sys.executable,
        "-m",
        "bench.peers",
        "--quick",
        "--systems",
        "offload",
        "--out",
        str(out),
        "--noop-jobs",
        "50",
        "--io-jobs",
        "50",
        "--gpu-jobs",
        "20",
        "--gpu-seconds",
        "0.5",
        "--crash-jobs",
        "10",
        "--crash-seconds",
        "1",
        "--crash-cap",
        "5",
        "--offload-lease-ms",
        "2000",
    ]
    proc = subprocess.run(
        args, cwd=ROOT, capture_output=True, text=True, timeout=240
    )  # a deadline for a loaded machine
    assert proc.returncode == 0, f"exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(summary) == {"wall_s", "systems"} and set(summary["systems"]) == {"offload"}
    row = summary["systems"]["offload"]
    assert row["noop_jobs_per_s"] > 0 and row["io_jobs_per_s"] > 0, row
    assert 0 < row["gpu_peak_in_flight"] <= 20, row
    # (c) ran twice for offload: polling, and with provider webhooks on (the real server receiving them)
    assert 0 < row["gpu_webhooks_peak_in_flight"] <= 20, row
    # each job runs 0.5 s at the provider: no run ends sooner (the report rounds to 0.1 s, so 0.54 s reads 0.5)
    assert row["gpu_all_done_s"] >= 0.5 and row["gpu_webhooks_all_done_s"] >= 0.5, row
    assert set(row["crash"]) == {"lost", "rerun", "duplicated", "all_done_s"}
    assert row["crash"]["rerun"] == 0 and row["crash"]["duplicated"] == 0, row  # resumed, never re-submitted

    results = json.loads((out / "benchmarks.json").read_text())
    assert {r["workload"] for r in results["runs"]} == {"noop", "io", "gpu"}
    gpu = {r["system"]: r for r in results["runs"] if r["workload"] == "gpu"}
    assert set(gpu) == {"offload", "offload-webhooks"} and gpu["offload-webhooks"]["done"] == 20, gpu
    assert not [r["error"] for r in results["runs"] if r["error"]]
    (crash,) = results["crashes"]
    assert crash["error"] is None and crash["in_flight_at_kill"] > 0, crash
    assert results["machine"]["cores"] and results["machine"]["valkey"]
    assert results["versions"]["offload"]["offload"]

    page = (out / "benchmarks.md").read_text()
    for heading in (
        "## Headline",
        "## No-op jobs",
        "## Jobs that wait 50 ms on I/O",
        "## 30 s jobs",
        "## SIGKILL with jobs in flight",
        "## Versions",
        "## Method",
    ):
        assert heading in page, heading
    assert "| offload |" in page and "| offload, webhooks |" in page and "(webhooks: " in page
    pngs = sorted(p.name for p in (out / "img").glob("*.png"))
    assert pngs == ["peers-durability.png", "peers-inflight.png", "peers-throughput.png"]
    assert all((out / "img" / p).read_bytes().startswith(b"\x89PNG") for p in pngs)
    assert all(f"img/{p}" in page for p in pngs)


def test_a_peer_venv_made_by_another_interpreter_is_made_again(tmp_path: Path) -> None:
    """Every system must run on the interpreter that runs the benchmark: a venv's stamp names its interpreter."""
    from bench.peers.systems import PEERS, venv_key

    peer = PEERS[0]
    other = tmp_path / "python3"
    other.symlink_to(sys.executable)
    assert venv_key(peer, sys.executable) == venv_key(peer, sys.executable)
    assert venv_key(peer, sys.executable) != venv_key(peer, str(tmp_path / "elsewhere" / "python3"))
    assert venv_key(peer, str(other)) == venv_key(peer, sys.executable)  # a link to the same interpreter is it
    assert venv_key(peer, sys.executable) != venv_key(PEERS[1], sys.executable)
