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
- the job store's memory (issue 34): at maxmemory (`RunData.full`) no job dies of it and no duplicate comes of it
  (`oom_inside_submit` is a defect: the checkpoint runs at the limit), and while the policy may evict
  (`RunData.evicting`) nothing is submitted once the workers had `store_check_s` (plus a margin) to notice
  (`paid_while_evicting`); no worker exits by itself (one started while the policy is wrong waits paused).
- across a failover (bench/chaos/failover.py, writers with `durability` on) the same holds: no acknowledged job
  lost, none paid for twice. The events the harness read from the old primary after the last one the promoted
  replica had are dropped first: the job store that goes on never had them.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from bench.chaos import egress, hostile
from bench.chaos.procs import Incarnation
from bench.chaos.proxy import DroppedReply
from offload.testing.sim.files import file_bytes, parse_name
from offload.testing.sim.store import input_key

TERMINAL = {"succeeded", "dead", "cancelled"}
IN_FLIGHT_S = 1.0  # how late the simulator may stamp a submit that was sent just before its sender's kill/stop
RECORD_GRACE_S = 3.0  # after a submit's answer, how long recording its remote id may take on a loaded machine
OUTAGE_GRACE_S = 10.0  # more, when Valkey or the network was out meanwhile (the checkpoint is retried)
EVERYSEC_S = 1.5  # how far back an everysec crash may lose acknowledged writes (1 s, plus fsync scheduling)
SIM_JOB = re.compile(r"/_sim/files/(.+)-\d+\.\w+$")
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
RECORDED = ("submitted", "adopted")  # the events that mean the job store knows the remote id
# ... and for a synchronous API the ack too: its answer's remote id is recorded by the complete itself
RECORDED_SYNC = (*RECORDED, "succeeded")
STEP_UNSEEN_S = 60.0  # how much of a step back of Valkey's clock a queue may not see (its silence before the step)
INFRA_ERRORS = ("worker error", "lease expired", "ConnectionError", "TimeoutError", "Redis", "Connection")
OOM_TEXT = "maxmemory"  # in a job's error: it died of the store's limit, which must never happen
NOTICE_MARGIN_S = 3.0  # after the policy re-read, how long a submission already past its check may still arrive


@dataclass
class RunData:
    """Everything the checker reads, gathered by the run after quiescence."""

    acked: dict[str, tuple[str, str, float]]  # job id -> (queue, input id, acknowledged at)
    records: dict[str, dict[str, str]]  # job id -> its hash
    submissions: list[dict[str, Any]]
    outputs: dict[str, bytes | None]  # output key -> stored JSON (None: missing)
    files: dict[str, bytes | None]  # copied file key -> bytes (None: missing)
    lives: dict[str, list[Incarnation]]  # slot -> incarnations
    slot_ports: dict[int, str]  # simulator port -> slot
    timeline: list[dict[str, Any]]
    valkey_down: list[tuple[float, float]]
    appendfsync: str
    events: dict[str, list[tuple[float, str]]]  # job id -> [(time, state)] from the events streams
    dropped: list[DroppedReply]
    bucket: str
    capped_queue: str | None = None
    clock_events: list[tuple[str, float, int]] = field(default_factory=list)  # (queue, when, ms) steps back found
    daily_job_cap: int | None = None
    cap_rolled_at: float | None = None
    cap_rolls: list[float] = field(default_factory=list)  # each new store day (the first is cap_rolled_at)
    held_at_roll: int = 0
    samples: dict[str, Any] = field(default_factory=dict)
    sent: dict[str, Any] = field(default_factory=dict)  # job id -> the input as the producer sent it
    # the backend's submit call is the whole job (offload's Backend.synchronous): its answer is the stored output
    # and the ack records its remote id; there is nothing to poll, so a remote run's expiry excuses no resubmit
    synchronous: bool = False
    # the simulator honoured Idempotency-Key: a resend under a submission's key is a replay, never a second run
    # (False for runs saved before this field, which were judged without it)
    honoured: bool = False
    # the store's memory faults: spans at maxmemory, spans with an evicting policy, and how often workers re-read it
    full: list[tuple[float, float]] = field(default_factory=list)
    evicting: list[tuple[float, float]] = field(default_factory=list)
    store_check_s: float = 5.0
    # the ssrf fault: the internal service hostile inputs named, and what a dispatch worker asked it
    internal_url: str | None = None
    internal_hits: list[str] = field(default_factory=list)


@dataclass
class Verdict:
    summary: dict[str, Any]
    findings: list[str]
    details: list[dict[str, Any]]


class Checker:
    def __init__(self, data: RunData) -> None:
        lost = _lost_window(data.timeline)
        self.d = dataclasses.replace(
            data,
            events={
                j: [(t, st) for t, st in evs if not lost(j.partition(":")[0], t)] for j, evs in data.events.items()
            },
            clock_events=[e for e in data.clock_events if not lost(e[0], e[1])],
        )
        self.findings: list[str] = []
        self.details: list[dict[str, Any]] = []  # the evidence behind each defect, for the run's report.json
        self._kinds: Counter[str] = Counter()
        self.by_input: dict[str, str] = {}  # input id -> job id
        for job_id, h in data.records.items():
            if (input_id := _input_id(h.get("input"))) is not None:
                self.by_input[input_id] = job_id
        for job_id, (_, input_id, _) in data.acked.items():
            self.by_input.setdefault(input_id, job_id)
        self.remote_input = {s["remote_id"]: s["input_id"] for s in data.submissions}

    def find(self, text: str) -> None:
        """Keep a few examples of each kind of finding (its text up to the first detail), not the first 60."""
        kind = re.sub(r"[a-z]+:[0-9a-f]{28}|[a-z]+:t-\d+", "", text).split("(")[0].split(" stored ")[0][:60]
        self._kinds[kind] += 1
        if self._kinds[kind] <= 4 and len(self.findings) < 60:
            self.findings.append(text)

    # -- terminal states -------------------------------------------------------------------------

    def terminal(self) -> dict[str, Any]:
        lost, everysec, stuck = [], [], []
        stuck_states: Counter[str] = Counter()
        for job_id, (_, _, acked_at) in self.d.acked.items():
            h = self.d.records.get(job_id)
            if h is None:
                crash = self._crash_after(acked_at, EVERYSEC_S)
                (everysec if self.d.appendfsync == "everysec" and crash else lost).append(job_id)
            elif h.get("state") not in TERMINAL:
                stuck.append(job_id)
                stuck_states[h.get("state", "?")] += 1
        for job_id in lost[:5]:
            self.find(f"lost: {job_id} (acknowledged, no record)")
        owners = Counter(self.d.records[j].get("owner") or "-" for j in stuck)
        for job_id in stuck[:10]:
            self.details.append(
                {"job": job_id, "stuck": self.d.records[job_id], "events": self.d.events.get(job_id, [])}
            )
        for job_id in stuck[:5]:
            h = self.d.records[job_id]
            self.find(
                f"stuck: {job_id} state={h.get('state')} owner={h.get('owner') or '-'} "
                f"attempts={h.get('attempts', 0)} expiries={h.get('expiries', 0)}"
            )
        dead = [h for j, h in self.d.records.items() if j in self.d.acked and h.get("state") == "dead"]
        reasons = Counter(_reason(h.get("error", "")) for h in dead)
        infra = sum(n for r, n in reasons.items() if any(m in r for m in INFRA_ERRORS))
        return {
            "lost": len(lost),
            "everysec_loss": len(everysec),
            "stuck": len(stuck),
            "stuck_by_state": dict(stuck_states),
            "stuck_by_owner": dict(owners.most_common(5)),
            "dead": len(dead),
            "dead_by_reason": dict(reasons.most_common(8)),
            "dead_by_infra_error": infra,
        }

    def _crash_after(self, t: float, within: float) -> bool:
        return any(t <= began <= t + within for began, _ in self.d.valkey_down)

    # -- results ---------------------------------------------------------------------------------

    def results(self) -> dict[str, Any]:
        wrong: Counter[str] = Counter()
        stray = rewritten = 0
        counted: set[str] = set()
        for job_id, original in self.d.sent.items():
            h = self.d.records.get(job_id)
            if h is not None and _decode(h.get("input")) != original:
                rewritten += 1
                if h.get("state") == "succeeded":
                    counted.add(job_id)
                    wrong["input_rewritten"] += 1
                    self.find(
                        f"wrong result: {job_id}: input_rewritten: stored {h.get('input', '')[:90]} "
                        f"for {orjson.dumps(original).decode()[:90]}"
                    )
        for job_id, h in self.d.records.items():
            key = h.get("output_key") or f"results/{job_id}.json"
            if h.get("state") != "succeeded":
                stray += self.d.outputs.get(key) is not None
                continue
            problem = None if job_id in counted else self._wrong(job_id, h, key)
            if problem:
                wrong[problem.split(":")[0]] += 1
                self.find(f"wrong result: {job_id}: {problem}")
        return {
            "wrong_results": sum(wrong.values()),
            "wrong_by_kind": dict(wrong),
            "inputs_rewritten": rewritten,
            "outputs_of_unfinished_jobs": stray,
        }

    def _wrong(self, job_id: str, h: dict[str, str], key: str) -> str | None:
        if h.get("result") != f"s3://{self.d.bucket}/{key}":
            return f"result location: {h.get('result')!r} is not its output key {key}"
        blob = self.d.outputs.get(key)
        if blob is None:
            return "missing: succeeded but nothing stored at its output key"
        try:
            stored = orjson.loads(blob)
        except orjson.JSONDecodeError:
            return "unreadable: the stored output is not JSON"
        expected = _decode(h.get("input"))
        if self.d.synchronous:
            return self._wrong_answer(h, stored, expected)
        if not isinstance(stored, dict) or stored.get("echo") != expected:
            echo = stored.get("echo") if isinstance(stored, dict) else None
            return f"foreign: output echoes {str(echo)[:80]} instead of its own input"
        originals = stored.get("_offload_files") or {}
        for url, location in originals.items():
            m = SIM_JOB.search(url)
            if m is None:
                continue
            remote = m[1]
            if self.remote_input.get(remote) != _input_id(h.get("input")):
                return f"foreign run: file of remote job {remote}, not a submission of this job's input"
            file_key = str(location).removeprefix(f"s3://{self.d.bucket}/")
            name = url.rsplit("/", 1)[-1]
            parsed = parse_name(name)
            got = self.d.files.get(file_key)
            if got is None:
                return f"file missing: {file_key}"
            if parsed and got != file_bytes(name, parsed[1], 1024):
                return f"file mixed: {file_key} does not hold {name}"
        return None

    def _wrong_answer(self, h: dict[str, str], stored: Any, expected: Any) -> str | None:
        """A synchronous API's stored answer (a chat completion) belongs to its job: its `id` is the remote run
        the ack recorded (so the output and the record name the same run), the simulator logged that run as a
        submission of this job's input, and every choice's message is the simulator's JSON echo of this job's
        request body, with file URLs of that run. A replayed answer (Idempotency-Key) carries the first run's
        id, which is still this job's."""
        if not isinstance(stored, dict) or stored.get("object") != "chat.completion":
            return "unreadable: the stored output is not a chat.completion"
        remote = stored.get("id")
        if remote != h.get("remote_id"):
            return f"foreign run: answer {remote} is not the run the ack recorded ({h.get('remote_id')})"
        if self.remote_input.get(str(remote)) != _input_id(h.get("input")):
            return f"foreign run: answer {remote} was not a submission of this job's input"
        choices = stored.get("choices")
        if not isinstance(choices, list) or not choices:
            return "unreadable: the answer has no choices"
        for choice in choices:
            message = choice.get("message") if isinstance(choice, dict) else None
            try:
                content = orjson.loads(message.get("content") or b"") if isinstance(message, dict) else None
            except orjson.JSONDecodeError:
                content = None
            if not isinstance(content, dict):
                return "unreadable: a choice's message is not the simulator's JSON answer"
            if content.get("echo") != expected:
                return f"foreign: answer echoes {str(content.get('echo'))[:80]} instead of its own request"
            for url in content.get("files") or []:
                parsed = parse_name(str(url).rsplit("/", 1)[-1])
                if parsed is None or parsed[0] != remote:
                    return f"foreign run: answer {remote} links {str(url)[-60:]}, a file of another run"
        return None

    def finished_twice(self) -> dict[str, Any]:
        """A job must reach `succeeded` once: a second transition means two workers both completed it (a repeat
        of the same ack after a lost reply answers OK without a new event)."""
        twice = [j for j, evs in self.d.events.items() if sum(state == "succeeded" for _, state in evs) > 1]
        for job_id in twice[:5]:
            self.find(f"finished twice: {job_id} {self.d.events[job_id]}")
        return {"finished_twice": len(twice)}

    # -- submissions -----------------------------------------------------------------------------

    def _who(self, sub: dict[str, Any]) -> tuple[str, Incarnation] | None:
        """The incarnation that sent a submission: by the worker id in its User-Agent, else by the port."""
        t = sub["arrival"]
        candidates: list[tuple[str, Incarnation]] = []
        if sub.get("worker"):
            candidates = [
                (s, life) for s, lives in self.d.lives.items() for life in lives if life.read_id() == sub["worker"]
            ]
        if not candidates and (slot := self.d.slot_ports.get(sub.get("port") or 0)):
            candidates = [(slot, life) for life in self.d.lives.get(slot, [])]
        # the latest process of the slot started before the submit arrived (a new one needs seconds to boot
        # before it can submit anything, while a killed one's last request may be stamped a little late)
        before = [c for c in candidates if c[1].started <= t]
        return max(before, key=lambda c: c[1].started) if before else None

    def _name(self, sub: dict[str, Any]) -> str:
        who = self._who(sub)
        return f"{who[0]}#{who[1].n}" if who else f"port {sub.get('port')}"

    def duplicates(self) -> dict[str, Any]:
        per_job: dict[str, list[dict[str, Any]]] = defaultdict(list)
        replays: list[dict[str, Any]] = []
        for sub in self.d.submissions:
            if sub["replay"]:
                replays.append(sub)
                continue
            job_id = self.by_input.get(sub["input_id"])
            if job_id is not None:
                per_job[job_id].append(sub)
        causes: Counter[str] = Counter()
        retries: Counter[str] = Counter()
        kill_kinds: Counter[str] = Counter()
        for job_id, subs in per_job.items():
            subs.sort(key=lambda s: s["arrival"])
            for prev, sub in itertools.pairwise(subs):
                recorded = self._recorded(job_id, prev, sub) is not None and not self.d.synchronous
                legit = _retry_reason(prev, sub, recorded or self._polled_to_expiry(job_id, prev))
                if legit:
                    retries[legit] += 1
                    continue
                cause, how = self._cause(job_id, prev, sub)
                if cause in UNAVOIDABLE:
                    cause = self._keyed(prev, sub, cause)
                causes[cause] += 1
                if how:
                    kill_kinds[how] += 1
                if cause not in UNAVOIDABLE:
                    self.find(
                        f"duplicate submission of {job_id}: {cause} (first at {prev['arrival']:.3f} by "
                        f"{self._name(prev)}, again at {sub['arrival']:.3f} by {self._name(sub)})"
                    )
                    self._kinds["detail:" + cause] += 1
                    if self._kinds["detail:" + cause] <= 5:
                        self.details.append(
                            {
                                "job": job_id,
                                "cause": cause,
                                "first": prev,
                                "again": sub,
                                "first_by": self._name(prev),
                                "again_by": self._name(sub),
                                "events": self.d.events.get(job_id, []),
                                "record": self.d.records.get(job_id),
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
            "replays_after_graceful_drain": self._drain_replays(per_job, replays),
            "submissions": sum(1 for s in self.d.submissions if not s["replay"]),
        }

    def _polled_to_expiry(self, job_id: str, prev: dict[str, Any]) -> bool:
        """Whether the job's last error is `prev`'s remote run found expired: a worker polled that id, so the job
        store knew it, although no `submitted` event says so (a stale worker's answer ATTACHED by checkpoint.lua,
        after a SIGSTOP inside the call, records the id without an event)."""
        error = self.d.records.get(job_id, {}).get("error") or ""
        return error.startswith("remote result expired") and str(prev.get("remote_id")) in error

    def _drain_replays(self, per_job: dict[str, list[dict[str, Any]]], replays: list[dict[str, Any]]) -> int:
        """Resends the simulator answered from its Idempotency-Key cache (nothing paid) whose earlier submission's
        worker was drained gracefully: a provider that ignores the key would have run them twice, so each is the
        same defect as a paid `drained_gracefully` duplicate."""
        found = 0
        for replay in replays:
            job_id = self.by_input.get(replay["input_id"])
            earlier = [s for s in per_job.get(job_id or "", []) if s["arrival"] < replay["arrival"]]
            if job_id is None or not earlier:
                continue
            if self._cause(job_id, earlier[-1], replay)[0] == "drained_gracefully":
                found += 1
                self.find(
                    f"resent after a graceful drain: {job_id} (first at {earlier[-1]['arrival']:.3f} by "
                    f"{self._name(earlier[-1])}, replayed at {replay['arrival']:.3f} by {self._name(replay)})"
                )
        return found

    def _cause(self, job_id: str, prev: dict[str, Any], sub: dict[str, Any]) -> tuple[str, str | None]:
        """Why `sub` was sent although `prev` had not failed or expired. Only killed_inside_submit is the
        window the design cannot close (without a provider that honours Idempotency-Key)."""
        t0, t1 = prev["arrival"], sub["arrival"]
        if prev.get("lost_response"):
            return "response_lost", None  # the provider accepted it; its answer never reached the worker
        if prev.get("gateway_error"):
            return "gateway_error", None  # the provider accepted it; a gateway's 5xx page reached the worker instead
        who, again = self._who(prev), self._who(sub)
        if who is None:
            return "unattributed", None
        life = who[1]
        recorded = self._recorded(job_id, prev, sub)
        if self._stale(job_id, life, t0) or (again is not None and self._stale(job_id, again[1], t1)):
            return "stale_submit_after_stop", None  # sent after SIGCONT although its lease had moved on
        if again is not None and again[1] is life:
            return "same_worker_resubmitted", None  # a worker submitted its own job twice (stall, re-claim)
        ended = life.ended
        window = self._record_window(prev)
        # the moment the earlier sender was frozen: its first SIGSTOP or its SIGKILL, whichever came first; it
        # explains the duplicate only if it came before the job left that worker (a lease lost earlier, e.g. in a
        # partition, is the cause instead)
        frozen = [(stopped, "stop") for stopped, _ in life.stops if t0 - IN_FLIGHT_S <= stopped <= t1]
        if life.end == "kill" and ended is not None and t0 - IN_FLIGHT_S <= ended <= t1:
            frozen.append((ended, "kill"))
        requeued = next((t for t, state in self.d.events.get(job_id, []) if state == "queued" and t0 < t <= t1), None)
        if frozen and (requeued is None or min(frozen)[0] <= requeued):
            at, how = min(frozen)
            if recorded is None or recorded > at:
                return ("killed_inside_submit", how) if at <= window else ("remote_id_not_recorded", None)
            return self._after_recorded(recorded, t1), None
        if self._full_in_submit(prev, recorded):
            return "oom_inside_submit", None  # a defect: the checkpoint runs at the limit (allow-oom)
        if outage := self._outage_in_submit(prev, recorded):
            return f"{outage}_inside_submit", None  # Valkey out of reach before the id could be recorded
        if life.drained is not None and life.drained <= t1 and t0 - IN_FLIGHT_S <= (life.ended or t1):
            # its worker was drained with the job: a cut drain abandons its calls out (the documented cost);
            # a graceful one must have handed the job back unsent, or awaited and recorded its call
            return ("drain_cut_inside_submit" if life.cut is not None else "drained_gracefully"), None
        if life.end and life.end.startswith("exit") and ended is not None and t0 - IN_FLIGHT_S <= ended <= t1 + 1:
            # (an exit is noticed up to a watchdog period late; the drain before it hands the job on at once)
            return "worker_crashed_inside_submit", None  # it died by itself (not killed by the harness)
        drop = next((d for d in self.d.dropped if job_id in d.job_ids and t0 - 10 <= d.at <= t1), None)
        if drop is not None:
            return f"dropped_reply:{drop.command.split()[-1]}", None
        if any(t0 - 1 <= began <= t1 for began, _ in self.d.valkey_down):
            if self.d.appendfsync == "everysec":
                return "everysec_loss", None
            return "valkey_restart", None
        if recorded is not None:
            return "resubmitted_after_recorded_id", None
        return "lease_lost_while_owner_alive", None

    def _keyed(self, prev: dict[str, Any], sub: dict[str, Any], cause: str) -> str:
        """An unavoidable resend is the same run sent again: it must carry the previous submission's
        Idempotency-Key (a new key means the worker started a new run while the last one's outcome was unknown),
        and a simulator honouring the key answers it as a replay, which is not in these pairs: so with the key
        honoured, a paid second run is not unavoidable at all."""
        key, again = prev.get("idempotency_key"), sub.get("idempotency_key")
        if key is not None and again is not None and key != again:
            return "resent_under_new_key"
        if self.d.honoured:
            return "key_not_honoured"
        return cause

    def _stale(self, job_id: str, life: Incarnation, sent: float) -> bool:
        """A submit the simulator received after its worker's SIGCONT, while during the stop the job went back
        to the queue (its lease expired) and nobody claimed it since the SIGCONT: the worker sent it without
        re-checking a lease it had lost. (A request
        already written before the stop arrives during the stop, as the simulator keeps running: that one is
        the unavoidable window and is judged as killed_inside_submit.)"""
        events = self.d.events.get(job_id, [])
        for stopped, resumed in life.stops:
            requeued = any(stopped <= t <= sent and state == "queued" for t, state in events)
            claimed_again = any(resumed <= t <= sent and state == "active" for t, state in events)
            if resumed < sent and requeued and not claimed_again:
                return True
        return False

    def _outage_in_submit(self, prev: dict[str, Any], recorded: float | None) -> str | None:
        """`partition` (a black-hole) or `valkey_crash` that began while the submit was in flight or before its
        remote id could be recorded: the worker could neither record the id nor keep its lease, so the next
        owner found no id. The network's share of the unavoidable window (zero with Idempotency-Key)."""
        start = prev["arrival"] - IN_FLIGHT_S
        end = (prev.get("responded") or prev["arrival"]) + RECORD_GRACE_S
        if recorded is not None:
            end = min(end, recorded)
        if any(began <= end and back >= start for began, back in self.d.valkey_down):
            return "valkey_crash"
        if any(e["kind"] == "blackhole" and e["t"] <= end and e["t"] + e["seconds"] >= start for e in self.d.timeline):
            return "partition"
        return None

    def _full_in_submit(self, prev: dict[str, Any], recorded: float | None) -> bool:
        start = prev["arrival"] - IN_FLIGHT_S
        end = (prev.get("responded") or prev["arrival"]) + RECORD_GRACE_S
        if recorded is not None:
            end = min(end, recorded)
        return any(began <= end and back >= start for began, back in self.d.full)

    def _record_window(self, prev: dict[str, Any]) -> float:
        """Until when a worker may still be recording the remote id of `prev`: its answer plus RECORD_GRACE_S,
        longer when Valkey was down or the network black-holed meanwhile (the worker retries the checkpoint).
        A kill after that, with the id still unrecorded, is not the unavoidable window but a defect."""
        end = (prev.get("responded") or prev["arrival"]) + RECORD_GRACE_S
        outages = [(b, e - b) for b, e in self.d.valkey_down]
        outages += [
            (e["t"], float(e.get("seconds") or 1.0)) for e in self.d.timeline if e["kind"] in ("blackhole", "reset")
        ]
        outages += [(e["cut_at"], e["switched_at"] - e["cut_at"]) for e in self.d.timeline if e["kind"] == "failover"]
        for began, length in sorted(outages):
            if began <= end and began + length >= prev["arrival"] - IN_FLIGHT_S:  # overlapping the window
                end = max(end, began + length + OUTAGE_GRACE_S)
        return end

    def _recorded(self, job_id: str, prev: dict[str, Any], sub: dict[str, Any]) -> float | None:
        """When the job store recorded a remote id between the two submissions: the checkpoint's event, or
        hook.lua's `adopted` (a webhook named it), after which resubmitting is a defect too."""
        t0, t1 = prev["arrival"], sub["arrival"]
        recorded = RECORDED_SYNC if self.d.synchronous else RECORDED
        return next(
            (t for t, state in self.d.events.get(job_id, []) if state in recorded and t0 - 0.05 <= t <= t1), None
        )

    def _after_recorded(self, recorded: float, t1: float) -> str:
        """The remote id was recorded before the kill: the next worker should have resumed, not resubmitted."""
        if self.d.appendfsync == "everysec" and any(
            recorded <= b <= recorded + EVERYSEC_S and b <= t1 for b, _ in self.d.valkey_down
        ):
            return "everysec_loss"
        return "resubmitted_after_recorded_id"

    # -- unknown outcomes and lagging status ------------------------------------------------------

    def _submissions_by_job(self) -> dict[str, list[dict[str, Any]]]:
        """Every logged submission (replays too) per job, oldest first."""
        per_job: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for sub in self.d.submissions:
            if (job_id := self.by_input.get(sub["input_id"])) is not None:
                per_job[job_id].append(sub)
        for subs in per_job.values():
            subs.sort(key=lambda s: s["arrival"])
        return per_job

    def unknown_outcomes(self) -> dict[str, Any]:
        """A submission answered with a gateway's 5xx after the provider created its job has an outcome the worker
        cannot know: each later submission under its Idempotency-Key (a replay where the key is honoured, a second
        paid run elsewhere) must be counted on the job as a possible duplicate, never silent. And a job dead as
        "remote result expired" while the provider still had its last remote job (a status read lagging the
        submit taken for expiry) is a `false_expiry`."""
        per_job = self._submissions_by_job()
        resends = uncounted = false_expiries = 0
        for job_id, subs in per_job.items():
            h = self.d.records.get(job_id)
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
                self.find(
                    f"uncounted resend: {job_id} sent again {again}x after a gateway 5xx, counted "
                    f"{h.get('possible_duplicates') or 0}"
                )
            if h.get("state") == "dead" and "remote result expired" in (h.get("error") or ""):
                died = next((t for t, state in reversed(self.d.events.get(job_id, [])) if state == "dead"), None)
                paid = [s for s in subs if not s["replay"]]
                expires = paid[-1].get("remote_expires_at") if paid else None
                if died is not None and paid and (expires is None or expires > died):
                    false_expiries += 1
                    self.find(f"false expiry: {job_id} dead as expired while remote job {paid[-1]['remote_id']} lived")
        gateway = sum(1 for s in self.d.submissions if s.get("gateway_error"))
        return {
            "gateway_errors": gateway,
            "gateway_resends": resends,
            "uncounted_resends": uncounted,
            "false_expiries": false_expiries,
        }

    # -- drains ----------------------------------------------------------------------------------------

    def drains(self) -> dict[str, Any]:
        """The graceful restarts: each must end with exit 0 (a drain is no crash), unless the kill fault SIGKILLed
        the draining worker first (then its jobs cost what a kill's do)."""
        drains = [e for e in self.d.timeline if e["kind"] == "drain"]
        bad = [e for e in drains if e.get("code") != 0 and not e.get("killed")]
        for e in bad:
            self.find(f"drain: {e['target']}#{e.get('n')} exited {e.get('code')} after {e.get('took_s')} s")
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

    # -- caps, held jobs, memory -----------------------------------------------------------------

    def caps(self) -> dict[str, Any]:
        if self.d.capped_queue is None or self.d.daily_job_cap is None:
            return {}
        capped = {j for j, (q, _, _) in self.d.acked.items() if q == self.d.capped_queue}
        inputs = {self.d.acked[j][1] for j in capped}
        rolls = self.d.cap_rolls or ([self.d.cap_rolled_at] if self.d.cap_rolled_at else [])
        bounds = [float("-inf"), *rolls, float("inf")]
        days = [  # the capped jobs submitted in each of the store's days (a job once per day, as the cap counts)
            {s["input_id"] for s in self.d.submissions if s["input_id"] in inputs and lo <= s["arrival"] < hi}
            for lo, hi in itertools.pairwise(bounds)
        ]
        cap = self.d.daily_job_cap
        # the first day fills the cap exactly; a later one (jobs released, runs expired at the provider) never
        # passes it
        exact = len(days[0]) == min(cap, len(capped)) and all(len(day) <= cap for day in days[1:])
        released = all(self.d.records.get(j, {}).get("state") in TERMINAL for j in capped)
        if not exact:
            self.find(
                f"cap: {[len(day) for day in days]} jobs of queue {self.d.capped_queue} submitted in its days under "
                f"a daily cap of {cap}"
            )
        if not released:
            self.find("held: capped jobs still not terminal after the cap window rolled over")
        return {
            "cap": {
                "daily_job_cap": cap,
                "jobs": len(capped),
                "submitted_day1": len(days[0]),
                "submitted_later": [len(day) for day in days[1:]],
                "held_at_roll": self.d.held_at_roll,
                "exact": exact,
            },
            "held_released": released,
        }

    def store_faults(self) -> dict[str, Any]:
        """The store's memory faults: deaths of the limit, payments while the policy could evict, worker exits."""
        dead_oom = [j for j, h in self.d.records.items() if h.get("state") == "dead" and OOM_TEXT in h.get("error", "")]
        for job_id in dead_oom[:5]:
            self.find(f"dead of the store's limit: {job_id}: {self.d.records[job_id].get('error', '')[:120]}")
        judged = [(b + self.d.store_check_s + NOTICE_MARGIN_S, e) for b, e in self.d.evicting]
        paid = [s for s in self.d.submissions if not s["replay"] and any(lo <= s["arrival"] <= hi for lo, hi in judged)]
        for sub in paid[:5]:
            self.find(f"paid while evicting: {sub['input_id']} submitted at {sub['arrival']:.3f} by {self._name(sub)}")
        # (a worker started while the policy may evict waits paused like a running one: no exit is explained)
        exits = [e for e in self.d.timeline if e["kind"] == "worker_exit"]
        for e in exits[:3]:
            self.find(f"worker exit: {e['target']}#{e.get('n')} code {e.get('code')}: {str(e.get('tail'))[-160:]}")
        return {
            "oom_spells": len(self.d.full),
            "eviction_spells": len(self.d.evicting),
            "dead_by_oom": len(dead_oom),
            "paid_while_evicting": len(paid),
            "worker_exits_unexplained": len(exits),
        }

    def clock(self) -> dict[str, Any]:
        """Every `clock_stepped_back` a queue recorded is a step back the harness made, each step moved once at
        most per queue. A queue sees a step less the time nobody read the clock before it (a worker restarting:
        up to STEP_UNSEEN_S), never more; one nobody read while the clock was forward again between two steps back
        sees the second from the first's clock. A step may go unrecorded in a queue nobody read until the clock was
        forward again (nothing there was scheduled on the stepped clock by then): counted, not a finding."""
        steps = [e for e in self.d.timeline if e["kind"] == "valkey_clock"]
        skews = [e for e in self.d.timeline if e["kind"] == "worker_clock"]
        if not steps and not skews and not self.d.clock_events:
            return {}
        back = [e for e in steps if e["step_s"] < -1]
        # what a queue may see of each step back: from the clock it last read, the one in force at any time before
        # (a queue nobody read while the clock was forward again sees the step from the clock before that)
        seen = [
            {lvl - e["offset_s"] for lvl in [0.0, *(s["offset_s"] for s in steps if s["t"] < e["t"])]} for e in back
        ]
        found: dict[str, int] = Counter()
        used: set[tuple[str, int]] = set()
        for queue, _, ms in self.d.clock_events:
            found[queue] += 1
            sizes = [i for i in range(len(back)) if any(s - STEP_UNSEEN_S <= ms / 1000 <= s + 2 for s in seen[i])]
            fresh = [i for i in sizes if (queue, i) not in used]
            if fresh:
                used.add((queue, fresh[0]))
            elif sizes:
                self.find(f"clock: queue {queue} moved its times back twice for one step of {ms} ms")
            else:
                self.find(f"clock: queue {queue} moved its times back {ms} ms for a step the harness never made")
        return {
            "clock": {
                "valkey_steps_back": len(back),
                "valkey_steps_forward": sum(e["step_s"] > 0 for e in steps),
                "steps_back_recorded": dict(found),
                "worker_skews_s": sorted(e["skew_s"] for e in skews),
            }
        }

    def bounds(self) -> dict[str, Any]:
        s = self.d.samples
        jobs = max(len(self.d.records), 1)
        peak = s.get("used_memory_peak", 0)
        memory_ok = peak <= 64 * 2**20 + 16 * 1024 * jobs
        events_ok = s.get("events_len_max", 0) <= 2 * 10_000 + 1000 and s.get("event_ids_max", 0) <= 20_000
        if not memory_ok:
            self.find(f"memory: Valkey used_memory peaked at {peak / 2**20:.1f} MiB for {jobs} job records")
        if not events_ok:
            self.find(f"events: stream length {s.get('events_len_max')} / {s.get('event_ids_max')} ids in one entry")
        return {
            "memory_mb": {"peak": round(peak / 2**20, 1), "final": round(s.get("used_memory", 0) / 2**20, 1)},
            "memory_bounded": memory_ok,
            "events_bounded": events_ok,
            "events": {"max_len": s.get("events_len_max", 0), "max_ids_per_entry": s.get("event_ids_max", 0)},
        }

    def in_flight(self, slots: Iterable[str], window: tuple[float, float]) -> dict[str, Any]:
        """Remote jobs in flight per worker process, sampled every second of the fault phase, from the
        submission log: sent by a live process of the slot and not yet ended at the provider (a killed process's
        remote jobs stop counting when it dies). A stale lease set cannot inflate this."""
        wanted = set(slots)
        spans: dict[str, tuple[list[float], list[float]]] = {}
        for sub in self.d.submissions:
            who = self._who(sub)
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

    def cancels(self) -> dict[str, Any]:
        """The operator's cancels (timeline `cancel`): none costs a remote run the store knew of, none is sent on."""
        done = [e for e in self.d.timeline if e["kind"] == "cancel"]
        if not done:
            return {}
        runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for sub in self.d.submissions:
            if not sub["replay"]:
                runs[sub["remote_id"]].append(sub)
        slack = max(RECORD_GRACE_S, IN_FLIGHT_S + 1.0)  # a submit past its begin when the cancel came, in flight
        not_cancelled = after = ran = 0
        for e in done:
            job_id = e["target"]
            h = self.d.records.get(job_id, {})
            if e["answer"] == "cancelled" and h.get("state") != "cancelled":
                not_cancelled += 1
                self.find(f"cancel: {job_id} answered cancelled but ended {h.get('state')}")
            input_id = _input_id(h.get("input"))
            late = [
                s
                for s in self.d.submissions
                if s["input_id"] == input_id and not s["replay"] and s["arrival"] > e["t"] + slack
            ]
            if input_id is not None and late:
                after += 1
                self.find(f"cancel: {job_id} submitted again {late[0]['arrival'] - e['t']:.1f}s after its cancel")
            ended = next((t for t, state in self.d.events.get(job_id, []) if state == "cancelled"), None)
            for sub in runs.get(h.get("remote_id") or "", []) if ended is not None else []:
                if sub.get("remote_status") not in ("cancelled", "aborted") and sub["remote_ended_at"] > ended + 1.0:
                    ran += 1
                    self.find(
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

    def verdict(self) -> Verdict:
        summary: dict[str, Any] = {}
        parts = (
            self.terminal(),
            self.results(),
            self.finished_twice(),
            self.duplicates(),
            self.unknown_outcomes(),
            self.drains(),
            self.caps(),
            self.clock(),
            self.store_faults(),
            self.bounds(),
            self.cancels(),
            egress.verdict(self.d, self.find),
        )
        for part in parts:
            summary.update(part)
        hostile_part, hostile_findings = hostile.check(self.d.timeline)  # --faults hostile (bench/chaos/hostile.py)
        summary.update(hostile_part)
        self.findings += hostile_findings
        return Verdict(summary, self.findings, self.details)


def _lost_window(timeline: Iterable[dict[str, Any]]) -> Callable[[str, float], bool]:
    """Whether an event of a queue at a time (true clock) was read from the old primary after the last event of that
    queue the promoted replica had (`kept`, ms) and after the replica was cut off, before the clients were switched
    to it: a failover took it back. (The cut bounds it too: while a step back of the store's clock holds stream ids
    at their last value, `kept` names the moment of the step, long before the cut.)"""
    failovers = [(e["kept"], e["cut_at"], e["switched_at"]) for e in timeline if e["kind"] == "failover"]

    def lost(queue: str, t: float) -> bool:
        return any(max(kept.get(queue, 0) / 1000, cut) < t < switched for kept, cut, switched in failovers)

    return lost


def _decode(raw: str | None) -> Any:
    if raw is None:
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw


def _input_id(raw: str | None) -> str | None:
    """The input id as the simulator's submission log names it (`id`, or `metadata.id` in a chat request)."""
    value = _decode(raw)
    return input_key(value) if isinstance(value, dict) else None


def _reason(error: str) -> str:
    return re.sub(r"[0-9a-f]{8,}|\d+(\.\d+)?", "#", error)[:70]


def _retry_reason(prev: dict[str, Any], sub: dict[str, Any], recorded: bool) -> str | None:
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


def count_kinds(timeline: Iterable[dict[str, Any]]) -> Counter[str]:
    return Counter(e["kind"] for e in timeline)
