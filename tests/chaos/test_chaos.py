"""The fault harness (`python -m bench.chaos`): its checker must be able to fail, and the CI-sized run must pass.

The checker is first fed a small hand-made run in which every invariant is broken once (a lost job, a stuck one,
a result stored for the wrong input, duplicates with each kind of cause) and must name each. Then the CI-sized
run (`--quick`: three workers SIGKILLed every ~3 s and restarted with the same host:pid, SIGSTOPs past the lease,
two Valkey crashes with AOF always, dropped replies, resets, black-holes, 5xx and 429 storms, lost and slow
submits, a gateway's 5xx after accepted submits, a status that lags the submit, graceful SIGTERM restarts with
jobs at the submit gate and the rate limit (some cut by a second SIGTERM), expiring results, a capped queue rolled
over to the next day) must show zero lost, stuck and wrong results, no uncounted resend and no false expiry, and no
duplicate whose cause is not "killed inside submit" (nor a resend after a graceful drain), with every kind of fault
really injected; also against a synchronous API (`--backend openai`), where the answer is the result and nothing
is polled.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import orjson
import pytest
import redis

from bench.chaos.checker import Checker, RunData
from bench.chaos.eventlog import EventLog
from bench.chaos.faults import cancel_all
from bench.chaos.operator import Operator
from bench.chaos.procs import Incarnation
from bench.chaos.proxy import DroppedReply
from offload.eventloop import within
from offload.queue.store import QueueStore

BUCKET = "b"
SIM = "http://127.0.0.1:9/_sim/files"


def _record(input_id: str, state: str = "succeeded", **extra: str) -> dict[str, str]:
    job_input = json.dumps({"id": input_id})
    return {"state": state, "input": job_input, **extra}


def _sub(input_id: str, remote: str, at: float, port: int, **extra: Any) -> dict[str, Any]:
    return {
        "input_id": input_id,
        "remote_id": remote,
        "arrival": at,
        "responded": at + 0.05,
        "port": port,
        "worker": None,
        "replay": False,
        "lost_response": False,
        "remote_status": "running",
        "remote_ended_at": at + 30,
        "remote_expires_at": at + 60,
        **extra,
    }


def _output(input_id: str, remote: str, job_id: str) -> bytes:
    location = f"s3://{BUCKET}/results/{job_id}/files/0-{remote}-0.png"
    return orjson.dumps(
        {"echo": {"id": input_id}, "files": [location], "_offload_files": {f"{SIM}/{remote}-0.png": location}}
    )


def test_the_checker_names_every_broken_invariant(tmp_path: Path) -> None:
    from offload.testing.sim.files import file_bytes

    w1a = Incarnation(1, 101, tmp_path / "w1-1.log", started=0.0, ended=10.1, end="kill")
    w1b = Incarnation(2, 102, tmp_path / "w1-2.log", started=11.0)
    w2 = Incarnation(1, 201, tmp_path / "w2-1.log", started=0.0)
    w3 = Incarnation(1, 301, tmp_path / "w3-1.log", started=0.0, ended=30.0, end="kill")
    w4 = Incarnation(1, 401, tmp_path / "w4-1.log", started=0.0, stops=[[40.0, 48.0]])
    ok_file = file_bytes("r-ok-0.png", "png", 1024)
    records = {
        "q:stuck": _record("i-stuck", "active", owner="host:1"),
        "q:foreign": _record("i-foreign", result=f"s3://{BUCKET}/results/q:foreign.json"),
        "q:ok": _record("i-ok", result=f"s3://{BUCKET}/results/q:ok.json"),
        "q:mixed": _record("i-mixed", result=f"s3://{BUCKET}/results/q:mixed.json"),
        "q:same": _record("i-same", "dead"),
        "q:killed": _record("i-killed", "dead"),
        "q:recorded": _record("i-recorded", "dead"),
        "q:retried": _record("i-retried", "dead"),
        "q:late": _record("i-late", "dead"),
        "q:stale": _record("i-stale", "dead"),
        "q:hole": _record("i-hole", "dead"),
        "q:rewritten": {"state": "succeeded", "input": '{"id": "i-rw", "big": 12345678901234568, "tags": {}}'},
    }
    subs = [
        _sub("i-ok", "r-ok", 1.0, 1),
        _sub("i-mixed", "r-mixed", 1.0, 1),
        _sub("i-foreign", "r-foreign", 1.0, 1),
        _sub("i-same", "r1", 2.0, 2),
        _sub("i-same", "r2", 9.0, 2),  # one worker submitting its own job twice
        _sub("i-killed", "r3", 10.0, 1),
        _sub("i-killed", "r4", 14.0, 2),  # w1 killed 0.1 s into the submit
        _sub("i-recorded", "r5", 20.0, 3),
        _sub("i-recorded", "r6", 35.0, 2),  # id recorded at 21, killed at 30
        _sub("i-late", "r9", 22.0, 3),
        _sub("i-late", "r10", 33.0, 2),  # w3 killed 8 s after the answer, unrecorded
        _sub("i-stale", "r11", 45.0, 2),
        _sub("i-stale", "r12", 48.2, 4),  # w4 sends after SIGCONT, lease gone
        _sub("i-hole", "r13", 50.5, 2),
        _sub("i-hole", "r14", 56.0, 1),  # a black-hole from 50 s: w2's lease expired at 53 before any record
        _sub("i-retried", "r7", 3.0, 2, remote_status="failed", remote_ended_at=4.0),
        _sub("i-retried", "r8", 6.0, 2),  # after a failed remote run: a retry, not a duplicate
    ]
    data = RunData(
        acked={j: ("q", json.loads(h["input"])["id"], 0.5) for j, h in records.items()} | {"q:lost": ("q", "i", 0.5)},
        records=records,
        submissions=subs,
        outputs={
            "results/q:ok.json": _output("i-ok", "r-ok", "q:ok"),
            "results/q:foreign.json": _output("i-ok", "r-ok", "q:foreign"),
            "results/q:mixed.json": _output("i-mixed", "r-mixed", "q:mixed"),
        },
        files={"results/q:ok/files/0-r-ok-0.png": ok_file, "results/q:mixed/files/0-r-mixed-0.png": ok_file},
        lives={"w1": [w1a, w1b], "w2": [w2], "w3": [w3], "w4": [w4]},
        slot_ports={1: "w1", 2: "w2", 3: "w3", 4: "w4"},
        timeline=[{"t": 50.0, "kind": "blackhole", "target": "proxy", "seconds": 3.0}],
        valkey_down=[],
        appendfsync="always",
        events={
            "q:recorded": [(21.0, "submitted")],
            "q:killed": [(14.2, "submitted")],
            "q:stale": [(44.0, "queued"), (44.5, "active"), (45.3, "submitted")],
            "q:hole": [(53.0, "queued"), (55.8, "active")],
        },
        dropped=[DroppedReply(5.0, "EVALSHA claim", ["q:other"], "c")],
        bucket=BUCKET,
        sent={"q:ok": {"id": "i-ok"}, "q:rewritten": {"id": "i-rw", "big": 12345678901234567, "tags": []}},
    )
    verdict = Checker(data).verdict()
    s = verdict.summary
    assert (s["lost"], s["stuck"], s["wrong_results"]) == (1, 1, 3), verdict.findings
    assert s["wrong_by_kind"] == {"foreign": 1, "file mixed": 1, "input_rewritten": 1}
    assert s["inputs_rewritten"] == 1
    assert s["duplicates_by_cause"] == {
        "same_worker_resubmitted": 1,
        "killed_inside_submit": 1,
        "resubmitted_after_recorded_id": 1,
        "remote_id_not_recorded": 1,
        "stale_submit_after_stop": 1,
        "partition_inside_submit": 1,
    }
    assert s["defect_duplicates"] == 4 and s["resubmits_after_remote_end"] == {"after_remote_failure": 1}
    assert any("stuck: q:stuck state=active owner=host:1" in f for f in verdict.findings)


def test_the_checker_names_what_the_stores_memory_faults_break(tmp_path: Path) -> None:
    """The `oom` and `eviction` fault classes' invariants: a job dead of the store's limit, a duplicate whose id
    should have been recorded while the store was full (the checkpoint runs at the limit: never excused), a
    submission that reached the provider after the workers had time to notice an evicting policy, and a worker
    that exited by itself are each named, also one that exited at its start on the policy (it must wait paused)."""
    w1 = Incarnation(1, 101, tmp_path / "w1-1.log", started=0.0)
    w2 = Incarnation(1, 201, tmp_path / "w2-1.log", started=0.0)
    records = {
        "q:oomdead": _record(
            "i-oomdead", "dead", error="worker error: command not allowed when used memory > 'maxmemory'"
        ),
        "q:oomdup": _record("i-oomdup", "dead"),
        "q:paid": _record("i-paid", "dead"),
        "q:early": _record("i-early", "dead"),
    }
    subs = [
        _sub("i-oomdup", "r1", 10.0, 1),
        _sub("i-oomdup", "r2", 20.0, 2),  # w1 alive, its id never recorded while the store was full (9-14 s)
        _sub("i-early", "r3", 30.5, 1),  # 0.5 s into the evicting spell: before anyone could notice
        _sub("i-paid", "r4", 36.0, 2),  # 6 s into it: paid while evicting
    ]
    exits = [
        {"t": 33.0, "kind": "worker_exit", "target": "w3", "n": 2, "code": 1, "tail": "error: maxmemory-policy is x"},
        {"t": 50.0, "kind": "worker_exit", "target": "w3", "n": 3, "code": 1, "tail": "Traceback ... OutOfMemory"},
    ]
    data = RunData(
        acked={j: ("q", json.loads(h["input"])["id"], 0.5) for j, h in records.items()},
        records=records,
        submissions=subs,
        outputs={},
        files={},
        lives={"w1": [w1], "w2": [w2]},
        slot_ports={1: "w1", 2: "w2"},
        timeline=exits,
        valkey_down=[],
        appendfsync="always",
        events={},
        dropped=[],
        bucket=BUCKET,
        full=[(9.0, 14.0)],
        evicting=[(30.0, 40.0)],
        store_check_s=1.0,
    )
    verdict = Checker(data).verdict()
    s = verdict.summary
    assert (s["dead_by_oom"], s["paid_while_evicting"]) == (1, 1), verdict.findings
    assert s["worker_exits_unexplained"] == 2  # a worker started while the policy may evict waits: no exit is due
    assert s["duplicates_by_cause"] == {"oom_inside_submit": 1} and s["defect_duplicates"] == 1
    assert (s["oom_spells"], s["eviction_spells"]) == (1, 1)


def test_the_checker_blames_a_graceful_drain_for_a_resend_and_counts_a_cut_one_as_its_cost(tmp_path: Path) -> None:
    """The drain fault: a job sent again after its worker's graceful drain (one SIGTERM) is a defect, paid or
    answered from the Idempotency-Key cache; after a drain cut by a second SIGTERM it is that cut's documented
    cost, like a kill inside submit. A drain that ends in anything but exit 0 is a finding."""
    w1a = Incarnation(1, 101, tmp_path / "w1-1.log", started=0.0, ended=12.5, end="drain", drained=10.0)
    w1b = Incarnation(2, 102, tmp_path / "w1-2.log", started=13.0)
    w2a = Incarnation(1, 201, tmp_path / "w2-1.log", started=0.0, ended=20.7, end="drain_cut", drained=20.0, cut=20.5)
    w3 = Incarnation(1, 301, tmp_path / "w3-1.log", started=0.0)
    records = {f"q:{name}": _record(f"i-{name}") for name in ("drained", "cut", "handed", "replayed")}
    subs = [
        _sub("i-drained", "r1", 9.0, 1),
        _sub("i-drained", "r2", 15.0, 3),  # w1 drained gracefully at 10 with the call out: resent
        _sub("i-cut", "r3", 19.0, 2),
        _sub("i-cut", "r4", 25.0, 3),  # w2's drain cut at 20.5 with the call out
        _sub("i-handed", "r5", 12.0, 3),  # handed back unsent by w1: one submission, no duplicate
        _sub("i-replayed", "r6", 9.5, 1),
        _sub("i-replayed", "r6", 14.0, 3, replay=True),  # resent after w1's graceful drain, answered from the key
    ]
    drains = [
        {"t": 12.5, "kind": "drain", "target": "w1", "n": 1, "cut": False, "code": 0, "took_s": 2.5},
        {"t": 20.7, "kind": "drain", "target": "w2", "n": 1, "cut": True, "code": 1, "took_s": 0.7},
    ]
    data = RunData(
        acked={j: ("q", json.loads(h["input"])["id"], 0.5) for j, h in records.items()},
        records=records,
        submissions=subs,
        outputs={},
        files={},
        lives={"w1": [w1a, w1b], "w2": [w2a], "w3": [w3]},
        slot_ports={1: "w1", 2: "w2", 3: "w3"},
        timeline=drains,
        valkey_down=[],
        appendfsync="always",
        events={},
        dropped=[],
        bucket=BUCKET,
    )
    verdict = Checker(data).verdict()
    s = verdict.summary
    assert s["duplicates_by_cause"] == {"drained_gracefully": 1, "drain_cut_inside_submit": 1}
    assert s["defect_duplicates"] == 1 and s["replays_after_graceful_drain"] == 1
    assert s["drains"] == {
        "graceful": 1,
        "cut": 1,
        "handed_back_unsent": 0,
        "calls_out": 0,
        "longest_s": 2.5,
        "killed_while_draining": 0,
        "bad_exits": 1,
    }
    assert any("drain: w2#1 exited 1" in f for f in verdict.findings), verdict.findings
    assert any("drained_gracefully" in f for f in verdict.findings), verdict.findings


@pytest.mark.parametrize("evidence", ["error", "event"])
def test_the_checker_takes_an_attached_id_polled_to_its_expiry_for_a_retry(tmp_path: Path, evidence: str) -> None:
    """A worker SIGSTOPped inside its submit call reports the answer after SIGCONT: checkpoint.lua ATTACHES it to
    the job with an `attached` event (stores before it had none: then the job's error naming the id is the
    evidence). The next owner polls it, finds it expired and runs the job again: a retry after the remote run's
    expiry, not a duplicate of a kill inside submit resent under a new key. ("event": the job expired again
    later, so its last error names another id, as in a 10-minute run that reported this retry as a duplicate.)"""
    w1 = Incarnation(1, 101, tmp_path / "w1-1.log", started=0.0, stops=[[10.5, 19.0]])
    w2 = Incarnation(1, 201, tmp_path / "w2-1.log", started=0.0)
    named = "r-first" if evidence == "error" else "r-later"
    expired = f"remote result expired: http-job backend 'sim': GET http://sim/jobs/{named}: HTTP 404"
    records = {"q:attached": _record("i-attached", error=expired, sub_n="2")}
    subs = [
        _sub("i-attached", "r-first", 10.0, 1, idempotency_key="q:attached.1", remote_expires_at=23.0),
        _sub("i-attached", "r-second", 40.0, 2, idempotency_key="q:attached.2"),
    ]
    data = RunData(
        acked={"q:attached": ("q", "i-attached", 0.5)},
        records=records,
        submissions=subs,
        outputs={},
        files={},
        lives={"w1": [w1], "w2": [w2]},
        slot_ports={1: "w1", 2: "w2"},
        timeline=[],
        valkey_down=[],
        appendfsync="always",
        events={"q:attached": [(13.0, "queued"), (19.5, "active"), (38.0, "retrying"), (39.0, "active")]},
        dropped=[],
        bucket=BUCKET,
        honoured=True,
    )
    if evidence == "event":
        data.events["q:attached"].insert(2, (19.2, "attached"))
    s = Checker(data).verdict().summary
    assert s["duplicates_by_cause"] == {} and s["resubmits_after_remote_end"] == {"after_remote_expiry": 1}, s


def _chat(input_id: str) -> dict[str, Any]:
    """A chat-completions request as the harness sends it to a synchronous (`openai`) backend."""
    return {"model": "m", "messages": [{"role": "user", "content": input_id}], "metadata": {"id": input_id}}


def _answer(remote: str, body: dict[str, Any]) -> bytes:
    """The simulator's chat completion for `body` (its JSON echo in the message), as the worker stores it."""
    content = orjson.dumps({"echo": body, "files": [f"{SIM}/{remote}-0.png"]}).decode()
    message = {"role": "assistant", "content": content}
    return orjson.dumps({"id": remote, "object": "chat.completion", "choices": [{"index": 0, "message": message}]})


def test_the_checker_judges_a_synchronous_run_strictly(tmp_path: Path) -> None:
    """With a synchronous backend the stored chat completion must be the run the ack recorded, submitted for
    this job's input, echoing its own request; a resend after a kill inside the call is unavoidable only under
    the same Idempotency-Key and only where the key is ignored; the ack records the run, so a resubmit after
    `succeeded` is a defect (a synchronous result's expiry at the provider excuses nothing); and a job may
    succeed once."""
    w1a = Incarnation(1, 101, tmp_path / "w1-1.log", started=0.0, ended=12.0, end="kill")
    w1b = Incarnation(2, 102, tmp_path / "w1-2.log", started=13.0)
    w2 = Incarnation(1, 201, tmp_path / "w2-1.log", started=0.0)
    w3 = Incarnation(1, 301, tmp_path / "w3-1.log", started=0.0, ended=32.0, end="kill")

    def done(input_id: str, job_id: str, remote: str) -> dict[str, str]:
        result = f"s3://{BUCKET}/results/{job_id}.json"
        return {"state": "succeeded", "input": json.dumps(_chat(input_id)), "result": result, "remote_id": remote}

    records = {
        "q:ok": done("i-ok", "q:ok", "c-ok"),
        "q:swapped": done("i-swapped", "q:swapped", "c-sw"),
        "q:foreign": done("i-foreign", "q:foreign", "c-f"),
        "q:killed": {"state": "dead", "input": json.dumps(_chat("i-killed"))},
        "q:newkey": {"state": "dead", "input": json.dumps(_chat("i-newkey"))},
        "q:after": {"state": "dead", "input": json.dumps(_chat("i-after"))},
    }
    subs = [
        _sub("i-ok", "c-ok", 1.0, 2, idempotency_key="q:ok.1"),
        _sub("i-swapped", "c-sw", 1.0, 2),
        _sub("i-swapped", "c-sw2", 1.0, 2, replay=True),  # a run of its input, but not the one the ack recorded
        _sub("i-foreign", "c-f", 1.0, 2),
        # w1 killed at 12 inside its 5 s call; w2 resends under the same key: unavoidable where it is ignored
        _sub("i-killed", "c-k1", 10.0, 1, responded=15.0, idempotency_key="q:killed.1"),
        _sub("i-killed", "c-k2", 14.0, 2, responded=19.0, idempotency_key="q:killed.1"),
        # w3 killed at 32 inside the call; w2 resends it as a new run
        _sub("i-newkey", "c-n1", 30.0, 3, responded=35.0, idempotency_key="q:newkey.1"),
        _sub("i-newkey", "c-n2", 34.0, 2, responded=39.0, idempotency_key="q:newkey.2"),
        # answered at 45, acked at 45.5, the provider forgot it at 48; sent again at 50
        _sub("i-after", "c-a1", 40.0, 2, responded=45.0, remote_expires_at=48.0, idempotency_key="q:after.1"),
        _sub("i-after", "c-a2", 50.0, 1, responded=55.0, idempotency_key="q:after.2"),
    ]
    data = RunData(
        acked={j: ("q", json.loads(h["input"])["metadata"]["id"], 0.5) for j, h in records.items()},
        records=records,
        submissions=subs,
        outputs={
            "results/q:ok.json": _answer("c-ok", _chat("i-ok")),
            "results/q:swapped.json": _answer("c-sw2", _chat("i-swapped")),  # not the run the ack recorded
            "results/q:foreign.json": _answer("c-f", _chat("i-ok")),  # echoes another job's request
        },
        files={},
        lives={"w1": [w1a, w1b], "w2": [w2], "w3": [w3]},
        slot_ports={1: "w1", 2: "w2", 3: "w3"},
        timeline=[],
        valkey_down=[],
        appendfsync="always",
        events={"q:ok": [(1.5, "succeeded"), (9.0, "succeeded")], "q:after": [(45.5, "succeeded")]},
        dropped=[],
        bucket=BUCKET,
        synchronous=True,
    )
    verdict = Checker(data).verdict()
    s = verdict.summary
    assert (s["lost"], s["stuck"], s["wrong_results"], s["finished_twice"]) == (0, 0, 2, 1), verdict.findings
    assert s["wrong_by_kind"] == {"foreign run": 1, "foreign": 1}, verdict.findings
    assert s["duplicates_by_cause"] == {
        "killed_inside_submit": 1,
        "resent_under_new_key": 1,
        "resubmitted_after_recorded_id": 1,
    }
    assert s["defect_duplicates"] == 2 and s["idempotent_replays"] == 1
    data.honoured = True  # the same resend is a paid second run although the provider honours the key
    s = Checker(data).verdict().summary
    assert s["duplicates_by_cause"]["key_not_honoured"] == 1 and s["defect_duplicates"] == 3


def test_the_checker_finds_uncounted_resends_after_a_gateway_error_and_false_expiries(tmp_path: Path) -> None:
    """A gateway answered a submission's 5xx after the provider took it: each later submission under its key (a
    replay, or a second paid run where the key is ignored) must be counted on its job; and a job dead as "remote
    result expired" while the provider still had its remote job (a lagging status read) is a false expiry."""
    w1 = Incarnation(1, 101, tmp_path / "w1-1.log", started=0.0)
    records = {
        "q:counted": _record("i-counted", possible_duplicates="1"),
        "q:silent": _record("i-silent"),
        "q:paid": _record("i-paid", possible_duplicates="1"),
        "q:lagged": _record("i-lagged", "dead", error="remote result expired: GET /jobs/r7: HTTP 404"),
        "q:expired": _record("i-expired", "dead", error="remote result expired: GET /jobs/r8: HTTP 404"),
    }
    subs = [
        _sub("i-counted", "r1", 1.0, 1, gateway_error=True, idempotency_key="q:counted.1"),
        _sub("i-counted", "r1", 3.0, 1, replay=True, idempotency_key="q:counted.1"),
        _sub("i-silent", "r2", 1.0, 1, gateway_error=True, idempotency_key="q:silent.1"),
        _sub("i-silent", "r2", 3.0, 1, replay=True, idempotency_key="q:silent.1"),  # resent, counted nowhere
        _sub("i-paid", "r3", 1.0, 1, gateway_error=True, idempotency_key="q:paid.1"),
        _sub("i-paid", "r4", 3.0, 1, idempotency_key="q:paid.1"),  # the key ignored: a second run, counted
        _sub("i-lagged", "r7", 1.0, 1, remote_expires_at=100.0),
        _sub("i-expired", "r8", 1.0, 1, remote_expires_at=5.0),
    ]
    data = RunData(
        acked={j: ("q", json.loads(h["input"])["id"], 0.5) for j, h in records.items()},
        records=records, submissions=subs, outputs={}, files={}, lives={"w1": [w1]}, slot_ports={1: "w1"},
        timeline=[], valkey_down=[], appendfsync="always",
        events={"q:lagged": [(1.5, "dead")], "q:expired": [(9.0, "dead")]}, dropped=[], bucket=BUCKET,
    )  # fmt: skip
    verdict = Checker(data).verdict()
    s = verdict.summary
    assert (s["gateway_errors"], s["gateway_resends"], s["uncounted_resends"]) == (3, 3, 1), verdict.findings
    assert s["false_expiries"] == 1, verdict.findings
    assert s["duplicates_by_cause"] == {"gateway_error": 1} and s["defect_duplicates"] == 0
    assert any("uncounted resend: q:silent" in f for f in verdict.findings), verdict.findings
    assert any("false expiry: q:lagged" in f for f in verdict.findings), verdict.findings
    data.honoured = True  # where the key is honoured, the second paid run is a defect
    assert Checker(data).verdict().summary["duplicates_by_cause"] == {"key_not_honoured": 1}


def test_the_checker_judges_every_day_of_the_capped_queue_against_its_cap(tmp_path: Path) -> None:
    """Daily cap 2, four capped jobs: the first day submits two, the second the two released ones plus a re-run of
    a first-day job whose result expired at the provider (three: held back is the one that waits for the third day,
    the harness rolls again), which runs there. Each day at most the cap, the first exactly: exact. One more
    submission on the second day is named."""
    records = {f"c:{n}": _record(f"cap-{n}") for n in range(4)}
    subs = [
        _sub("cap-0", "r0", 1.0, 1),
        _sub("cap-1", "r1", 2.0, 1),
        _sub("cap-2", "r2", 11.0, 1),  # the store's second day from 10
        _sub("cap-0", "r0b", 12.0, 1),  # its first run expired unpolled: run again, counted in this day
        _sub("cap-3", "r3", 21.0, 1),  # the third day from 20
    ]
    data = RunData(
        acked={j: ("c", json.loads(h["input"])["id"], 0.5) for j, h in records.items()},
        records=records, submissions=subs, outputs={}, files={}, lives={}, slot_ports={}, timeline=[],
        valkey_down=[], appendfsync="always", events={}, dropped=[], bucket=BUCKET, capped_queue="c",
        daily_job_cap=2, cap_rolled_at=10.0, cap_rolls=[10.0, 20.0],
    )  # fmt: skip
    s = Checker(data).verdict().summary
    assert s["cap"]["exact"] and s["held_released"], s["cap"]
    assert (s["cap"]["submitted_day1"], s["cap"]["submitted_later"]) == (2, [2, 1])
    data.submissions.append(_sub("cap-3", "r3x", 13.0, 1))  # a third job in the second day
    verdict = Checker(data).verdict()
    assert not verdict.summary["cap"]["exact"]
    assert any("[2, 3, 1] jobs of queue c" in f for f in verdict.findings), verdict.findings


def test_the_checker_excuses_only_a_first_day_call_still_to_come_at_the_days_end(tmp_path: Path) -> None:
    """Daily cap 2, three capped jobs. The first day runs one; the other it counted was still to send its call when
    the day ended (refused calls, their retry due after the roll): counted there and sent in the second day with
    the held one, exact. Counted without a run and not still to come (a place lost), or run without being counted,
    is named."""
    records = {f"c:{n}": _record(f"cap-{n}") for n in range(3)}
    subs = [_sub("cap-0", "r0", 1.0, 1), _sub("cap-1", "r1", 11.0, 1), _sub("cap-2", "r2", 12.0, 1)]
    data = RunData(
        acked={j: ("c", json.loads(h["input"])["id"], 0.5) for j, h in records.items()},
        records=records, submissions=subs, outputs={}, files={}, lives={}, slot_ports={}, timeline=[],
        valkey_down=[], appendfsync="always", events={}, dropped=[], bucket=BUCKET, capped_queue="c",
        daily_job_cap=2, cap_rolled_at=10.0, cap_rolls=[10.0], counted_day1=["c:0", "c:1"], unsent_day1=["c:1"],
    )  # fmt: skip
    s = Checker(data).verdict().summary
    assert s["cap"]["exact"] and s["cap"]["unsent_at_day_end"] == 1, s["cap"]
    data.unsent_day1 = []  # c:1 counted, yet neither run that day nor still to run: its place was lost
    verdict = Checker(data).verdict()
    assert not verdict.summary["cap"]["exact"]
    assert any("counted without a run: ['cap-1']" in f for f in verdict.findings), verdict.findings
    data.unsent_day1, data.counted_day1 = ["c:1"], ["c:1"]  # cap-0 ran uncounted
    verdict = Checker(data).verdict()
    assert not verdict.summary["cap"]["exact"]
    assert any("run uncounted: ['cap-0']" in f for f in verdict.findings), verdict.findings


def test_an_event_whose_stream_id_a_clock_step_held_is_dated_when_read() -> None:
    """After Valkey's clock steps back (here 600 s at t = 1100), new stream ids are held at the last one (ms 1,100,000)
    until the clock catches up: such an event, read 1.4 s after the step, happened then, not at the step (dated
    there, a remote id recorded after a submission at 1100.5 seemed recorded before it, and a legitimate retry
    after the result's expiry was reported as a duplicate). An id ahead of the store's clock as read with it is
    one of those. An event from before any step is dated by its id."""
    from types import SimpleNamespace

    from bench.chaos.run import Run

    run: Any = SimpleNamespace(clock=SimpleNamespace(history=[(1000.0, 0.0), (1100.0, -600.0)]))
    read_at = 1101.4
    store_ms = round((read_at - 600) * 1000)
    assert Run._event_time(run, 1_100_000, read_at, store_ms) == read_at
    assert Run._event_time(run, round((1101.2 - 600) * 1000), read_at, store_ms) == pytest.approx(1101.2)
    run.clock.history = [(1000.0, 0.0)]
    assert Run._event_time(run, 1_050_000, 1050.1, 1_050_100) == 1050.0


def _newest_worker_logs(out: Path, lines: int = 12) -> str:
    """The last lines of each worker slot's newest log: why the workers alive at the end claimed nothing (the run's
    directory is gone by the time anyone reads a CI failure)."""
    newest: dict[str, tuple[int, Path]] = {}
    for log in out.glob("w[0-9]-[0-9]*.log"):
        slot, _, n = log.stem.partition("-")
        if n.isdigit() and int(n) >= newest.get(slot, (-1, log))[0]:
            newest[slot] = (int(n), log)
    tails = [
        f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
        for _, log in sorted(newest.values(), key=lambda nl: nl[1].name)
    ]
    return "\n" + "\n".join(tails)


def _chaos(tmp_path: Path, *args: str) -> tuple[dict[str, Any], str]:
    """A `--quick` run with `args`: (its JSON verdict, the human summary for failure messages), after checking
    that every kind of fault was really injected and that every guarantee common to all runs held."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.chaos", "--quick", *args, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=Path(__file__).parents[2],
    )
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("{"), proc.stderr[-3000:]  # the harness itself failed: its traceback
    doc = json.loads(lines[-1])
    summary = "\n".join(lines[:-1])[-4000:]
    # a failed verdict exits 1, with the summary saying why
    assert proc.returncode == (0 if doc["passed"] else 1), proc.stderr[-3000:]
    # the faults were really injected
    assert doc["kills"] >= 5 and doc["stops"] >= 1 and doc["valkey_restarts"] >= 1, doc
    assert doc["dropped_replies"] >= 5 and doc["resets"] >= 1 and doc["blackholes"] >= 1, doc
    faults = doc["sim_faults"]
    assert sum(faults.get(c, 0) for c in ("500", "502", "503")) > 0, faults
    # A storm was set on the simulator, and some 429 answered (a storm's 3 s may see no call on a loaded run with
    # webhooks, where the workers poll rarely: the injected per-call 429s still exercise the throttled path).
    assert doc["storms_429"] >= 1 and sum(faults.get(c, 0) for c in ("storm_429", "429", "429_bare")) > 0, faults
    assert sum(faults.get(f"gateway_{c}", 0) for c in (502, 504, 524)) > 0, faults
    # (with webhooks the first poll comes long after the lag: the result arrives by webhook)
    assert faults.get("status_lag", 0) > 0 or doc["webhooks"], faults
    # 15 jobs/s for 34 s, less the batches an outage refused (one after an outage catches up: up to 500 jobs)
    assert doc["jobs"] >= 200, doc
    drains = doc["drains"]
    assert drains["graceful"] >= 1 and drains["handed_back_unsent"] + drains["calls_out"] > 0, drains
    # ... and every guarantee held
    assert doc["lost"] == 0, summary
    assert doc["stuck"] == 0, summary + _newest_worker_logs(tmp_path)
    assert doc["wrong_results"] == 0, summary
    assert doc["cap"]["exact"] and doc["held_released"], summary
    assert doc["memory_bounded"] and doc["events_bounded"], summary
    assert doc["all_terminal_s"] is not None, summary
    assert doc["uncounted_resends"] == 0 and doc["false_expiries"] == 0, summary
    assert doc["replays_after_graceful_drain"] == 0 and not doc["drains"]["bad_exits"], summary
    assert doc["worker_exits_unexplained"] == 0 and doc["passed"], summary
    return doc, summary


@pytest.mark.xdist_group("chaos")
@pytest.mark.timeout(420)
def test_ci_sized_chaos_run_keeps_every_guarantee(tmp_path: Path) -> None:
    """About a minute and a half on two loaded cores. The harness bounds its own waits; a stuck job is reported."""
    doc, summary = _chaos(tmp_path, "--seed", "11")
    others = {c: n for c, n in doc["duplicates_by_cause"].items() if c != "killed_inside_submit"}
    assert others == {}, summary
    # An operator cancels every ~2 s among the other faults (the cancel-only profile, `--faults cancel,kill,stop`,
    # is the soak for it): every cancel honoured, nothing sent or run after one.
    assert sum(doc["cancels"].values()) >= 5, doc["cancels"]
    assert doc["cancel_not_honoured"] == doc["submitted_after_cancel"] == doc["ran_after_cancel"] == 0, summary


@pytest.mark.xdist_group("chaos")
@pytest.mark.timeout(420)
def test_ci_sized_chaos_run_with_webhooks_closes_the_double_pay_window(tmp_path: Path) -> None:
    """The same faults against a Replicate that ignores the Idempotency-Key, with `offload server` receiving
    its webhooks (some dropped, duplicated, delayed, reordered): the `start` event names the remote id of a
    submission whose worker was killed inside the call, so kills cost well under half a duplicate each (without
    webhooks, about 2.5 in the 10-minute run) and no duplicate has any other cause than the unavoidable ones. The
    server is restarted as a deploy does (`deploy`), each stop ending cleanly."""
    doc, summary = _chaos(tmp_path, "--seed", "12", "--webhooks", "--backend", "replicate", "--ignore-idempotency-key")
    hooks = doc["webhooks"]
    assert hooks["start"]["sent"] >= doc["jobs"] and hooks["completed"]["sent"] >= doc["jobs"], hooks
    faulted = sum(hooks[e].get(f, 0) for e in ("start", "completed") for f in ("dropped", "duplicated", "reordered"))
    assert faulted >= 3 and hooks["server_alive_at_end"], hooks
    assert hooks["server_restarts"]["n"] >= 1 and hooks["server_restarts"]["bad"] == 0, hooks  # the deploy fault
    assert doc["defect_duplicates"] == 0, summary
    assert doc["duplicates_per_kill"] < 0.5, summary


def test_the_checker_counts_an_everysec_loss_apart_from_a_real_loss(tmp_path: Path) -> None:
    """With AOF everysec a job acknowledged just before a Valkey crash may be gone: the documented cost, reported
    as everysec_loss; one acknowledged long before the crash is lost all the same."""
    data = RunData(
        acked={"q:recent": ("q", "i-1", 99.6), "q:old": ("q", "i-2", 50.0)},
        records={}, submissions=[], outputs={}, files={}, lives={}, slot_ports={}, timeline=[],
        valkey_down=[(100.0, 101.0)], appendfsync="everysec", events={}, dropped=[], bucket=BUCKET,
    )  # fmt: skip
    s = Checker(data).verdict().summary
    assert (s["lost"], s["everysec_loss"]) == (1, 1)
    data.appendfsync = "always"
    assert Checker(data).verdict().summary["lost"] == 2


async def test_the_operators_resume_outlives_the_end_of_the_fault_phase() -> None:
    """Found by a CI run: the operator pauses the queue to catch a handed-back job; its resume was refused (the
    store away) and the fault phase's end cancelled the operator's loop while it waited to retry, so the queue
    stayed paused and 204 jobs were stuck for the harness's doing. The resume now runs on past the cancel, and
    `settle` waits for it."""

    class Ops:
        paused, resumes = False, 0
        tried = asyncio.Event()

        async def pause(self, queue: str) -> None:
            self.paused = True

        async def resume(self, queue: str) -> None:
            self.resumes += 1
            self.tried.set()
            if self.resumes == 1:
                raise redis.ConnectionError("the store is away")
            self.paused = False

    class Direct:
        async def zrange(self, key: str, start: int, end: int) -> list[str]:
            raise redis.ConnectionError("the store is away")  # ends the pause window: the resume comes next

    class Always(random.Random):
        def random(self) -> float:
            return 0.0  # the operator pauses first

    ops = Ops()
    operator = Operator(cast(QueueStore, ops), Direct(), Always(), lease_ms=3000)
    task = asyncio.create_task(operator.cancel_one([{"kind": "kill", "t": time.time()}]))
    await within(ops.tried.wait(), 10)  # the first resume was refused: it waits to retry
    task.cancel()  # the fault phase ends
    await asyncio.gather(task, return_exceptions=True)
    await within(operator.settle(), 10)
    assert (ops.paused, ops.resumes) == (False, 2)


def test_a_failover_takes_back_exactly_the_events_its_replica_never_had() -> None:
    """The events reader logs what each stream entry added; a failover takes back every entry past the promoted
    replica's last one of that stream, and only those: what it had, other streams, and what is read from the new
    primary afterwards stay. The checker then judges the events as kept: a job completed on the old primary
    (not acknowledged: `durability`) and again on the new one finished once."""
    log = EventLog()
    events: dict[str, list[tuple[float, str]]] = {"q:a": [], "q:b": [], "other:c": []}
    steps: list[tuple[str, float, int]] = []
    q, other = "offload:{q}:events", "offload:{other}:events"
    log.add(q, "5000-0", events["q:a"], (5.0, "active"))
    log.add(q, "9500-0", events["q:b"], (9.5, "submitted"))
    log.add(q, "10000-0", events["q:b"], (10.0, "succeeded"))
    log.add(other, "12000-0", events["other:c"], (12.0, "succeeded"))
    log.add(q, "12000-0", events["q:a"], (12.0, "succeeded"))
    log.add(q, "12000-1", steps, ("q", 12.0, 600_000))
    assert log.take_back(q, "10000-0") == 2 and log.take_back(other, "15000-0") == 0
    log.add(q, "7000-0", events["q:a"], (21.0, "succeeded"))  # the new primary's ids may be below the old's
    assert log.take_back(q, "10000-0") == 0  # a second failover on the same kept id takes nothing more
    assert events == {
        "q:a": [(5.0, "active"), (21.0, "succeeded")],
        "q:b": [(9.5, "submitted"), (10.0, "succeeded")],
        "other:c": [(12.0, "succeeded")],
    }
    assert steps == []
    data = RunData(
        acked={}, records={}, submissions=[], outputs={}, files={}, lives={}, slot_ports={}, timeline=[],
        valkey_down=[], appendfsync="always", events=events, dropped=[], bucket=BUCKET,
    )  # fmt: skip
    assert Checker(data).verdict().summary["finished_twice"] == 0  # q:a's first completion was taken back
    data.events = events | {"q:a": [(5.0, "active"), (12.0, "succeeded"), (21.0, "succeeded")]}
    assert Checker(data).verdict().summary["finished_twice"] == 1  # as read, before the take-back


def test_a_replica_left_behind_by_a_stepped_clock_loses_what_came_after_its_last_entry() -> None:
    """The run that found it: Valkey restarted, then its clock stepped back 394 s; the primary delays a replica's
    full resync by its diskless-sync delay on the wall clock, so the replica stayed at the restart's state for 22 s
    until the failover. Stream ids were held at the step (ms 723,780, sequence growing) all that time, so every
    entry read meanwhile is past the replica's last one (ms 723,084) and taken back, however long before the
    cut it was written; the failover's cut (742 s) is no bound."""
    log, succeeded = EventLog(), list[tuple[float, str]]()
    stream = "offload:{capped}:events"
    log.add(stream, "723084-3", succeeded, (723.08, "submitted"))
    for seq, t in enumerate((724.9, 725.4, 741.0, 742.9)):
        log.add(stream, f"723780-{seq}", succeeded, (t, "succeeded"))
    assert log.take_back(stream, "723084-3") == 4
    assert succeeded == [(723.08, "submitted")]
    assert log.take_back("offload:{chaos}:events", "0-0") == 0  # a stream never read: nothing to take back
    empty = EventLog()
    kept_none: list[tuple[float, str]] = []
    empty.add(stream, "1-0", kept_none, (1.0, "queued"))
    assert empty.take_back(stream, "0-0") == 1 and kept_none == []  # a replica that had none of the stream


def test_the_checker_names_a_payment_by_a_worker_whose_clock_the_storage_refuses(tmp_path: Path) -> None:
    """The worker-clock fault's skews are past what S3 takes: such a process must send nothing (its start's probe
    is refused before it claims). One a day ahead that sent a job is named; one 10 minutes off (S3 takes it) and
    the slot's next process, on the true clock, are not."""
    ahead = Incarnation(1, 101, tmp_path / "w1-1.log", started=0.0, ended=20.0, end="term", clock_skew_s=86400)
    true = Incarnation(2, 102, tmp_path / "w1-2.log", started=21.0)
    near = Incarnation(1, 201, tmp_path / "w2-1.log", started=0.0, clock_skew_s=-600)
    records = {f"q:{i}": _record(i) for i in ("i-ahead", "i-true", "i-near")}
    data = RunData(
        acked={}, records=records,
        submissions=[_sub("i-ahead", "r1", 5.0, 1), _sub("i-true", "r2", 25.0, 1), _sub("i-near", "r3", 5.0, 2)],
        outputs={}, files={}, lives={"w1": [ahead, true], "w2": [near]}, slot_ports={1: "w1", 2: "w2"},
        timeline=[{"t": 0.0, "kind": "worker_clock", "target": "w1", "n": 1, "skew_s": 86400}],
        valkey_down=[], appendfsync="always", events={}, dropped=[], bucket=BUCKET,
    )  # fmt: skip
    verdict = Checker(data).verdict()
    assert verdict.summary["clock"]["paid_by_refused_clocks"] == 1
    named = [f for f in verdict.findings if f.startswith("clock:")]
    assert named == ["clock: w1#1, +24 h off, paid for i-ahead (the storage refuses it)"], verdict.findings


def test_the_checker_names_a_clock_step_moved_twice_or_never_made() -> None:
    """Two steps back of Valkey's clock (and one forward): a queue that recorded each once passes, and so does one
    nobody read while the clock was forward (it sees the second step from the first one's clock: 900 s); one that
    moved its times back twice for one step, or for a step of a size the harness never made, is named."""
    timeline = [
        {"t": 10.0, "kind": "valkey_clock", "target": "valkey", "step_s": -600.0, "offset_s": -600.0},
        {"t": 20.0, "kind": "valkey_clock", "target": "valkey", "step_s": 600.0, "offset_s": 0.0},
        {"t": 30.0, "kind": "valkey_clock", "target": "valkey", "step_s": -1500.0, "offset_s": -1500.0},
        {"t": 35.0, "kind": "worker_clock", "target": "c1", "n": 2, "skew_s": 86400},
    ]
    data = RunData(
        acked={}, records={}, submissions=[], outputs={}, files={}, lives={}, slot_ports={}, timeline=timeline,
        valkey_down=[], appendfsync="always", events={}, dropped=[], bucket=BUCKET,
        clock_events=[("good", 10.5, 600_400), ("good", 30.2, 1_499_800), ("unread", 10.5, 600_000),
                      ("unread", 31.0, 878_000)],
    )  # fmt: skip
    verdict = Checker(data).verdict()
    assert verdict.findings == [], verdict.findings
    assert verdict.summary["clock"] == {
        "valkey_steps_back": 2,
        "valkey_steps_forward": 1,
        "steps_back_recorded": {"good": 2, "unread": 2},
        "worker_skews_s": [86400],
        "paid_by_refused_clocks": 0,
    }
    data.clock_events += [("twice", 10.5, 600_000), ("twice", 11.0, 600_000), ("invented", 12.0, 45_000)]
    findings = Checker(data).verdict().findings
    assert any("queue twice moved its times back twice" in f for f in findings), findings
    assert any("queue invented moved its times back 45000 ms for a step the harness never made" in f for f in findings)
    assert len(findings) == 2, findings


async def test_the_fault_loops_stop_even_when_one_swallowed_its_cancel() -> None:
    """A fault action that swallows the stop's cancel (Python 3.11's `asyncio.wait_for` does when its call ends
    as the cancel comes) left its loop sleeping, and the run waited on it for good: `cancel_all` cancels it again
    until it ends."""
    swallowed: list[bool] = []

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if not swallowed:
                    swallowed.append(True)
                    continue
                raise

    async def plain() -> None:
        await asyncio.sleep(3600)

    tasks = [asyncio.create_task(stubborn()), asyncio.create_task(plain())]
    await asyncio.sleep(0)
    await within(cancel_all(tasks), 10)
    assert swallowed and all(t.done() for t in tasks)
