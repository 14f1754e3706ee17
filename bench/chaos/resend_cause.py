"""Why a job was submitted again: a retry that was wanted (`retry_reason`: the previous remote run failed, was
cancelled or expired), or a duplicate and its cause (`duplicate_cause`): only the unavoidable ones (`UNAVOIDABLE`)
are the window the design cannot close without a provider that honours Idempotency-Key; every other is a defect."""

from __future__ import annotations

from typing import Any

from bench.chaos.procs import Incarnation
from bench.chaos.rundata import (
    EVERYSEC_S,
    IN_FLIGHT_S,
    OUTAGE_GRACE_S,
    RECORD_GRACE_S,
    RECORDED,
    RECORDED_SYNC,
    Evidence,
)

# The window no worker can close against an API without idempotency keys: the provider accepted a submission
# whose id the job store never learnt, because the worker was killed or stopped (the design's stated window),
# cut off from Valkey, or never got the answer. With a provider honouring Idempotency-Key all of them must be 0.
UNAVOIDABLE = {
    "killed_inside_submit",
    "partition_inside_submit",
    "valkey_crash_inside_submit",
    "response_lost",
    "gateway_error",
    "drain_cut_inside_submit",
}


def polled_to_expiry(ev: Evidence, job_id: str, prev: dict[str, Any]) -> bool:
    """Whether the job's last error is `prev`'s remote run found expired: a worker polled that id, so the job
    store knew it, although no recording event says so (checkpoint.lua's ATTACHED, a stale worker's answer after a
    SIGSTOP inside the call, wrote no event before it wrote `attached`)."""
    error = ev.d.records.get(job_id, {}).get("error") or ""
    return error.startswith("remote result expired") and str(prev.get("remote_id")) in error


def duplicate_cause(ev: Evidence, job_id: str, prev: dict[str, Any], sub: dict[str, Any]) -> tuple[str, str | None]:
    """Why `sub` was sent although `prev` had not failed or expired, and for killed_inside_submit how (`stop` or
    `kill`). Only killed_inside_submit is the window the design cannot close (without a provider that honours
    Idempotency-Key)."""
    t0, t1 = prev["arrival"], sub["arrival"]
    if prev.get("lost_response"):
        return "response_lost", None  # the provider accepted it; its answer never reached the worker
    if prev.get("gateway_error"):
        return "gateway_error", None  # the provider accepted it; a gateway's 5xx page reached the worker instead
    who, again = ev.who(prev), ev.who(sub)
    if who is None:
        return "unattributed", None
    life = who[1]
    recorded = recorded_at(ev, job_id, prev, sub)
    if _stale(ev, job_id, life, t0) or (again is not None and _stale(ev, job_id, again[1], t1)):
        return "stale_submit_after_stop", None  # sent after SIGCONT although its lease had moved on
    if again is not None and again[1] is life:
        return "same_worker_resubmitted", None  # a worker submitted its own job twice (stall, re-claim)
    frozen = _frozen_cause(ev, job_id, prev, sub, life, recorded)
    if frozen is not None:
        return frozen
    return _unfrozen_cause(ev, job_id, prev, sub, life, recorded), None


def _frozen_cause(
    ev: Evidence, job_id: str, prev: dict[str, Any], sub: dict[str, Any], life: Incarnation, recorded: float | None
) -> tuple[str, str | None] | None:
    """The cause when the earlier sender was frozen (its first SIGSTOP or its SIGKILL, whichever came first)
    before the job left that worker; None when it was not (a lease lost earlier, e.g. in a partition, is the
    cause instead)."""
    t0, t1 = prev["arrival"], sub["arrival"]
    ended = life.ended
    frozen = [(stopped, "stop") for stopped, _ in life.stops if t0 - IN_FLIGHT_S <= stopped <= t1]
    if life.end == "kill" and ended is not None and t0 - IN_FLIGHT_S <= ended <= t1:
        frozen.append((ended, "kill"))
    requeued = next((t for t, state in ev.d.events.get(job_id, []) if state == "queued" and t0 < t <= t1), None)
    if not frozen or (requeued is not None and min(frozen)[0] > requeued):
        return None
    at, how = min(frozen)
    if recorded is None or recorded > at:
        return ("killed_inside_submit", how) if at <= _record_window(ev, prev) else ("remote_id_not_recorded", None)
    return _after_recorded(ev, recorded, t1), None


def _unfrozen_cause(
    ev: Evidence, job_id: str, prev: dict[str, Any], sub: dict[str, Any], life: Incarnation, recorded: float | None
) -> str:
    """The cause when the earlier sender was not frozen inside the submit: the store, the network, a drain, a
    crash, a dropped reply, or a lease lost while its owner lived."""
    t0, t1 = prev["arrival"], sub["arrival"]
    if _full_in_submit(ev, prev, recorded):
        return "oom_inside_submit"  # a defect: the checkpoint runs at the limit (allow-oom)
    if outage := _outage_in_submit(ev, prev, recorded):
        return f"{outage}_inside_submit"  # Valkey out of reach before the id could be recorded
    if ended_by := _ended_inside_submit(life, t0, t1):
        return ended_by
    drop = next((d for d in ev.d.dropped if job_id in d.job_ids and t0 - 10 <= d.at <= t1), None)
    if drop is not None:
        return f"dropped_reply:{drop.command.split()[-1]}"
    if any(t0 - 1 <= began <= t1 for began, _ in ev.d.valkey_down):
        return "everysec_loss" if ev.d.appendfsync == "everysec" else "valkey_restart"
    if recorded is not None:
        return "resubmitted_after_recorded_id"
    return "lease_lost_while_owner_alive"


def _ended_inside_submit(life: Incarnation, t0: float, t1: float) -> str | None:
    """A drain or a crash of the earlier sender with the job in hand."""
    ended = life.ended
    if life.drained is not None and life.drained <= t1 and t0 - IN_FLIGHT_S <= (ended or t1):
        # its worker was drained with the job: a cut drain abandons its calls out (the documented cost);
        # a graceful one must have handed the job back unsent, or awaited and recorded its call
        return "drain_cut_inside_submit" if life.cut is not None else "drained_gracefully"
    if life.end and life.end.startswith("exit") and ended is not None and t0 - IN_FLIGHT_S <= ended <= t1 + 1:
        # (an exit is noticed up to a watchdog period late; the drain before it hands the job on at once)
        return "worker_crashed_inside_submit"  # it died by itself (not killed by the harness)
    return None


def keyed(ev: Evidence, prev: dict[str, Any], sub: dict[str, Any], cause: str) -> str:
    """An unavoidable resend is the same run sent again: it must carry the previous submission's
    Idempotency-Key (a new key means the worker started a new run while the last one's outcome was unknown),
    and a simulator honouring the key answers it as a replay, which is not in these pairs: so with the key
    honoured, a paid second run is not unavoidable at all."""
    key, again = prev.get("idempotency_key"), sub.get("idempotency_key")
    if key is not None and again is not None and key != again:
        return "resent_under_new_key"
    if ev.d.honoured:
        return "key_not_honoured"
    return cause


def _stale(ev: Evidence, job_id: str, life: Incarnation, sent: float) -> bool:
    """A submit the simulator received after its worker's SIGCONT, while during the stop the job went back
    to the queue (its lease expired) and nobody claimed it since the SIGCONT: the worker sent it without
    re-checking a lease it had lost. (A request
    already written before the stop arrives during the stop, as the simulator keeps running: that one is
    the unavoidable window and is judged as killed_inside_submit.)"""
    events = ev.d.events.get(job_id, [])
    for stopped, resumed in life.stops:
        requeued = any(stopped <= t <= sent and state == "queued" for t, state in events)
        claimed_again = any(resumed <= t <= sent and state == "active" for t, state in events)
        if resumed < sent and requeued and not claimed_again:
            return True
    return False


def _outage_in_submit(ev: Evidence, prev: dict[str, Any], recorded: float | None) -> str | None:
    """`partition` (a black-hole) or `valkey_crash` that began while the submit was in flight or before its
    remote id could be recorded: the worker could neither record the id nor keep its lease, so the next
    owner found no id. The network's share of the unavoidable window (zero with Idempotency-Key)."""
    start = prev["arrival"] - IN_FLIGHT_S
    end = (prev.get("responded") or prev["arrival"]) + RECORD_GRACE_S
    if recorded is not None:
        end = min(end, recorded)
    if any(began <= end and back >= start for began, back in ev.d.valkey_down):
        return "valkey_crash"
    if any(e["kind"] == "blackhole" and e["t"] <= end and e["t"] + e["seconds"] >= start for e in ev.d.timeline):
        return "partition"
    return None


def _full_in_submit(ev: Evidence, prev: dict[str, Any], recorded: float | None) -> bool:
    start = prev["arrival"] - IN_FLIGHT_S
    end = (prev.get("responded") or prev["arrival"]) + RECORD_GRACE_S
    if recorded is not None:
        end = min(end, recorded)
    return any(began <= end and back >= start for began, back in ev.d.full)


def _record_window(ev: Evidence, prev: dict[str, Any]) -> float:
    """Until when a worker may still be recording the remote id of `prev`: its answer plus RECORD_GRACE_S,
    longer when Valkey was down or the network black-holed meanwhile (the worker retries the checkpoint).
    A kill after that, with the id still unrecorded, is not the unavoidable window but a defect."""
    end: float = (prev.get("responded") or prev["arrival"]) + RECORD_GRACE_S
    outages = [(b, e - b) for b, e in ev.d.valkey_down]
    outages += [(e["t"], float(e.get("seconds") or 1.0)) for e in ev.d.timeline if e["kind"] in ("blackhole", "reset")]
    outages += [(e["cut_at"], e["switched_at"] - e["cut_at"]) for e in ev.d.timeline if e["kind"] == "failover"]
    for began, length in sorted(outages):
        if began <= end and began + length >= prev["arrival"] - IN_FLIGHT_S:  # overlapping the window
            end = max(end, began + length + OUTAGE_GRACE_S)
    return end


def recorded_at(ev: Evidence, job_id: str, prev: dict[str, Any], sub: dict[str, Any]) -> float | None:
    """When the job store recorded a remote id between the two submissions: the checkpoint's event, or
    hook.lua's `adopted` (a webhook named it), after which resubmitting is a defect too."""
    t0, t1 = prev["arrival"], sub["arrival"]
    recorded = RECORDED_SYNC if ev.d.synchronous else RECORDED
    return next((t for t, state in ev.d.events.get(job_id, []) if state in recorded and t0 - 0.05 <= t <= t1), None)


def _after_recorded(ev: Evidence, recorded: float, t1: float) -> str:
    """The remote id was recorded before the kill: the next worker should have resumed, not resubmitted."""
    if ev.d.appendfsync == "everysec" and any(
        recorded <= b <= recorded + EVERYSEC_S and b <= t1 for b, _ in ev.d.valkey_down
    ):
        return "everysec_loss"
    return "resubmitted_after_recorded_id"


def retry_reason(prev: dict[str, Any], sub: dict[str, Any], recorded: bool) -> str | None:
    """A new remote run that was wanted: the previous one failed, timed out or was cancelled, or expired at the
    provider while the job store knew its id (an id never recorded could not have been polled to its expiry)."""
    t = sub["arrival"] + 0.5
    if prev.get("remote_status") in ("failed", "timed_out") and prev["remote_ended_at"] <= t:
        return "after_remote_failure"
    if prev.get("remote_status") in ("cancelled", "aborted") and prev["remote_ended_at"] <= t:
        return "after_remote_cancel"
    expires = prev.get("remote_expires_at")
    if recorded and expires is not None and expires <= t:
        return "after_remote_expiry"
    return None
