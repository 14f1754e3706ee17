"""`python -m bench.cost --small` runs end to end and its report holds together: every job served, utilisation
in (0, 1], no policy renting fewer GPU-hours than the clairvoyant bound at its own peak wait, sums that agree."""

from __future__ import annotations

import json
from pathlib import Path

from test_bench_smoke import BOUND, last_json


def test_cost_bench_small(tmp_path: Path) -> None:
    doc = last_json(["-m", "bench.cost", "--small", "--plots", "--out", str(tmp_path)], timeout=BOUND)
    assert {**json.loads((tmp_path / "cost.json").read_text()), "plots": doc["plots"]} == doc
    assert all((tmp_path / name).stat().st_size > 0 for name in doc["plots"]) and len(doc["plots"]) == 4
    page = (tmp_path / "cost.md").read_text()
    assert page.count("The same arrivals on healthy hosts") == 1  # under the faulty trace only
    assert {t["name"] for t in doc["traces"]} == {"burst-day", "diurnal", "night-spike", "faulty-week"}
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
        for n, bound in trace["bounds"].items():
            assert 0 < bound["utilisation"] <= 1 and bound["machines"] <= int(n), (trace["name"], bound)
            assert bound["gpu_h_rented"] >= bound["gpu_h_work"], (trace["name"], bound)
