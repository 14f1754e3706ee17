"""What the fault harness's checker reads and the view it judges through: `RunData` (gathered by the run after
quiescence, saved in report.json), the `Evidence` every check shares (the run with the events a failover took back
dropped, who sent each submission, and the findings so far), and the `Verdict` it hands back."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson

from bench.chaos.procs import Incarnation
from bench.chaos.proxy import DroppedReply
from offload.testing.sim.store import input_key

TERMINAL = {"succeeded", "dead", "cancelled"}
IN_FLIGHT_S = 1.0  # how late the simulator may stamp a submit that was sent just before its sender's kill/stop
RECORD_GRACE_S = 3.0  # after a submit's answer, how long recording its remote id may take on a loaded machine
OUTAGE_GRACE_S = 10.0  # more, when Valkey or the network was out meanwhile (the checkpoint is retried)
EVERYSEC_S = 1.5  # how far back an everysec crash may lose acknowledged writes (1 s, plus fsync scheduling)
SIM_JOB = re.compile(r"/_sim/files/(.+)-\d+\.\w+$")
RECORDED = ("submitted", "adopted", "attached")  # the events that mean the job store knows the remote id
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
    counted_day1: list[str] = field(default_factory=list)  # the capped jobs the first day counted, at its end
    unsent_day1: list[str] = field(default_factory=list)  # capped jobs with their day's call still to come then
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


class Evidence:
    """The run as the checks judge it, and the findings they make: a few examples of each kind (`find`) and the
    evidence behind each defect (`details`, for the run's report.json)."""

    def __init__(self, data: RunData) -> None:
        self.d = data  # a failover's taken-back events were dropped as they were read (eventlog.py)
        self.findings: list[str] = []
        self.details: list[dict[str, Any]] = []
        self.kinds: Counter[str] = Counter()
        self.by_input: dict[str, str] = {}  # input id -> job id
        for job_id, h in data.records.items():
            if (input_id := decode_input_id(h.get("input"))) is not None:
                self.by_input[input_id] = job_id
        for job_id, (_, input_id, _) in data.acked.items():
            self.by_input.setdefault(input_id, job_id)
        self.remote_input = {s["remote_id"]: s["input_id"] for s in data.submissions}

    def find(self, text: str) -> None:
        """Keep a few examples of each kind of finding (its text up to the first detail), not the first 60."""
        kind = re.sub(r"[a-z]+:[0-9a-f]{28}|[a-z]+:t-\d+", "", text).split("(")[0].split(" stored ")[0][:60]
        self.kinds[kind] += 1
        if self.kinds[kind] <= 4 and len(self.findings) < 60:
            self.findings.append(text)

    def crash_after(self, t: float, within: float) -> bool:
        return any(t <= began <= t + within for began, _ in self.d.valkey_down)

    def who(self, sub: dict[str, Any]) -> tuple[str, Incarnation] | None:
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

    def name(self, sub: dict[str, Any]) -> str:
        who = self.who(sub)
        return f"{who[0]}#{who[1].n}" if who else f"port {sub.get('port')}"


def decode(raw: str | None) -> Any:
    if raw is None:
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw


def decode_input_id(raw: str | None) -> str | None:
    """The input id as the simulator's submission log names it (`id`, or `metadata.id` in a chat request)."""
    value = decode(raw)
    return input_key(value) if isinstance(value, dict) else None


def error_kind(error: str) -> str:
    return re.sub(r"[0-9a-f]{8,}|\d+(\.\d+)?", "#", error)[:70]
