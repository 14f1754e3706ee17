"""The invariant checker: what a run must show, judged from the job store, the simulator's submission log, the
bucket and the record of every fault the harness injected.

- every acknowledged job (its enqueue returned) exists and ends in exactly one terminal state: missing is
  `lost` (with `everysec` AOF, a job acknowledged within the last second before a Valkey crash is counted as
  `everysec_loss`, the documented cost, not as lost), not terminal after quiescence is `stuck`;
- every succeeded job's stored output is its own: the JSON at its output key echoes its input, the remote job it
  names was submitted for that input, and each copied file holds that remote job's bytes (`wrong_results`); for a
  synchronous API (`RunData.synchronous`: a chat completion is the stored output) the answer is the run the ack
  recorded, that run was a submission of this job's input, and every choice's message echoes its request body;
- no job finished twice (two `succeeded` transitions in the events stream);
- every extra submission of one job is attributed: after the previous remote run failed or expired it is a
  retry (not a duplicate); otherwise a duplicate, whose cause is `killed_inside_submit` when the previous
  submission's worker was SIGKILLed or SIGSTOPped while that submit was in flight or before its remote id was
  recorded, and anything else is a defect with a name (see `_cause`): among them `drained_gracefully`, a
  resend after the earlier sender's graceful drain (one SIGTERM), which must hand its jobs back unsent or await
  and record every call out (`drain_cut_inside_submit`, a drain cut by a second SIGTERM, costs what a kill inside
  submit does). Even the unavoidable causes must resend under the previous submission's Idempotency-Key (the
  same run: `resent_under_new_key` otherwise), and where the simulator honours the key (`RunData.honoured`) such
  a resend is a replay, not a second paid run, so a duplicate of that kind is a defect there (`key_not_honoured`);
- a resend of a submission a gateway answered with a 5xx after the provider took it (its outcome unknown to the
  worker) is counted on its job, replayed or paid (`uncounted_resends`); a status read that lags the submit is not
  expiry: no job is dead as "remote result expired" while the provider still had its remote job
  (`false_expiries`);
- the daily cap is exact (the cap window is the store's UTC day: a worker restarted with its clock hours or a day
  off opens no window of its own), held jobs are released, memory and the events stream stay bounded;
- a step back of Valkey's clock is found and its times moved back once per queue (`clock_stepped_back` events: never
  twice for one step, never one that was not made), and nothing waits for the clock to catch up (`stuck`);
- an operator's cancel (the `cancel` fault) stops what it may cost: a job answered `cancelled` ends so, no job is
  submitted after its cancel was answered (`submitted_after_cancel`), and the remote job a cancelled job last
  recorded is not left to run on after the job ended cancelled (`ran_after_cancel`: paid for nothing);
- the job store's memory: at maxmemory (`RunData.full`) no job dies of it and no duplicate comes of it
  (`oom_inside_submit` is a defect: the checkpoint runs at the limit), and while the policy may evict
  (`RunData.evicting`) nothing is submitted once the workers had `store_check_s` (plus a margin) to notice
  (`paid_while_evicting`); no worker exits by itself (one started while the policy is wrong waits paused).
- across a failover (bench/chaos/failover.py, writers with `durability` on) the same holds: no acknowledged job
  lost, none paid for twice. The events the harness read from the old primary after the last one the promoted
  replica had are dropped first: the job store that goes on never had them.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

from bench.chaos import egress, hostile
from bench.chaos.check_outputs import finished_twice, results, terminal
from bench.chaos.check_resends import duplicates, unknown_outcomes
from bench.chaos.check_store import bounds, caps, clock, store_faults
from bench.chaos.rundata import IN_FLIGHT_S, RECORD_GRACE_S, Evidence, RunData, Verdict, decode_input_id

__all__ = ["Checker", "RunData", "Verdict"]


class Checker:
    """Judges one run: `verdict()` runs every check over the run's `Evidence`; `d` is the run as judged (the events
    a failover took back dropped)."""

    def __init__(self, data: RunData) -> None:
        self.ev = Evidence(data)

    @property
    def d(self) -> RunData:
        return self.ev.d

    def verdict(self) -> Verdict:
        ev = self.ev
        summary: dict[str, Any] = {}
        parts = (
            terminal(ev),
            results(ev),
            finished_twice(ev),
            duplicates(ev),
            unknown_outcomes(ev),
            drains(ev),
            caps(ev),
            clock(ev),
            store_faults(ev),
            bounds(ev),
            cancels(ev),
            egress.verdict(ev.d, ev.find),
        )
        for part in parts:
            summary.update(part)
        hostile_part, hostile_findings = hostile.check(ev.d.timeline)  # --faults hostile (bench/chaos/hostile.py)
        summary.update(hostile_part)
        ev.findings += hostile_findings
        return Verdict(summary, ev.findings, ev.details)

    def in_flight(self, slots: Iterable[str], window: tuple[float, float]) -> dict[str, Any]:
        return in_flight(self.ev, slots, window)


def drains(ev: Evidence) -> dict[str, Any]:
    """The graceful restarts: each must end with exit 0 (a drain is no crash), unless the kill fault SIGKILLed
    the draining worker first (then its jobs cost what a kill's do)."""
    drains = [e for e in ev.d.timeline if e["kind"] == "drain"]
    bad = [e for e in drains if e.get("code") != 0 and not e.get("killed")]
    for e in bad:
        ev.find(f"drain: {e['target']}#{e.get('n')} exited {e.get('code')} after {e.get('took_s')} s")
    if not drains:
        return {}
    return {
        "drains": {
            "graceful": sum(1 for e in drains if not e.get("cut")),
            "cut": sum(1 for e in drains if e.get("cut")),
            "handed_back_unsent": sum(e.get("handed_back") or 0 for e in drains),
            "calls_out": sum(e.get("calls_out") or 0 for e in drains),
            "longest_s": max(e.get("took_s") or 0.0 for e in drains),
            "killed_while_draining": sum(1 for e in drains if e.get("killed")),
            "bad_exits": len(bad),
        }
    }


def in_flight(ev: Evidence, slots: Iterable[str], window: tuple[float, float]) -> dict[str, Any]:
    """Remote jobs in flight per worker process, sampled every second of the fault phase, from the
    submission log: sent by a live process of the slot and not yet ended at the provider (a killed process's
    remote jobs stop counting when it dies). A stale lease set cannot inflate this."""
    wanted = set(slots)
    spans: dict[str, tuple[list[float], list[float]]] = {}
    for sub in ev.d.submissions:
        who = ev.who(sub)
        if who is None or who[0] not in wanted or sub["replay"]:
            continue
        starts, ends = spans.setdefault(who[0], ([], []))
        starts.append(sub["arrival"])
        ends.append(min(sub["remote_ended_at"], who[1].ended or float("inf")))
    counts: list[int] = []
    for starts, ends in spans.values():
        starts.sort()
        ends.sort()
        t = window[0]
        while t < window[1]:
            n = bisect.bisect_right(starts, t) - bisect.bisect_right(ends, t)
            if n > 0:
                counts.append(n)
            t += 1.0
    return {"mean": round(sum(counts) / max(len(counts), 1), 1), "peak": max(counts, default=0)}


def cancels(ev: Evidence) -> dict[str, Any]:
    """The operator's cancels (timeline `cancel`): none costs a remote run the store knew of, none is sent on."""
    done = [e for e in ev.d.timeline if e["kind"] == "cancel"]
    if not done:
        return {}
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for sub in ev.d.submissions:
        if not sub["replay"]:
            runs[sub["remote_id"]].append(sub)
    slack = max(RECORD_GRACE_S, IN_FLIGHT_S + 1.0)  # a submit past its begin when the cancel came, in flight
    not_cancelled = after = ran = 0
    for e in done:
        job_id = e["target"]
        h = ev.d.records.get(job_id, {})
        if e["answer"] == "cancelled" and h.get("state") != "cancelled":
            not_cancelled += 1
            ev.find(f"cancel: {job_id} answered cancelled but ended {h.get('state')}")
        input_id = decode_input_id(h.get("input"))
        late = [
            s
            for s in ev.d.submissions
            if s["input_id"] == input_id and not s["replay"] and s["arrival"] > e["t"] + slack
        ]
        if input_id is not None and late:
            after += 1
            ev.find(f"cancel: {job_id} submitted again {late[0]['arrival'] - e['t']:.1f}s after its cancel")
        ended = next((t for t, state in ev.d.events.get(job_id, []) if state == "cancelled"), None)
        if ended is None:
            continue
        for sub in runs.get(h.get("remote_id") or "", []):
            if sub.get("remote_status") not in ("cancelled", "aborted") and sub["remote_ended_at"] > ended + 1.0:
                ran += 1
                ev.find(
                    f"cancel: {job_id} ended cancelled while its remote job {sub['remote_id']} ran on "
                    f"{sub['remote_ended_at'] - ended:.1f}s to {sub.get('remote_status')} (answered {e['answer']})"
                )
    answers = Counter(f"{e.get('was')}:{e['answer']}" for e in done)
    return {
        "cancels": dict(answers),
        "cancel_not_honoured": not_cancelled,
        "submitted_after_cancel": after,
        "ran_after_cancel": ran,
    }


def count_kinds(timeline: Iterable[dict[str, Any]]) -> Counter[str]:
    return Counter(e["kind"] for e in timeline)
