"""The fault harness's `cancel` fault: its checker must name a cancel that cost a remote run or let a job be sent
again. The CI-sized run of every fault (tests/chaos/test_chaos.py, seed 11) cancels among the others and must show
none; `python -m bench.chaos --quick --faults cancel,kill,stop` is the cancel-heavy run."""

from __future__ import annotations

import json
from typing import Any

from bench.chaos.checker import Checker, RunData
from bench.chaos.options import parse_args, profile_for

BUCKET = "b"


def _sub(input_id: str, remote: str, at: float, status: str, ended: float) -> dict[str, Any]:
    return {
        "input_id": input_id,
        "remote_id": remote,
        "arrival": at,
        "responded": at + 0.05,
        "port": 1,
        "worker": None,
        "replay": False,
        "lost_response": False,
        "remote_status": status,
        "remote_ended_at": ended,
        "remote_expires_at": ended + 60,
    }


def _job(input_id: str, state: str, remote: str | None = None) -> dict[str, str]:
    record = {"state": state, "input": json.dumps({"id": input_id})}
    return record | ({"remote_id": remote} if remote else {})


def test_the_checker_names_each_cancel_that_cost_something() -> None:
    """`drained`: answered cancelled while its remote job ran on to success (the defect this fault was added
    for); `resent`: a new submission 20 s after its cancel; `ignored`: answered cancelled, ended succeeded;
    `clean`: its remote job cancelled before the job ended cancelled."""
    records = {
        "q:drained": _job("i-drained", "cancelled", "r-d"),
        "q:resent": _job("i-resent", "cancelled", "r-r1"),
        "q:ignored": _job("i-ignored", "succeeded", "r-i"),
        "q:clean": _job("i-clean", "cancelled", "r-c"),
    }
    data = RunData(
        acked={j: ("q", json.loads(h["input"])["id"], 0.5) for j, h in records.items()},
        records=records,
        submissions=[
            _sub("i-drained", "r-d", 1.0, "succeeded", 30.0),
            _sub("i-resent", "r-r1", 1.0, "cancelled", 10.5),
            _sub("i-resent", "r-r2", 30.0, "succeeded", 40.0),
            _sub("i-ignored", "r-i", 1.0, "succeeded", 12.0),
            _sub("i-clean", "r-c", 1.0, "cancelled", 10.4),
        ],
        outputs={},
        files={},
        lives={},
        slot_ports={},
        timeline=[
            {"t": 10.0, "kind": "cancel", "target": "q:drained", "answer": "cancelled", "was": "waiting_with_remote"},
            {"t": 10.0, "kind": "cancel", "target": "q:resent", "answer": "requested", "was": "running"},
            {"t": 10.0, "kind": "cancel", "target": "q:ignored", "answer": "cancelled", "was": "waiting"},
            {"t": 10.0, "kind": "cancel", "target": "q:clean", "answer": "requested", "was": "waiting_with_remote"},
        ],
        valkey_down=[],
        appendfsync="always",
        events={
            "q:drained": [(10.0, "cancelled")],
            "q:resent": [(10.6, "cancelled")],
            "q:clean": [(10.5, "cancelled")],
            "q:ignored": [(12.1, "succeeded")],
        },
        dropped=[],
        bucket=BUCKET,
    )
    verdict = Checker(data).verdict()
    s = verdict.summary
    assert (s["cancel_not_honoured"], s["submitted_after_cancel"], s["ran_after_cancel"]) == (1, 1, 1), verdict.findings
    assert s["cancels"] == {"waiting_with_remote:cancelled": 1, "running:requested": 1, "waiting:cancelled": 1,
                            "waiting_with_remote:requested": 1}  # fmt: skip
    assert any("q:drained ended cancelled while its remote job r-d ran on" in f for f in verdict.findings)


def test_cancel_is_a_fault_choice_of_its_own() -> None:
    only = profile_for(parse_args(["--quick", "--faults", "cancel"]))
    assert only.cancel_every > 0 and only.kill_every == 0 and only.valkey_every == 0
    assert profile_for(parse_args(["--quick", "--faults", "kill"])).cancel_every == 0
