"""The checks of where each job ended and what it left: every acknowledged job exists and is terminal (`lost`,
`everysec_loss`, `stuck`), every succeeded job's stored output and files are its own (`wrong_results`), and no
job finished twice."""

from __future__ import annotations

from collections import Counter
from typing import Any

import orjson

from bench.chaos.rundata import (
    EVERYSEC_S,
    INFRA_ERRORS,
    SIM_JOB,
    TERMINAL,
    Evidence,
    decode,
    decode_input_id,
    error_kind,
)
from offload.testing.sim.files import file_bytes, parse_name


def terminal(ev: Evidence) -> dict[str, Any]:
    lost: list[str] = []
    everysec: list[str] = []
    stuck: list[str] = []
    stuck_states: Counter[str] = Counter()
    for job_id, (_, _, acked_at) in ev.d.acked.items():
        h = ev.d.records.get(job_id)
        if h is None:
            crash = ev.crash_after(acked_at, EVERYSEC_S)
            (everysec if ev.d.appendfsync == "everysec" and crash else lost).append(job_id)
        elif h.get("state") not in TERMINAL:
            stuck.append(job_id)
            stuck_states[h.get("state", "?")] += 1
    for job_id in lost[:5]:
        ev.find(f"lost: {job_id} (acknowledged, no record)")
    owners = Counter(ev.d.records[j].get("owner") or "-" for j in stuck)
    for job_id in stuck[:10]:
        ev.details.append({"job": job_id, "stuck": ev.d.records[job_id], "events": ev.d.events.get(job_id, [])})
    for job_id in stuck[:5]:
        h = ev.d.records[job_id]
        ev.find(
            f"stuck: {job_id} state={h.get('state')} owner={h.get('owner') or '-'} "
            f"attempts={h.get('attempts', 0)} expiries={h.get('expiries', 0)}"
        )
    dead = [h for j, h in ev.d.records.items() if j in ev.d.acked and h.get("state") == "dead"]
    reasons = Counter(error_kind(h.get("error", "")) for h in dead)
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


def results(ev: Evidence) -> dict[str, Any]:
    wrong: Counter[str] = Counter()
    stray = rewritten = 0
    counted: set[str] = set()
    for job_id, original in ev.d.sent.items():
        h = ev.d.records.get(job_id)
        if h is not None and decode(h.get("input")) != original:
            rewritten += 1
            if h.get("state") == "succeeded":
                counted.add(job_id)
                wrong["input_rewritten"] += 1
                ev.find(
                    f"wrong result: {job_id}: input_rewritten: stored {h.get('input', '')[:90]} "
                    f"for {orjson.dumps(original).decode()[:90]}"
                )
    for job_id, h in ev.d.records.items():
        key = h.get("output_key") or f"results/{job_id}.json"
        if h.get("state") != "succeeded":
            stray += ev.d.outputs.get(key) is not None
            continue
        problem = None if job_id in counted else _wrong(ev, job_id, h, key)
        if problem:
            wrong[problem.split(":")[0]] += 1
            ev.find(f"wrong result: {job_id}: {problem}")
    return {
        "wrong_results": sum(wrong.values()),
        "wrong_by_kind": dict(wrong),
        "inputs_rewritten": rewritten,
        "outputs_of_unfinished_jobs": stray,
    }


def _wrong(ev: Evidence, job_id: str, h: dict[str, str], key: str) -> str | None:
    if h.get("result") != f"s3://{ev.d.bucket}/{key}":
        return f"result location: {h.get('result')!r} is not its output key {key}"
    blob = ev.d.outputs.get(key)
    if blob is None:
        return "missing: succeeded but nothing stored at its output key"
    try:
        stored = orjson.loads(blob)
    except orjson.JSONDecodeError:
        return "unreadable: the stored output is not JSON"
    expected = decode(h.get("input"))
    if ev.d.synchronous:
        return _wrong_answer(ev, h, stored, expected)
    if not isinstance(stored, dict) or stored.get("echo") != expected:
        echo = stored.get("echo") if isinstance(stored, dict) else None
        return f"foreign: output echoes {str(echo)[:80]} instead of its own input"
    originals = stored.get("_offload_files") or {}
    for url, location in originals.items():
        m = SIM_JOB.search(url)
        if m is None:
            continue
        remote = m[1]
        if ev.remote_input.get(remote) != decode_input_id(h.get("input")):
            return f"foreign run: file of remote job {remote}, not a submission of this job's input"
        file_key = str(location).removeprefix(f"s3://{ev.d.bucket}/")
        name = url.rsplit("/", 1)[-1]
        parsed = parse_name(name)
        got = ev.d.files.get(file_key)
        if got is None:
            return f"file missing: {file_key}"
        if parsed and got != file_bytes(name, parsed[1], 1024):
            return f"file mixed: {file_key} does not hold {name}"
    return None


def _wrong_answer(ev: Evidence, h: dict[str, str], stored: Any, expected: Any) -> str | None:
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
    if ev.remote_input.get(str(remote)) != decode_input_id(h.get("input")):
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


def finished_twice(ev: Evidence) -> dict[str, Any]:
    """A job must reach `succeeded` once: a second transition means two workers both completed it (a repeat
    of the same ack after a lost reply answers OK without a new event)."""
    twice = [j for j, evs in ev.d.events.items() if sum(state == "succeeded" for _, state in evs) > 1]
    for job_id in twice[:5]:
        ev.find(f"finished twice: {job_id} {ev.d.events[job_id]}")
    return {"finished_twice": len(twice)}
