"""The benchmarks still run end to end at a small size, and their last line is the JSON they promise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# How long a small run may take on a loaded machine: a deadline, not a speed claim (pytest-timeout is 300 s).
# The sizes are chosen to stay far below it (docs/explanation/performance.md, *Test deadlines*).
BOUND = 240


def last_json(args: list[str], timeout: float) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, f"{' '.join(args)} printed nothing"
    doc = json.loads(lines[-1])
    assert isinstance(doc, dict)
    return doc


def test_queue_throughput_bench() -> None:
    doc = last_json(["bench/queue_throughput.py", "--jobs", "2000"], timeout=BOUND)
    assert set(doc) == {"enqueue_jobs_per_s", "e2e_jobs_per_s", "raw_pipelined_per_s", "e2e_aof_everysec_jobs_per_s"}
    assert all(isinstance(v, int | float) and v > 0 for v in doc.values()), doc


def test_inflight_bench() -> None:
    # --window 5: the tutorial baseline's 15 s quick window would be most of this test's time
    doc = last_json(["bench/inflight.py", "--quick", "--jobs", "200", "--latency", "1", "--window", "5"], timeout=BOUND)
    assert set(doc) == {
        "peak_in_flight",
        "worker_cpu_cores",
        "peak_rss_mb",
        "jobs_per_s",
        "tutorial_jobs_per_s",
        "ratio",
    }
    assert 0 < doc["peak_in_flight"] <= 200
    assert doc["jobs_per_s"] > 0 and doc["tutorial_jobs_per_s"] > 0 and doc["ratio"] > 0, doc


def test_http_enqueue_bench() -> None:
    doc = last_json(["bench/http_enqueue.py", "--jobs", "2000", "--singles", "50"], timeout=BOUND)
    assert set(doc) == {"batch_jobs_per_s", "single_p50_ms", "single_p99_ms", "single_per_s"}
    assert doc["batch_jobs_per_s"] > 0 and 0 < doc["single_p50_ms"] <= doc["single_p99_ms"], doc


def test_worker_throughput_bench() -> None:
    doc = last_json(["bench/worker_throughput.py", "--quick"], timeout=BOUND)
    assert set(doc) == {
        "worker_noop_per_s",
        "lean_noop_per_s",
        "worker_io50_per_s",
        "io50_bound_per_s",
        "noop_ratio",
        "io50_ratio",
        "loop_io50_per_s",
        "io50_loop_ratio",
        "worker_noop_aof_per_s",
        "lean_noop_aof_per_s",
        "noop_aof_ratio",
    }
    assert doc["io50_bound_per_s"] == 2000, doc  # 100 in flight / 0.05 s
    # the no-op pair ran again on the AOF server (no --url given): every figure is a rate, none missing
    assert doc["worker_noop_aof_per_s"] > 0 and doc["lean_noop_aof_per_s"] > 0 and doc["noop_aof_ratio"] > 0, doc
    # Each rate is jobs completed over time, and the bench exits non-zero unless every job was acknowledged.
    assert doc["worker_noop_per_s"] > 0 and doc["lean_noop_per_s"] > 0 and doc["worker_io50_per_s"] > 0, doc
    assert doc["noop_ratio"] > 0 and doc["io50_ratio"] > 0, doc
    # bare asyncio sleeps cannot beat the bound (a timer never fires early)
    assert 0 < doc["loop_io50_per_s"] <= 2000 and doc["io50_loop_ratio"] > 0, doc


def test_webhooks_bench() -> None:
    doc = last_json(["bench/webhooks.py", "--quick", "--jobs", "20", "--latency", "0.5"], timeout=BOUND)
    assert set(doc) == {
        "poll_p50_ms",
        "poll_p99_ms",
        "webhook_p50_ms",
        "webhook_p99_ms",
        "poll_calls_per_job",
        "webhook_calls_per_job",
        "server_cpu_ms_per_delivery",
    }
    assert doc["server_cpu_ms_per_delivery"] > 0, doc  # /proc is there on Linux, where this runs
    assert 0 <= doc["webhook_p50_ms"] <= doc["webhook_p99_ms"] and 0 <= doc["poll_p50_ms"] <= doc["poll_p99_ms"], doc
    # with webhooks each job costs its submit and nothing else (the fallback poll is 60 s away)
    assert doc["webhook_calls_per_job"] == 1.0 and doc["poll_calls_per_job"] > 1.0, doc


def test_store_outputs_bench() -> None:
    # 300 outputs, so the simulator's CPU for one road (~0.1 ms each) spans several of /proc's 10 ms clock ticks
    doc = last_json(["bench/store_outputs.py", "--quick", "--jobs", "300"], timeout=BOUND)
    roads = ("httpx", "plain", "unbounded")
    assert set(doc) == {
        *(f"{road}_jobs_per_s" for road in roads),
        *(f"{road}_cpu_ms_per_job" for road in roads),
        "ratio",
        "per_host_ratio",
        "plain_sim_cpu_ms_per_job",
        "unbounded_sim_cpu_ms_per_job",
    }
    # each rate counts outputs found stored on disk afterwards (the bench exits non-zero on a missing one)
    assert all(doc[f"{road}_jobs_per_s"] > 0 and doc[f"{road}_cpu_ms_per_job"] > 0 for road in roads), doc
    assert doc["ratio"] > 0 and doc["per_host_ratio"] > 0 and doc["plain_sim_cpu_ms_per_job"] > 0, doc
