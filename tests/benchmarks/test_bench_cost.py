"""`python -m bench.cost --small` runs end to end and its report holds together: every job served, utilisation
in (0, 1], no policy renting fewer GPU-hours than the clairvoyant bound at its own peak wait, sums that agree; and
the policy sweep's: every job of every hybrid run completed once, by exactly one kind of capacity, each policy's
chosen setting meeting its target, no policy costing less than the offline mix bound, and each cost's parts
(boot, idle, serverless premium) adding up to it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from test_bench_smoke import BOUND, last_json

# One of the five shipped traces: the faulty week, with its healthy twin, the six fleet policies and the sweep. The
# others exercise no code it does not and cost the suite's time budget (burst-day ~15 s, night-spike ~30 s, the
# diurnal two ~90 s on a loaded machine); `python -m bench.cost --small` plays all five.
TRACES = ("faulty-week",)


def test_cost_bench_small(tmp_path: Path) -> None:
    only = [arg for name in TRACES for arg in ("--only", name)]
    doc = last_json(["-m", "bench.cost", "--small", *only, "--plots", "--out", str(tmp_path)], timeout=2 * BOUND)
    assert {**json.loads((tmp_path / "cost.json").read_text()), "plots": doc["plots"]} == doc
    assert all((tmp_path / name).stat().st_size > 0 for name in doc["plots"]) and len(doc["plots"]) == 2 * len(TRACES)
    page = (tmp_path / "cost.md").read_text()
    assert page.count("The same arrivals on healthy hosts") == 1  # under the faulty trace only
    assert [t["name"] for t in doc["traces"]] == list(TRACES)
    assert page.count("The cheapest setting of each policy that meets each p95 wait target") == len(TRACES)
    for trace in doc["traces"]:
        assert f"### {trace['name']}" in page
        assert len(trace["runs"]) == 6 and set(trace["bounds"]) == {"8", "16"}
        for run in trace["runs"]:
            where = f"{trace['name']} / {run['policy']}: {run}"
            assert run["jobs_served"] == run["jobs_done"] == run["jobs"] > 0, where
            assert 0 < run["utilisation"] <= 1, where
            assert run["gpu_h_work"] <= run["gpu_h_rented"] + 0.01, where
            assert abs(run["utilisation"] - run["gpu_h_work"] / run["gpu_h_rented"]) < 0.01, where
            assert run["boot_gpu_h"] <= run["gpu_h_rented"] and run["never_served"] <= run["rentals"], where
            w = run["wait_min"]
            assert 0 <= w["p50"] <= w["p95"] <= w["max"], where
            dollars = run["gpu_h_rented"] * doc["price"] / run["jobs"] * 1000
            rounding = 0.005 * doc["price"] / run["jobs"] * 1000 + 0.01  # GPU-h are reported to a hundredth
            assert abs(run["usd_per_1000_jobs"] - dollars) <= rounding, where
            bound = run["bound"]
            assert bound["gpu_h_rented"] <= run["gpu_h_rented"], where
            assert bound["wait_min"]["max"] <= w["max"] + 0.1, where
            assert 0 < bound["utilisation"] <= 1 and bound["machines"] <= run["max_workers"], where
            healthy = run.get("healthy")
            assert (healthy is not None) == (trace["name"] == "faulty-week"), where  # a twin for faults only
            if healthy is not None:  # the target: faults at most double the longest wait
                assert healthy["jobs_served"] == healthy["jobs"] == run["jobs"], where
                assert run["peak_wait_vs_healthy"] == round(w["max"] / max(healthy["wait_min"]["max"], 0.1), 2)
                assert run["peak_wait_vs_healthy"] <= 2, where
        check_sweep(trace, doc["prices"])
        for n, bound in trace["bounds"].items():
            assert 0 < bound["utilisation"] <= 1 and bound["machines"] <= int(n), (trace["name"], bound)
            assert bound["gpu_h_rented"] >= bound["gpu_h_work"], (trace["name"], bound)


def check_sweep(trace: dict[str, Any], prices: dict[str, Any]) -> None:
    assert len(trace["hybrid_runs"]) == 2, trace["name"]
    for run in trace["hybrid_runs"]:
        where = f"{trace['name']} / {run['policy']}: {run}"
        assert run["jobs_served"] == run["done_once"] == run["jobs"] > 0, where  # once each, never by both
        assert run["on_fleet"] + run["on_serverless"] == run["jobs"], where
        assert run["serverless_gpu_h"] >= 0 and run["fleet_gpu_h"] >= 0, where
        billed = run["fleet_gpu_h"] * prices["rented"] + run["serverless_gpu_h"] * prices["serverless"]
        assert abs(run["cost"] - billed) <= 0.01 * (prices["rented"] + prices["serverless"]) + 0.01, where
    assert set(trace["sweep"]) == {"1", "5", "15", "30"}
    for target, row in trace["sweep"].items():
        where = f"{trace['name']} at p95 {target} min: {row}"
        assert row["serverless"] is not None, where  # a 5-20 s cold start meets every target
        bound = row["bound"]
        assert bound["on_fleet"] + bound["on_serverless"] == trace["runs"][0]["jobs"], where
        assert bound["p95_min"] <= float(target), where
        for kind in ("serverless", "fleet", "hybrid"):
            chosen = row[kind]
            if chosen is not None:
                assert chosen["p95_min"] <= float(target), where
                assert bound["cost"] <= chosen["cost"] + 0.01, (kind, where)
        hybrid, singles = row["hybrid"], [row[k]["cost"] for k in ("serverless", "fleet") if row[k] is not None]
        dearer = hybrid is not None and hybrid["cost"] > min(singles)
        assert dearer == any("cheaper single kind" in n for n in trace["verdicts"][target]), where
    check_parts(trace, prices)


def check_parts(trace: dict[str, Any], prices: dict[str, Any]) -> None:
    """Where the dollars go adds up: each cost is the trace's work at the rented price, plus boots, plus idle
    rent, plus serverless's premium over the rented price, none negative (a hundredth's rounding each)."""
    work = trace["runs"][0]["gpu_h_work"] * prices["rented"]
    rows = [r for row in trace["sweep"].values() for r in (row["bound"], row["serverless"]) if r is not None]
    for part in [*trace["hybrid_runs"], *rows]:
        where = f"{trace['name']} / {part['policy']}: {part}"
        assert min(part["boot_usd"], part["idle_usd"], part["premium_usd"]) >= 0, where
        assert abs(part["cost"] - (work + part["boot_usd"] + part["idle_usd"] + part["premium_usd"])) <= 0.05, where
