"""The checks of the store's limits: the daily cap is exact and held jobs are released (`caps`), the store's memory
faults cost nothing (`store_faults`), a step back of its clock is moved once per queue and a worker whose clock the
result storage refuses pays for nothing (`clock`), and memory and the events stream stay bounded (`bounds`)."""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

from bench.chaos.rundata import NOTICE_MARGIN_S, OOM_TEXT, STEP_UNSEEN_S, TERMINAL, Evidence
from offload.storage.s3 import MAX_SKEW_S


def caps(ev: Evidence) -> dict[str, Any]:
    if ev.d.capped_queue is None or ev.d.daily_job_cap is None:
        return {}
    capped = {j for j, (q, _, _) in ev.d.acked.items() if q == ev.d.capped_queue}
    inputs = {ev.d.acked[j][1] for j in capped}
    rolls = ev.d.cap_rolls or ([ev.d.cap_rolled_at] if ev.d.cap_rolled_at else [])
    bounds = [float("-inf"), *rolls, float("inf")]
    days = [  # the capped jobs submitted in each of the store's days (a job once per day, as the cap counts)
        {s["input_id"] for s in ev.d.submissions if s["input_id"] in inputs and lo <= s["arrival"] < hi}
        for lo, hi in itertools.pairwise(bounds)
    ]
    cap = ev.d.daily_job_cap
    input_of = {j: ev.d.acked[j][1] for j in capped}
    counted = {input_of[j] for j in ev.d.counted_day1 if j in input_of}
    # jobs whose first-day call was still to come when that day ended (a retry after refused calls): counted
    # there, and again in the day they are sent
    unsent = {input_of[j] for j in ev.d.unsent_day1 if j in input_of} - days[0]
    uncounted = days[0] - counted if ev.d.counted_day1 else set()
    # the first day fills the cap but for those; no day passes it (a later one: jobs released, runs expired at
    # the provider); every run of the first day was counted in it
    filled = len(days[0]) + len(unsent) == min(cap, len(capped))
    exact = filled and not uncounted and all(len(day) <= cap for day in days)
    released = all(ev.d.records.get(j, {}).get("state") in TERMINAL for j in capped)
    if not exact:
        idle = sorted(counted - days[0] - unsent)  # counted, yet neither run that day nor still to run
        ev.find(
            f"cap: {[len(day) for day in days]} jobs of queue {ev.d.capped_queue} submitted in its days under "
            f"a daily cap of {cap} ({len(unsent)} still to send at the first day's end; run uncounted: "
            f"{sorted(uncounted)[:5]}; counted without a run: {idle[:5]})"
        )
    if not released:
        ev.find("held: capped jobs still not terminal after the cap window rolled over")
    return {
        "cap": {
            "daily_job_cap": cap,
            "jobs": len(capped),
            "submitted_day1": len(days[0]),
            "submitted_later": [len(day) for day in days[1:]],
            "held_at_roll": ev.d.held_at_roll,
            "unsent_at_day_end": len(unsent),
            "exact": exact,
        },
        "held_released": released,
    }


def store_faults(ev: Evidence) -> dict[str, Any]:
    """The store's memory faults: deaths of the limit, payments while the policy could evict, worker exits."""
    dead_oom = [j for j, h in ev.d.records.items() if h.get("state") == "dead" and OOM_TEXT in h.get("error", "")]
    for job_id in dead_oom[:5]:
        ev.find(f"dead of the store's limit: {job_id}: {ev.d.records[job_id].get('error', '')[:120]}")
    judged = [(b + ev.d.store_check_s + NOTICE_MARGIN_S, e) for b, e in ev.d.evicting]
    paid = [s for s in ev.d.submissions if not s["replay"] and any(lo <= s["arrival"] <= hi for lo, hi in judged)]
    for sub in paid[:5]:
        ev.find(f"paid while evicting: {sub['input_id']} submitted at {sub['arrival']:.3f} by {ev.name(sub)}")
    # (a worker started while the policy may evict waits paused like a running one: no exit is explained)
    exits = [e for e in ev.d.timeline if e["kind"] == "worker_exit"]
    for e in exits[:3]:
        ev.find(f"worker exit: {e['target']}#{e.get('n')} code {e.get('code')}: {str(e.get('tail'))[-160:]}")
    return {
        "oom_spells": len(ev.d.full),
        "eviction_spells": len(ev.d.evicting),
        "dead_by_oom": len(dead_oom),
        "paid_while_evicting": len(paid),
        "worker_exits_unexplained": len(exits),
    }


def clock(ev: Evidence) -> dict[str, Any]:
    """Every `clock_stepped_back` a queue recorded is a step back the harness made, each step moved once at
    most per queue. A queue sees a step less the time nobody read the clock before it (a worker restarting:
    up to STEP_UNSEEN_S), never more; one nobody read while the clock was forward again between two steps back
    sees the second from the first's clock. A step may go unrecorded in a queue nobody read until the clock was
    forward again (nothing there was scheduled on the stepped clock by then): counted, not a finding."""
    steps = [e for e in ev.d.timeline if e["kind"] == "valkey_clock"]
    skews = [e for e in ev.d.timeline if e["kind"] == "worker_clock"]
    if not steps and not skews and not ev.d.clock_events:
        return {}
    back = [e for e in steps if e["step_s"] < -1]
    # what a queue may see of each step back: from the clock it last read, the one in force at any time before
    # (a queue nobody read while the clock was forward again sees the step from the clock before that)
    seen = [{lvl - e["offset_s"] for lvl in [0.0, *(s["offset_s"] for s in steps if s["t"] < e["t"])]} for e in back]
    found: dict[str, int] = Counter()
    used: set[tuple[str, int]] = set()
    for queue, _, ms in ev.d.clock_events:
        found[queue] += 1
        sizes = [i for i in range(len(back)) if any(s - STEP_UNSEEN_S <= ms / 1000 <= s + 2 for s in seen[i])]
        fresh = [i for i in sizes if (queue, i) not in used]
        if fresh:
            used.add((queue, fresh[0]))
        elif sizes:
            ev.find(f"clock: queue {queue} moved its times back twice for one step of {ms} ms")
        else:
            ev.find(f"clock: queue {queue} moved its times back {ms} ms for a step the harness never made")
    paid = skewed_payments(ev)
    return {
        "clock": {
            "valkey_steps_back": len(back),
            "valkey_steps_forward": sum(e["step_s"] > 0 for e in steps),
            "steps_back_recorded": dict(found),
            "worker_skews_s": sorted(e["skew_s"] for e in skews),
            "paid_by_refused_clocks": paid,
        }
    }


def skewed_payments(ev: Evidence) -> int:
    """A worker whose clock is further off than S3 takes (the worker-clock fault's skews) sends nothing: its start's
    probe is refused before it claims (offload/worker/storage_gate.py), so every output it paid for would be
    refused. Submissions by such a process are named."""
    paid = 0
    for sub in ev.d.submissions:
        who = ev.who(sub)
        if who is not None and abs(who[1].clock_skew_s) > MAX_SKEW_S:
            paid += 1
            if paid <= 5:
                off = f"{who[1].clock_skew_s / 3600:+.0f} h off"
                ev.find(f"clock: {ev.name(sub)}, {off}, paid for {sub['input_id']} (the storage refuses it)")
    return paid


def bounds(ev: Evidence) -> dict[str, Any]:
    s = ev.d.samples
    jobs = max(len(ev.d.records), 1)
    peak = s.get("used_memory_peak", 0)
    memory_ok = peak <= 64 * 2**20 + 16 * 1024 * jobs
    events_ok = s.get("events_len_max", 0) <= 2 * 10_000 + 1000 and s.get("event_ids_max", 0) <= 20_000
    if not memory_ok:
        ev.find(f"memory: Valkey used_memory peaked at {peak / 2**20:.1f} MiB for {jobs} job records")
    if not events_ok:
        ev.find(f"events: stream length {s.get('events_len_max')} / {s.get('event_ids_max')} ids in one entry")
    return {
        "memory_mb": {"peak": round(peak / 2**20, 1), "final": round(s.get("used_memory", 0) / 2**20, 1)},
        "memory_bounded": memory_ok,
        "events_bounded": events_ok,
        "events": {"max_len": s.get("events_len_max", 0), "max_ids_per_entry": s.get("event_ids_max", 0)},
    }
