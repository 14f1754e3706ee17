"""`python -m bench.history_cost --small` runs both queues through the same work on one Valkey and its report holds
together: the history was written only for the queue that has it on, a bucket per simulated minute (and the hours
and the day), its memory is positive and a small part of what the jobs themselves took, and both CPU figures are
there with their ratio."""

from __future__ import annotations

from test_bench_smoke import last_json

SMALL_BOUND = 240  # a deadline on a loaded machine; the run takes about 10 s


def test_history_cost_small() -> None:
    doc = last_json(["-m", "bench.history_cost", "--small"], timeout=SMALL_BOUND)
    assert doc["jobs_per_queue"] == 2000 and doc["simulated_minutes"] == 240
    on, off = doc["succeeded"]["hist-on"], doc["succeeded"]["hist-off"]
    assert on == off and 1800 < on <= 2000, doc["succeeded"]  # the same work on both queues
    assert doc["history_keys"] == {"m": 240, "h": 4, "d": 1}, doc["history_keys"]
    kept = doc["history_bytes"]
    assert all(kept[r] > 0 for r in ("m", "h", "d")) and kept["m"] > kept["h"] > kept["d"], kept
    # a day of minutes: 6 times the 4 hours simulated; the steady state adds 2 days of minutes, 15 of hours...
    assert doc["history_bytes_per_queue_day"] == round(sum(kept.values()) * 6)
    assert doc["history_bytes_per_queue_day"] < doc["history_bytes_steady_state_per_queue"] < 10 * 1024 * 1024
    mem = doc["used_memory_delta_per_1000_jobs"]
    assert 0 < doc["history_bytes_per_1000_jobs"] < mem["on"], doc  # the history is part of what the run added
    cpu = doc["valkey_cpu_ms_per_1000_jobs"]
    assert cpu["on"] > 0 and cpu["off"] > 0, cpu
    assert abs(doc["cpu_ratio_on_off"] - cpu["on"] / cpu["off"]) < 0.01, doc
