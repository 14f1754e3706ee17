"""The run's verdict as people and programs read it: the JSON document (the last line of output), the short
human summary printed above it, and the saved evidence (`rundata.json`), which `python -m bench.chaos.report DIR`
judges again, e.g. with a newer checker."""

from __future__ import annotations

import base64
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from bench.chaos import hooks
from bench.chaos.checker import Checker, RunData
from bench.chaos.options import SYNCHRONOUS
from bench.chaos.procs import Incarnation
from bench.chaos.proxy import DroppedReply

if TYPE_CHECKING:
    from bench.chaos.run import Run

MAIN_QUEUE = "chaos"
# the checker's findings the document carries as they are, when the run judged them
COPIED = (
    "everysec_loss",
    "dead",
    "dead_by_reason",
    "dead_by_infra_error",
    "stuck_by_state",
    "wrong_by_kind",
    "outputs_of_unfinished_jobs",
    "killed_inside_submit_by",
    "gateway_errors",
    "gateway_resends",
    "uncounted_resends",
    "false_expiries",
    "resubmits_after_remote_end",
    "idempotent_replays",
    "replays_after_graceful_drain",
    "submissions",
    "cap",
    "held_released",
    "clock",
    "memory_mb",
    "memory_bounded",
    "events_bounded",
    "events",
    "cancels",
    "cancel_not_honoured",
    "submitted_after_cancel",
    "ran_after_cancel",
    "hostile",
    "valid_key_refused",
    "bad_keys_not_limited",
    "loris_not_cut",
    "ssrf_jobs",
    "ssrf_refused",
    "ssrf_fetched",
    "ssrf_copied",
)


def report(
    run: Run, summary: dict[str, Any], findings: list[str], all_terminal_s: float | None, wall: float, pidns: bool
) -> dict[str, Any]:
    kinds = run.schedule.counts
    doc: dict[str, Any] = {
        **_outcomes(run, summary, kinds, all_terminal_s),
        **_duplicates(summary, kinds),
        **_faults(run, summary, kinds, pidns),
        **_shape(run, wall),
    }
    for key in COPIED:
        if key in summary:
            doc[key] = summary[key]
    run.findings = findings
    exits = [e for e in run.schedule.timeline if e["kind"] == "worker_exit"]
    run.exit_notes = [f"{e['target']}#{e['n']} exit {e['code']}: {e['tail'][-200:]}" for e in exits[:3]]
    return doc


def _outcomes(run: Run, summary: dict[str, Any], kinds: dict[str, int], all_terminal_s: float | None) -> dict[str, Any]:
    """What became of the jobs: the invariants the harness holds."""
    return {
        "jobs": sum(1 for q, _, _ in run.acked.values() if q == MAIN_QUEUE),
        "lost": summary["lost"],
        "stuck": summary["stuck"],
        "wrong_results": summary["wrong_results"],
        "finished_twice": summary["finished_twice"],
        "duplicate_submissions": summary["duplicate_submissions"],
        "duplicates_by_cause": summary["duplicates_by_cause"],
        "kills": kinds["kill"],
        "valkey_restarts": kinds["valkey_restart"],
        "all_terminal_s": all_terminal_s,
    }


def _duplicates(summary: dict[str, Any], kinds: dict[str, int]) -> dict[str, Any]:
    """Duplicate submissions split into the expected (killed inside a submit) and the defects."""
    return {
        "defect_duplicates": summary["defect_duplicates"],
        "duplicates_not_killed_inside_submit": summary["duplicates_not_killed_inside_submit"],
        "duplicates_per_kill": round(
            summary["duplicates_by_cause"].get("killed_inside_submit", 0) / max(kinds["kill"], 1), 3
        ),
    }


def _faults(run: Run, summary: dict[str, Any], kinds: dict[str, int], pidns: bool) -> dict[str, Any]:
    """The faults injected, by kind, and what they cost."""
    return {
        "stops": kinds["stop"],
        "worker_exits": kinds["worker_exit"],
        "worker_exits_unexplained": summary["worker_exits_unexplained"],
        "oom_spells": kinds["oom"],
        "eviction_spells": kinds["eviction"],
        "paid_while_evicting": summary["paid_while_evicting"],
        "dead_by_oom": summary["dead_by_oom"],
        "pidns_restarts": kinds["restart"] if pidns else 0,
        "pidns": pidns,
        "dropped_replies": run.proxy.counts["dropped_replies"],
        "resets": kinds["reset"],
        "blackholes": kinds["blackhole"],
        "storms_429": kinds["storm_429"],
        "drains": summary.get("drains"),
        "failovers": kinds["failover"],
        "events_taken_back": run.samples["events_taken_back"],
        "worker_clock_skews": kinds["worker_clock"],
        "valkey_clock_steps": kinds["valkey_clock"],
        "sim_faults": _sum_faults(run.sim_stats.get("faults", {})),
    }


def _shape(run: Run, wall: float) -> dict[str, Any]:
    """How the run was set up and how busy its workers were."""
    in_flight = [n for n in run.samples["in_flight"] if n > 0]
    lives = [life for s in run.slots for life in s.lives]
    return {
        "in_flight_per_worker": run.in_flight,
        "leases_per_worker": {
            "mean": round(sum(in_flight) / max(len(in_flight), 1), 1),
            "peak": max(in_flight, default=0),
        },
        "aof": run.args.aof,
        "honour_idempotency_key": run.args.honour,
        "backend": run.args.backend,
        "synchronous": run.args.backend in SYNCHRONOUS,
        "enqueue_errors": run.counts["enqueue_errors"],
        "worker_processes": len(lives),
        "wall_s": round(wall, 1),
        "seed": run.args.seed,
        "minutes": run.p.minutes,
        "webhooks": hooks.summary(run.hook_log, run.server, run.schedule.timeline) if run.server is not None else None,
        "providers": run.provider_summary,
    }


def _sum_faults(faults: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for name, n in faults.items():
        out[name.split(" ", 1)[1] if " " in name else name] += n
    return dict(out)


def passed(doc: dict[str, Any]) -> bool:
    """The run's verdict: every guarantee held (the command exits 1 otherwise)."""
    failed = doc["lost"] or doc["stuck"] or doc["wrong_results"] or doc["finished_twice"] or doc["defect_duplicates"]
    failed = failed or any(doc.get(k) for k in ("cancel_not_honoured", "submitted_after_cancel", "ran_after_cancel"))
    failed = failed or doc.get("uncounted_resends") or doc.get("false_expiries")
    failed = failed or doc["worker_exits_unexplained"] or doc["paid_while_evicting"] or doc["dead_by_oom"]
    failed = failed or doc.get("replays_after_graceful_drain")
    failed = failed or doc.get("ssrf_fetched") or doc.get("ssrf_copied")
    failed = failed or (doc.get("providers") or {}).get("paid_at_both")
    failed = failed or ((doc.get("webhooks") or {}).get("server_restarts") or {}).get("bad")
    return not failed


def human(doc: dict[str, Any], run: Run) -> str:
    lines = [
        f"chaos run: {doc['jobs']} jobs (+{doc.get('cap', {}).get('jobs', 0)} capped), {run.p.workers} workers, "
        f"{doc['minutes'] * 60:.0f} s of faults, AOF {doc['aof']}, Idempotency-Key "
        f"{'honoured' if doc['honour_idempotency_key'] else 'ignored'} by the simulator; {run.pidns_note}",
        f"injected: {doc['kills']} SIGKILLs, {doc['stops']} SIGSTOPs past the lease, {doc['valkey_restarts']} "
        f"Valkey crashes, {doc['dropped_replies']} dropped replies, {doc['resets']} resets, {doc['blackholes']} "
        f"black-holes, {doc['storms_429']} 429 storms, {doc['failovers']} failovers "
        f"({doc['events_taken_back']} events read from the old primary taken back), provider faults "
        f"{doc['sim_faults']}, drains {doc['drains']}",
        f"in flight per worker: mean {doc['in_flight_per_worker']['mean']}, peak {doc['in_flight_per_worker']['peak']}",
        f"lost {doc['lost']}, stuck {doc['stuck']}, wrong results {doc['wrong_results']}, finished twice "
        f"{doc['finished_twice']}, dead {doc.get('dead')}, "
        f"all terminal {doc['all_terminal_s']} s after the faults stopped",
        f"duplicate submissions {doc['duplicate_submissions']} ({doc['duplicates_per_kill']} killed-inside-submit "
        f"per kill): {doc['duplicates_by_cause']}",
        f"cap {doc.get('cap')}, held released {doc.get('held_released')}, worker exits {doc['worker_exits']} "
        f"({doc['worker_exits_unexplained']} unexplained)",
        f"gateway 5xx after accept {doc.get('gateway_errors')}, sent again {doc.get('gateway_resends')} (uncounted "
        f"{doc.get('uncounted_resends')}); dead as expired while the remote job lived {doc.get('false_expiries')}",
        f"store memory: {doc['oom_spells']} spells at maxmemory, {doc['dead_by_oom']} dead of it; "
        f"{doc['eviction_spells']} spells of an evicting policy, {doc['paid_while_evicting']} paid meanwhile",
        f"clock: {doc['worker_clock_skews']} worker restarts with a skewed clock, {doc['valkey_clock_steps']} steps "
        f"of Valkey's clock: {doc.get('clock')}",
    ]
    if doc.get("webhooks"):
        lines.append(f"webhooks (through offload server): {doc['webhooks']}")
    if doc.get("providers"):
        pv = doc["providers"]
        lines.append(
            f"two providers: jobs per backend {pv['jobs_per_backend']}, moved to the second {pv['moved_share']:.1%}, "
            f"paid at both {pv['paid_at_both']} {pv['paid_at_both_examples']}"
        )
    if doc.get("cancels"):
        lines.append(
            f"cancels {doc['cancels']}: not honoured {doc['cancel_not_honoured']}, submitted after the cancel "
            f"{doc['submitted_after_cancel']}, remote job left running {doc['ran_after_cancel']}"
        )
    if doc.get("ssrf_jobs"):
        lines.append(
            f"ssrf: {doc['ssrf_jobs']} inputs named an internal service, {doc['ssrf_refused']} refused, "
            f"{doc['ssrf_fetched']} fetches of it, {doc['ssrf_copied']} copies stored"
        )
    lines += [f"  ! {f}" for f in run.findings[:25]] + [f"  ! worker {n}" for n in run.exit_notes]
    lines.append(f"{'PASS' if passed(doc) else 'FAIL'}; logs and data in {run.out}")
    return "\n".join(lines)


# -- saved runs: `python -m bench.chaos.report DIR` judges a run's rundata.json again ----------------------


def save(data: RunData, path: Path) -> None:
    """Everything the checker read, so a run can be judged again (by a newer checker) without re-running it."""
    doc = {k: v for k, v in data.__dict__.items() if k not in ("outputs", "files", "lives", "dropped")}
    doc["outputs"] = {k: None if v is None else base64.b64encode(v).decode() for k, v in data.outputs.items()}
    doc["files"] = {k: None if v is None else base64.b64encode(v).decode() for k, v in data.files.items()}
    doc["lives"] = {
        slot: [life.__dict__ | {"log": str(life.log)} for life in lives] for slot, lives in data.lives.items()
    }
    doc["dropped"] = [d.__dict__ for d in data.dropped]
    path.write_bytes(orjson.dumps(doc, option=orjson.OPT_NON_STR_KEYS))


def load(path: Path) -> RunData:
    doc = orjson.loads(path.read_bytes())
    doc["outputs"] = {k: None if v is None else base64.b64decode(v) for k, v in doc["outputs"].items()}
    doc["files"] = {k: None if v is None else base64.b64decode(v) for k, v in doc["files"].items()}
    doc["lives"] = {
        slot: [Incarnation(**(life | {"log": Path(life["log"])})) for life in lives]
        for slot, lives in doc["lives"].items()
    }
    doc["dropped"] = [DroppedReply(**d) for d in doc["dropped"]]
    doc["slot_ports"] = {int(k): v for k, v in doc["slot_ports"].items()}
    doc["acked"] = {k: tuple(v) for k, v in doc["acked"].items()}
    doc["events"] = {k: [tuple(e) for e in v] for k, v in doc["events"].items()}
    doc["valkey_down"] = [tuple(x) for x in doc["valkey_down"]]
    for spans in ("full", "evicting"):  # (absent from runs saved before the store's memory faults)
        doc[spans] = [tuple(x) for x in doc.get(spans, [])]
    return RunData(**doc)


if __name__ == "__main__":
    import sys

    data = load(Path(sys.argv[1]) / "rundata.json")
    checker = Checker(data)
    verdict = checker.verdict()
    faults = [
        e["t"] for e in data.timeline if e["kind"] not in ("restart", "worker_exit", "cont", "worker_clock_skipped")
    ]
    if faults:  # the fault phase, as far as the timeline tells
        main_slots = [slot for slot in data.lives if slot != "c1"]
        verdict.summary["in_flight_per_worker"] = checker.in_flight(main_slots, (min(faults), max(faults)))
    print("\n".join(verdict.findings[:30]))
    print(orjson.dumps(verdict.summary).decode())
