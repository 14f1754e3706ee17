"""The checks of what was paid for: every extra submission of a job is a wanted retry or an attributed duplicate
(`duplicates`), no resend follows a graceful drain, and a resend after a gateway's 5xx is counted on its job while
no job is dead as expired while the provider still had its run (`unknown_outcomes`)."""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from typing import Any

from bench.chaos.resend_cause import UNAVOIDABLE, duplicate_cause, keyed, polled_to_expiry, recorded_at, retry_reason
from bench.chaos.rundata import Evidence


def duplicates(ev: Evidence) -> dict[str, Any]:
    per_job: dict[str, list[dict[str, Any]]] = defaultdict(list)
    replays: list[dict[str, Any]] = []
    for sub in ev.d.submissions:
        if sub["replay"]:
            replays.append(sub)
            continue
        job_id = ev.by_input.get(sub["input_id"])
        if job_id is not None:
            per_job[job_id].append(sub)
    causes: Counter[str] = Counter()
    retries: Counter[str] = Counter()
    kill_kinds: Counter[str] = Counter()
    for job_id, subs in per_job.items():
        subs.sort(key=lambda s: s["arrival"])
        for prev, sub in itertools.pairwise(subs):
            recorded = recorded_at(ev, job_id, prev, sub) is not None and not ev.d.synchronous
            legit = retry_reason(prev, sub, recorded or polled_to_expiry(ev, job_id, prev))
            if legit:
                retries[legit] += 1
                continue
            cause, how = duplicate_cause(ev, job_id, prev, sub)
            if cause in UNAVOIDABLE:
                cause = keyed(ev, prev, sub, cause)
            causes[cause] += 1
            if how:
                kill_kinds[how] += 1
            if cause not in UNAVOIDABLE:
                ev.find(
                    f"duplicate submission of {job_id}: {cause} (first at {prev['arrival']:.3f} by "
                    f"{ev.name(prev)}, again at {sub['arrival']:.3f} by {ev.name(sub)})"
                )
                ev.kinds["detail:" + cause] += 1
                if ev.kinds["detail:" + cause] <= 5:
                    ev.details.append(
                        {
                            "job": job_id,
                            "cause": cause,
                            "first": prev,
                            "again": sub,
                            "first_by": ev.name(prev),
                            "again_by": ev.name(sub),
                            "events": ev.d.events.get(job_id, []),
                            "record": ev.d.records.get(job_id),
                        }
                    )
    total = sum(causes.values())
    return {
        "duplicate_submissions": total,
        "duplicates_by_cause": dict(causes.most_common()),
        "defect_duplicates": sum(n for c, n in causes.items() if c not in UNAVOIDABLE),
        "duplicates_not_killed_inside_submit": total - causes["killed_inside_submit"],
        "killed_inside_submit_by": dict(kill_kinds),
        "resubmits_after_remote_end": dict(retries),
        "idempotent_replays": len(replays),
        "replays_after_graceful_drain": _drain_replays(ev, per_job, replays),
        "submissions": sum(1 for s in ev.d.submissions if not s["replay"]),
    }


def _drain_replays(ev: Evidence, per_job: dict[str, list[dict[str, Any]]], replays: list[dict[str, Any]]) -> int:
    """Resends the simulator answered from its Idempotency-Key cache (nothing paid) whose earlier submission's
    worker was drained gracefully: a provider that ignores the key would have run them twice, so each is the
    same defect as a paid `drained_gracefully` duplicate."""
    found = 0
    for replay in replays:
        job_id = ev.by_input.get(replay["input_id"])
        earlier = [s for s in per_job.get(job_id or "", []) if s["arrival"] < replay["arrival"]]
        if job_id is None or not earlier:
            continue
        if duplicate_cause(ev, job_id, earlier[-1], replay)[0] == "drained_gracefully":
            found += 1
            ev.find(
                f"resent after a graceful drain: {job_id} (first at {earlier[-1]['arrival']:.3f} by "
                f"{ev.name(earlier[-1])}, replayed at {replay['arrival']:.3f} by {ev.name(replay)})"
            )
    return found


def _submissions_by_job(ev: Evidence) -> dict[str, list[dict[str, Any]]]:
    """Every logged submission (replays too) per job, oldest first."""
    per_job: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for sub in ev.d.submissions:
        if (job_id := ev.by_input.get(sub["input_id"])) is not None:
            per_job[job_id].append(sub)
    for subs in per_job.values():
        subs.sort(key=lambda s: s["arrival"])
    return per_job


def unknown_outcomes(ev: Evidence) -> dict[str, Any]:
    """A submission answered with a gateway's 5xx after the provider created its job has an outcome the worker
    cannot know: each later submission under its Idempotency-Key (a replay where the key is honoured, a second
    paid run elsewhere) must be counted on the job as a possible duplicate, never silent. And a job dead as
    "remote result expired" while the provider still had its last remote job (a status read lagging the
    submit taken for expiry) is a `false_expiry`."""
    per_job = _submissions_by_job(ev)
    resends = uncounted = false_expiries = 0
    for job_id, subs in per_job.items():
        h = ev.d.records.get(job_id)
        if h is None:
            continue
        again = 0  # the submissions under a key after the first of them a gateway answered
        for key in {s.get("idempotency_key") for s in subs if s.get("gateway_error") and s.get("idempotency_key")}:
            same = [s for s in subs if s.get("idempotency_key") == key]
            first = next(i for i, s in enumerate(same) if s.get("gateway_error"))
            again += len(same) - first - 1
        resends += again
        if again > int(h.get("possible_duplicates") or 0):
            uncounted += again - int(h.get("possible_duplicates") or 0)
            ev.find(
                f"uncounted resend: {job_id} sent again {again}x after a gateway 5xx, counted "
                f"{h.get('possible_duplicates') or 0}"
            )
        if h.get("state") == "dead" and "remote result expired" in (h.get("error") or ""):
            died = next((t for t, state in reversed(ev.d.events.get(job_id, [])) if state == "dead"), None)
            paid = [s for s in subs if not s["replay"]]
            expires = paid[-1].get("remote_expires_at") if paid else None
            if died is not None and paid and (expires is None or expires > died):
                false_expiries += 1
                ev.find(f"false expiry: {job_id} dead as expired while remote job {paid[-1]['remote_id']} lived")
    gateway = sum(1 for s in ev.d.submissions if s.get("gateway_error"))
    return {
        "gateway_errors": gateway,
        "gateway_resends": resends,
        "uncounted_resends": uncounted,
        "false_expiries": false_expiries,
    }
