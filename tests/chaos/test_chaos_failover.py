"""The fault harness's replica (bench/chaos/failover.py) under its own faults: a Valkey restart and a step back of
the store's clock, on real Valkey processes under libfaketime."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.eventually import eventually

from bench.chaos.failover import Failover, _link_status
from bench.chaos.faketime import ClockFile
from bench.chaos.procs import Valkey


@pytest.mark.timeout(120)
async def test_a_replica_resyncs_with_a_restarted_primary_whose_clock_then_steps_back(tmp_path: Path) -> None:
    """The primary restarts (its replica asks for a full sync) and its clock steps back an hour while the sync is
    due: the replica is in sync again within seconds. Valkey waits 5 s by default before a diskless sync, timed on
    the wall clock, and a restart dropped the harness's CONFIG SET of 0: a step back inside the wait held the sync
    (and every write that waits for the replica) an hour, and a chaos run ended on its operator's NOREPLICAS."""
    clock = ClockFile(tmp_path / "clock")
    primary = Valkey(tmp_path / "primary", "always", clock).start()
    failover = await Failover(tmp_path, primary, [], []).start()
    try:
        primary.restart()

        def asked() -> bool:  # the replica is back and asking for its sync
            with primary.client() as c:
                return int(c.info("replication").get("connected_slaves", 0)) >= 1

        await eventually(asked, 30, "the replica asking the restarted primary for a sync")
        clock.step(-3600)
        await eventually(lambda: _link_status(failover.replica) == "up", 15, "the replica in sync again")
    finally:
        await failover.close()
