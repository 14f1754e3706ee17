"""`python -m bench.chaos --autoscale` starts (its admin key passes the server's strength rule) and does not
report success for a run in which nothing was rented."""

from __future__ import annotations

from typing import Any

from bench.chaos.autoscale import admin_key, verdict
from offload.access.api_keys import check_admin_key


def clean(**changes: Any) -> dict[str, Any]:
    result: dict[str, Any] = {
        "server_kills_mid_rental": 2,
        "rental_calls": 4,
        "machines_alive": 3,
        "max_workers": 3,
        "leaked": [],
        "doubled": [],
        "over_max": 0,
        "left_after_teardown": 0,
    }
    return {**result, **changes}


def test_the_harness_admin_key_is_one_the_server_accepts() -> None:
    key = admin_key()
    assert check_admin_key(key) == key


def test_a_run_that_rented_nothing_fails() -> None:
    assert verdict(clean())
    assert not verdict(clean(rental_calls=0, server_kills_mid_rental=0, machines_alive=0))
    assert not verdict(clean(server_kills_mid_rental=0))  # no kill landed in a rental: the scenario did not happen
    assert not verdict(clean(machines_alive=1))  # the fleet never reached its size
    assert not verdict(clean(leaked=["m1"]))
