"""`python -m bench.chaos --webhooks --faults deploy`: the webhook server restarted as a deploy does. A fault choice
of its own; a restart whose SIGTERM did not end the server cleanly fails the run; the end of the fault phase waits
for a restart under way (the server is never left down for the settle phase); and no restart cuts a hostile burst
or trickle short (the limits those test would be judged on a server that forgot them). The run itself is the
CI-sized webhooks run in test_chaos.py, which asserts its restarts landed and ended cleanly."""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path
from typing import Any

import pytest
from support.eventually import eventually

from bench.chaos import hooks, report
from bench.chaos.hooks import Deploys, Server
from bench.chaos.hostile import Hostile
from bench.chaos.loops import FaultLoop
from bench.chaos.options import parse_args, profile_for
from offload.eventloop import within


def test_deploy_is_a_fault_choice_of_its_own() -> None:
    only = profile_for(parse_args(["--quick", "--faults", "deploy"]))
    assert only.server_restart_every > 0 and only.kill_every == 0 and only.hostile_every == 0
    assert profile_for(parse_args(["--quick", "--faults", "kill"])).server_restart_every == 0
    assert profile_for(parse_args(["--quick"])).server_restart_every > 0  # in `all`


def clean_doc(**changes: Any) -> dict[str, Any]:
    keys = ("lost", "stuck", "wrong_results", "finished_twice", "defect_duplicates", "worker_exits_unexplained")
    return {**dict.fromkeys((*keys, "paid_while_evicting", "dead_by_oom"), 0), **changes}


def test_a_restart_the_sigterm_did_not_end_cleanly_fails_the_run(tmp_path: Path) -> None:
    server = Server(tmp_path, {})
    restarts: list[dict[str, Any]] = [
        {"kind": "server_restart", "code": 0, "seconds": 0.4},
        {"kind": "server_restart", "code": -15, "seconds": 1.2},  # uvicorn's SIGTERM raised again: clean
        {"kind": "kill"},
    ]
    clean = hooks.summary([], server, restarts)
    assert clean["server_restarts"] == {"n": 2, "longest_s": 1.2, "bad": 0}
    assert report.passed(clean_doc(webhooks=clean))
    for code in (1, None, "did not start"):  # an error exit; SIGKILLed past the bound; not started again
        bad = hooks.summary([], server, [*restarts, {"kind": "server_restart", "code": code, "seconds": 30.0}])
        assert bad["server_restarts"]["bad"] == 1
        assert not report.passed(clean_doc(webhooks=bad))
    assert report.passed(clean_doc(webhooks=None))  # a run without the server


class SlowServer:
    """Stands in for hooks.Server: a restart that takes as long as the test says."""

    def __init__(self) -> None:
        self.quiet = asyncio.Lock()
        self.began = threading.Event()
        self.go = threading.Event()
        self.restarts = 0

    def restart(self) -> tuple[int | None, float]:
        self.began.set()
        assert self.go.wait(10)
        self.restarts += 1
        return 0, 0.5


class Notes:
    def __init__(self) -> None:
        self.rng = random.Random(1)
        self.timeline: list[dict[str, Any]] = []

    def note(self, kind: str, target: str = "", **detail: Any) -> None:
        self.timeline.append({"kind": kind, "target": target, **detail})


async def test_the_end_of_the_fault_phase_waits_for_a_restart_under_way() -> None:
    server, notes = SlowServer(), Notes()
    deploys = Deploys(notes, server)  # type: ignore[arg-type]
    deploys.start(0.2)
    assert await asyncio.to_thread(server.began.wait, 10)
    stopping = asyncio.create_task(deploys.stop())
    await asyncio.sleep(0.2)  # the fault: the phase ends while the server is down (not a wait for anything)
    assert not stopping.done()  # the server is not left down
    server.go.set()
    await within(stopping, 10)
    assert server.restarts >= 1  # (another may have queued behind the first before the loop ended)
    assert (
        notes.timeline
        == [{"kind": "server_restart", "target": "server", "code": 0, "seconds": 0.5}] * len(notes.timeline)
        and len(notes.timeline) == server.restarts
    )


async def test_no_restart_cuts_a_hostile_action_short() -> None:
    server, notes = SlowServer(), Notes()
    server.go.set()
    attacker = Hostile(notes, "http://127.0.0.1:9", "q", server.quiet)  # type: ignore[arg-type]
    inside, release = asyncio.Event(), asyncio.Event()

    async def burst() -> None:  # a hostile action under way
        inside.set()
        await release.wait()

    acting = asyncio.create_task(attacker._quietly(burst))
    await inside.wait()
    deploys = Deploys(notes, server)  # type: ignore[arg-type]
    deploys.start(0.01)
    await eventually(lambda: bool(deploys._pending), 10, "the restart's turn")
    for _ in range(10):  # its turn came while the burst runs: it waits for the lock, the server untouched
        await asyncio.sleep(0)
    assert not server.began.is_set() and server.quiet.locked()
    release.set()
    await acting
    await eventually(lambda: server.restarts >= 1, 10, "the restart once the burst ended")
    await deploys.stop()


async def test_an_action_that_failed_is_said_not_left_to_the_garbage_collector(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class NoServer(FaultLoop):
        async def act(self) -> None:
            raise RuntimeError("all connection attempts failed")

    loop = NoServer(Notes())  # type: ignore[arg-type]
    loop.start(0.01)
    said = "NoServer: an action failed: RuntimeError: all connection attempts failed"
    await eventually(lambda: said in caplog.text, 10, "the failed action's warning")
    await loop.stop()
    assert not loop._pending
