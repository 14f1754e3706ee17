"""The stored form of one evaluation's `Decision`: the keys `offload autoscale status`, the API and the dashboard
read, in the order an evaluation sets them (`held` where it was first set), with enums stored as their strings."""

from __future__ import annotations

import orjson

from offload.autoscale.drain import DrainReason
from offload.autoscale.evaluation import Choice, Decision, ScaleDownOutcome


def _decision() -> Decision:
    return Decision(
        at=10.0, enabled=True, active=1, billed=2, draining=1, pending=3, in_flight=0, live_workers=0, reasons=["r"]
    )


def test_held_before_the_count_stays_before_it() -> None:
    d = _decision()
    d.hold("spend cap")  # the spend cap holds before the count is set
    d.desired, d.floor = 0, 0
    d.hold("a machine is booting")  # a later hold replaces the words, not the place
    d.scale_down = ScaleDownOutcome(reason=DrainReason.SPEND_CAP, floor=0, draining=1, spared={})
    assert list(d.to_dict()) == [
        *("at", "enabled", "active", "billed", "draining", "pending", "in_flight", "live_workers", "reasons"),
        *("held", "desired", "floor", "scale_down"),
    ]
    assert d.to_dict()["held"] == "a machine is booting"
    assert b'"scale_down":{"reason":"spend cap","floor":0,"draining":1,"spared":{}}' in orjson.dumps(d.to_dict())


def test_held_while_renting_follows_the_provider_choice() -> None:
    d = _decision()
    d.desired, d.floor, d.undrained = 2, 0, 1
    d.provider = Choice(why="no provider can rent now")
    d.rented.append("a")
    d.hold("cap reached")
    assert list(d.to_dict())[9:] == ["desired", "floor", "undrained", "provider", "rented", "held"]
    assert d.to_dict()["provider"] == {"order": [], "skipped": {}, "quotes": {}, "why": "no provider can rent now"}


def test_nothing_set_means_no_key() -> None:
    d = _decision()
    d.desired = 1
    assert "held" not in d.to_dict() and "undrained" not in d.to_dict() and "rented" not in d.to_dict()
