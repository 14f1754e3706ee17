"""`python -m bench.chaos --faults hostile`: a fault choice of its own, and a checker that names each broken
invariant (a valid key refused after a burst of bad keys, a burst never limited, a trickled body not cut).
The run itself: `python -m bench.chaos --quick --faults hostile --webhooks --backend replicate`."""

from __future__ import annotations

from typing import Any

from bench.chaos import hostile
from bench.chaos.options import parse_args, profile_for


def test_hostile_is_a_fault_choice_of_its_own() -> None:
    only = profile_for(parse_args(["--quick", "--faults", "hostile"]))
    assert only.hostile_every > 0 and only.kill_every == 0 and only.cancel_every == 0
    assert profile_for(parse_args(["--quick", "--faults", "kill"])).hostile_every == 0


def test_the_checker_names_each_broken_hostile_invariant() -> None:
    held: list[dict[str, Any]] = [
        {"kind": "hostile_guess", "bad": {"401": 20, "429": 10}, "valid": {"200": 30}},
        {"kind": "hostile_loris", "status": 408, "seconds": 3.1},
    ]
    summary, findings = hostile.check(held)
    assert findings == [] and summary["valid_key_refused"] == summary["loris_not_cut"] == 0, summary
    broken: list[dict[str, Any]] = [
        {"kind": "hostile_guess", "bad": {"401": 20, "429": 10}, "valid": {"429": 28, "200": 2}},  # the lockout
        {"kind": "hostile_guess", "bad": {"401": 30}, "valid": {"200": 30}, "decided": True},  # no limit at all
        # slowed past the window (a loaded machine, a store fault): nothing proven either way
        {"kind": "hostile_guess", "bad": {"401": 28, "503": 2}, "valid": {"200": 30}, "decided": False},
        {"kind": "hostile_loris", "status": None, "seconds": 18.0},  # never answered
        {"kind": "hostile_loris", "status": 201, "seconds": 2.0},  # a trickled body taken
    ]
    summary, findings = hostile.check(broken)
    assert summary["valid_key_refused"] == 28 and summary["bad_keys_not_limited"] == 1, summary
    assert summary["loris_not_cut"] == 2 and len(findings) == 3, findings
    assert summary["hostile"]["undecided"] == 1, summary
    assert hostile.check([{"kind": "kill"}]) == ({}, [])  # a run without the fault: nothing to judge
