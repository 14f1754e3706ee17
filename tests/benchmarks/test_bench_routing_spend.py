"""`bench/routing_spend.py --small` runs every setup end to end and its report holds together: every job succeeded,
submitted once, the spend is the sum of the job costs and what the simulator ran, and routing by deadline sends
the 24 h half to the cheap lane, so the routed spend is below the single backend's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from test_bench_smoke import ROOT, last_json

from bench.routing_spend import SETUPS, Params, summarise
from offload.models import Job, JobState

SMALL_BOUND = 120  # a deadline on a loaded machine; the run takes about 15 s


def check_setup(name: str, setup: dict[str, Any], price: float) -> None:
    where = f"{name}: {setup}"
    jobs = setup["jobs"]
    assert jobs == 200 and setup["succeeded"] == jobs and setup["without_cost"] == 0, where
    # exactly once: the simulator was asked to run each job once, and no worker suspected a duplicate
    assert setup["submissions"] == jobs and sum(setup["ran_by_backend"].values()) == jobs, where
    assert setup["duplicate_submissions"] == 0 and setup["possible_duplicates"] == 0, where
    assert sum(setup["jobs_by_backend"].values()) == jobs, where
    # the recorded spend is the job costs, and matches what the simulator ran at each lane's price
    assert abs(setup["spend"] - sum(setup["spend_by_backend"].values())) < 1e-6, where
    assert abs(setup["spend"] - setup["billed"]) < 1e-6, where
    cheap = sum(n for backend, n in setup["jobs_by_backend"].items() if backend != "live")
    assert abs(setup["spend"] - (setup["jobs_by_backend"].get("live", 0) * price + cheap * price / 2)) < 1e-6, where
    assert setup["none_on_live"] == 1.0, where  # no deadline: the interactive backend, first in order
    for half in ("deadline", "none"):
        assert 0 < setup[f"{half}_finish_p50_s"] <= setup[f"{half}_finish_p95_s"], where


def test_routing_spend_small(tmp_path: Path) -> None:
    doc = last_json(["bench/routing_spend.py", "--small", "--out", str(tmp_path)], timeout=SMALL_BOUND)
    assert json.loads((tmp_path / "routing_spend.json").read_text()) == doc
    assert "| routed |" in (tmp_path / "routing_spend.md").read_text()
    setups, price = doc["setups"], doc["price_per_job"]
    assert list(setups) == ["single", "routed", "batch"], setups
    for name in ("single", "routed", "batch"):
        check_setup(name, setups[name], price)
    single, routed = setups["single"], setups["routed"]
    assert single["jobs_by_backend"] == {"live": 200} and single["spend"] == round(200 * price, 6), single
    # routing by deadline: every 24 h job on the half-price lane, none of the others
    assert routed["deadline_on_cheap"] == 1.0 and routed["jobs_by_backend"] == {"live": 100, "slow": 100}, routed
    assert routed["spend"] < single["spend"] and doc["ratios"]["routed_vs_single"] == 0.75, doc["ratios"]
    batch = setups["batch"]  # the same through OpenAI's Batch API: every 24 h job in a batch
    assert batch["deadline_on_cheap"] == 1.0 and batch["jobs_by_backend"] == {"batch": 100, "live": 100}, batch
    assert doc["ratios"]["batch_vs_single"] == 0.75, doc["ratios"]


def test_routing_spend_refuses_an_unknown_setup() -> None:
    proc = subprocess.run(
        [sys.executable, "bench/routing_spend.py", "--setups", "single,nope"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--setups: unknown nope" in proc.stderr, proc.stderr


def record(i: int, backend: str, cost: float | None, deadline: int | None) -> Job:
    return Job(
        id=f"mix:{i}", queue="mix", state=JobState.SUCCEEDED, input={}, output_key="", priority=0, attempts=1,
        max_attempts=3, lease_expiries=0, created_at=1_000, finished_at=3_000, backend=backend, cost=cost,
        deadline=deadline,
    )  # fmt: skip


def test_the_report_shows_a_second_run_and_a_job_without_cost() -> None:
    """What the bench relies on to catch a double payment: the simulator's runs are priced apart from the job
    records, so a job run twice at the provider makes `billed` exceed the spend, and a job whose record has no
    cost is counted, not read as free."""
    params = Params("http://127.0.0.1:1", 1.0, 10.0, 5.0)
    records = [record(0, "slow", 0.001, 86_400_000), record(1, "live", None, None)]
    remote = [
        {"family": "jobs", "meta": {}},
        {"family": "jobs", "meta": {}},  # job 0 again: paid twice at the slow lane
        {"family": "openai", "meta": {}},
    ]
    stats = {"submissions": 3, "duplicate_input_ids": ["routed-0"]}
    report = summarise(SETUPS["routed"], params, records, remote, stats)
    assert report["spend"] == 0.001 and report["billed"] == 0.004, report  # 2 x $0.001 + $0.002
    assert report["duplicate_submissions"] == 1 and report["without_cost"] == 1, report
    assert report["ran_by_backend"] == {"live": 1, "slow": 2} and report["deadline_on_cheap"] == 1.0, report
    assert report["deadline_finish_p50_s"] == 2.0 and report["none_on_live"] == 1.0, report
