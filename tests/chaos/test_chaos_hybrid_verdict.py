"""`python -m bench.chaos --hybrid` does not report success for a run in which one kind of capacity ran nothing,
a kind of kill never landed, any job was lost, stuck, dead, wrong, paid twice or run by both kinds, or a graceful
stop of the server did not exit 0 within its bound."""

from __future__ import annotations

from typing import Any

import pytest

from bench.chaos.hybrid import verdict


def clean(**changes: Any) -> dict[str, Any]:
    result: dict[str, Any] = {
        "on_fleet": 52,
        "on_api": 259,
        "kills": {"machine": 7, "overflow_worker": 5, "server": 4, "server_sigterm": 3},
        "server_stops": {"n": 3, "longest_s": 3.4, "bad": 0},
        **dict.fromkeys(("lost", "stuck", "dead", "wrong", "paid_twice", "run_by_both"), 0),
    }
    return {**result, **changes}


@pytest.mark.parametrize("broken", ["lost", "stuck", "dead", "wrong", "paid_twice", "run_by_both"])
def test_any_broken_job_fails_the_run(broken: str) -> None:
    assert verdict(clean())
    assert not verdict(clean(**{broken: 1}))


def test_a_run_where_a_kind_or_a_kill_did_not_happen_fails() -> None:
    assert not verdict(clean(on_api=0))  # overflow never ran: the scenario did not happen
    assert not verdict(clean(on_fleet=0))
    assert not verdict(clean(kills={"machine": 7, "overflow_worker": 5, "server": 4}))


def test_a_graceful_stop_of_the_server_that_did_not_end_fails_the_run() -> None:
    assert not verdict(clean(server_stops={"n": 3, "longest_s": 30.0, "bad": 1}))
