"""`python -m bench.chaos`: one run of the fault harness, from a clean slate to a verdict.

Starts Valkey (AOF `always` or `everysec`, its wall clock steppable: libfaketime, bench/chaos/faketime.py),
`rclone serve s3`, the simulator (one port per worker slot) and the fault proxy; writes an offload.yaml per worker
slot (Valkey through the proxy, the simulator's port for that slot, S3); with the `failover` fault, a replica too
(bench/chaos/failover.py) and `durability` on for every writer; starts the workers (in PID namespaces where the
machine allows it); enqueues through the proxy for the fault phase while the schedule breaks things; then heals
everything, rolls the capped queue's window over and waits until every acknowledged job is terminal
(bench/chaos/settle.py), and hands the
job store, the submission log and the bucket to the checker. Prints a short human summary, and as its last line the
JSON verdict.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import random
import signal
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import orjson
import redis.asyncio as aioredis
import yaml
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from bench.chaos import collect, egress, failover, hostile, providers, report
from bench.chaos.checker import Checker, RunData
from bench.chaos.eventlog import EventLog
from bench.chaos.faketime import ClockFile
from bench.chaos.faults import Profile, Schedule
from bench.chaos.hooks import Deploys, Server, check_backend
from bench.chaos.operator import Operator
from bench.chaos.options import API_ROOTS, BACKENDS, SYNCHRONOUS, parse_args, profile_for
from bench.chaos.procs import HOST, S3, Sim, Valkey, WorkerSlot, base_env, pidns_support, signal_group
from bench.chaos.producer import INGEST_LIST, QUEUE, Producer
from bench.chaos.proxy import FaultProxy
from bench.chaos.settle import Settle
from offload.connection import connect
from offload.eventloop import within
from offload.queue.durability import Durability
from offload.queue.scripts import NAMES, SCRIPTS
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.redis_client import Entry
from offload.testing.sim.store import input_key

log = logging.getLogger("chaos")
CAPPED, BUCKET = "capped", "chaos-results"
STORE_CHECK_S = 1.0  # the workers' policy re-read (OFFLOAD_STORE_CHECK_S)


def worker_config(
    path: Path,
    redis_url: str,
    s3: S3,
    base_url: str,
    backend: str,
    p: Profile,
    server: Server | None = None,
    n_providers: int = 1,
) -> Path:
    queue: dict[str, Any] = {"backend": "sim", "max_attempts": p.max_attempts, "poll_interval": 2, "poll_timeout": 300}
    if p.submit_concurrency is not None:
        queue["submit_concurrency"] = p.submit_concurrency
    hooks = server.backend(backend, base_url, p) if server else {}
    limit = {"rate_limit": p.rate_limit} if p.rate_limit else {}
    config: dict[str, Any] = {
        "redis_url": redis_url,
        "storage": s3.settings(),
        "backends": {
            "sim": {
                "kind": backend,
                "base_url": base_url + API_ROOTS.get(backend, ""),
                "api_key": "sim-key",
                "timeout": 30,
                "not_found_grace_s": p.not_found_grace_s,
                # one provider served on a port per worker slot: a job adopted by another slot's worker (a webhook,
                # a listing) names its files on the first slot's port, which is not this base_url's own origin;
                # only HOST, so the ssrf fault's `localhost` stays refused
                "allow_private_hosts": True,
                "file_hosts": [HOST],
                **limit,
                **BACKENDS[backend],
                **hooks,
            }
        },
        "queues": {
            QUEUE: {**queue, "concurrency": p.concurrency, "ingest_list": INGEST_LIST},
            CAPPED: {**queue, "concurrency": 16, "daily_job_cap": p.daily_job_cap},
        },
    }
    if n_providers == 2:  # the main queue routes to two providers (the capped queue keeps the first)
        config["queues"][QUEUE] = {**config["queues"][QUEUE], **providers.queue_block(config["backends"], backend)}
        del config["queues"][QUEUE]["backend"]
    if server is not None:
        config["server"] = {"public_url": server.url}
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


HELD_MS = 1000  # an event id this far ahead of the store's clock was held by a step back (steps are 300 s or more)


class Run:
    """One harness run; `main` drives it phase by phase and every wait in it is bounded."""

    def __init__(self, args: argparse.Namespace, profile: Profile, out: Path) -> None:
        self.args, self.p, self.out = args, profile, out
        self.rng = random.Random(args.seed)
        self.internal = egress.Internal() if profile.ssrf_share > 0 else None  # the ssrf fault's target
        self.producer = Producer(profile, self.rng, args.backend, self.internal)
        self.acked = self.producer.acked
        self.sent = self.producer.sent  # job id -> the input as the producer sent it
        self.counts = self.producer.counts
        self.events: dict[str, list[tuple[float, str]]] = defaultdict(list)
        self.log = EventLog()  # what each stream entry added to `events`, for a failover to take back
        self.samples: dict[str, Any] = {"in_flight": [], "events_taken_back": 0}
        self.stop_background = asyncio.Event()
        self.findings: list[str] = []  # set by report.report
        self.exit_notes: list[str] = []

    async def main(self) -> dict[str, Any]:
        p, args = self.p, self.args
        pidns, why = (False, "disabled by --no-pidns") if args.no_pidns else pidns_support()
        self.pidns_note = "restarts keep host:pid (PID namespace)" if pidns else f"no PID namespaces: {why}"
        self.clock = ClockFile(self.out / "valkey-clock")
        self.clock_events: list[tuple[str, float, int]] = []  # (queue, when, step ms): the queues' clock_stepped_back
        self.valkey = await asyncio.to_thread(Valkey(self.out / "valkey", args.aof, self.clock).start)
        self.s3 = await asyncio.to_thread(S3(self.out / "s3", BUCKET).start)
        self.sim = await asyncio.to_thread(Sim(self.out, p.workers + 1).start)
        self.slots: list[WorkerSlot] = []
        self.server: Server | None = None
        self.provider_summary: dict[str, Any] | None = None  # --providers 2: jobs per backend, paid at both
        self.failover: failover.Failover | None = None
        self.hook_log: list[dict[str, Any]] = []  # the simulator's webhook deliveries (with --webhooks)
        try:
            return await self._run(pidns)
        finally:
            for slot in self.slots:  # normally already drained; after an error or Ctrl+C, gone for sure
                if slot.proc is not None and slot.proc.poll() is None:
                    signal_group(slot.proc, signal.SIGKILL)
            if self.failover is not None:
                await self.failover.close()
            internal = self.internal.stop if self.internal else None
            for stop in (
                internal,
                self.server.stop if self.server else None,
                self.sim.stop,
                self.s3.stop,
                self.valkey.stop,
            ):
                if stop is None:
                    continue
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(stop)

    async def _run(self, pidns: bool) -> dict[str, Any]:
        store = await self._start(pidns)
        self._schedule()
        background = [asyncio.create_task(self._tail_events()), asyncio.create_task(self._sample())]
        started = time.time()
        await self._fault_phase(started)
        healed = time.time()
        await self._heal()
        self.settle = Settle(self.direct, self.slots[-1], self.clock, list(self.acked), CAPPED, self.p.daily_job_cap)
        settle = self.args.settle if self.args.settle is not None else (50.0 if self.args.quick else 180.0)
        all_terminal = await self.settle.run(settle)
        all_terminal_s = None if all_terminal is None else round(all_terminal - healed, 1)
        records = await collect.records(
            self.direct, (QUEUE, CAPPED)
        )  # the job store after quiescence, before the workers drain
        for slot in self.slots:
            await asyncio.to_thread(slot.terminate)
        self.stop_background.set()
        await asyncio.gather(*background, return_exceptions=True)
        await self.schedule.close()
        data = await self._gather(records)
        if self.args.providers == 2:
            self.provider_summary = providers.summary(
                {j: h for j, h in records.items() if j.startswith(f"{QUEUE}:")}, data.submissions, QUEUE
            )
        await asyncio.to_thread(report.save, data, self.out / "rundata.json")
        checker = Checker(data)
        verdict = checker.verdict()
        self.in_flight = checker.in_flight([s.name for s in self.slots[:-1]], (started, healed))
        await self.proxy.close()
        await store.redis.aclose()
        await self.direct.aclose()
        doc = report.report(self, verdict.summary, verdict.findings, all_terminal_s, time.time() - started, pidns)
        evidence = {
            "summary": doc,
            "findings": verdict.findings,
            "details": verdict.details,
            "timeline": self.schedule.timeline,
            "dropped": [d.__dict__ for d in self.proxy.dropped],
            "lives": {s.name: [life.__dict__ | {"log": str(life.log)} for life in s.lives] for s in self.slots},
        }
        (self.out / "report.json").write_bytes(orjson.dumps(evidence, default=str, option=orjson.OPT_INDENT_2))
        return doc

    async def _start(self, pidns: bool) -> QueueStore:
        """The proxy (and with the failover fault the replica), the server, the workers and the capped queue's
        jobs; returns the operator's store once every worker is up."""
        p = self.p
        durable = await self._start_proxies()
        await asyncio.to_thread(self.sim.post, "/_sim/config", p.sim_config(self.args.seed, self.args.honour))
        env = base_env(
            CHAOS_S3_SECRET=self.s3.secret_key,
            OFFLOAD_LEASE_MS=str(p.lease_ms),
            OFFLOAD_REDIS_CONNECT_TIMEOUT="60",
            OFFLOAD_STORE_CHECK_S=str(STORE_CHECK_S),  # how soon an evicting policy must stop the payments
            **durable,
        )
        await self._start_server(env)
        for n in range(p.workers + 1):
            name, queue = (f"w{n + 1}", QUEUE) if n < p.workers else ("c1", CAPPED)
            cfg = worker_config(
                self.out / f"offload-{name}.yaml",
                self.proxy.url,
                self.s3,
                self.sim.slot_url(n),
                self.args.backend,
                p,
                self.server,
                self.args.providers,
            )
            self.slots.append(WorkerSlot(name, queue, cfg, env, self.out, concurrency=p.concurrency, pidns=pidns))
        self.direct = aioredis.Redis.from_url(
            self.read_url, decode_responses=True, socket_timeout=10, retry=Retry(NoBackoff(), 0)
        )
        store = QueueStore(await connect(self.read_url), durability=self.durability)
        capped = [
            JobSpec(input=self.producer.input(f"cap-{i}"), max_attempts=p.max_attempts) for i in range(p.capped_jobs)
        ]
        for job_id, spec in zip(await store.enqueue_many(CAPPED, capped), capped, strict=True):
            self.acked[job_id] = (CAPPED, input_key(spec.input), time.time())
        for slot in self.slots:
            slot.start()
        await self._until(lambda: all(s.current and s.current.read_id() for s in self.slots), 90, "workers up")
        self.operator = Operator(store, self.direct, self.rng, p.lease_ms)
        return store

    async def _start_proxies(self) -> dict[str, str]:
        """The fault proxy every client goes through; with the failover fault also the replica and the harness's
        own proxy without faults that follows the failovers. Returns the writers' environment for durability."""
        names = {getattr(SCRIPTS, n).sha: n for n in NAMES}
        self.proxy = await FaultProxy((HOST, self.valkey.port), seed=self.args.seed, script_names=names).start()
        self.read_url = self.valkey.url  # where the harness reads the job store itself
        self.durability: Durability | None = None  # the producer's
        durable: dict[str, str] = {}
        if self.p.failover_every > 0:
            front = await FaultProxy((HOST, self.valkey.port)).start()
            self.failover = await failover.Failover(self.out, self.valkey, [self.proxy, front], [QUEUE, CAPPED]).start()
            self.read_url, durable = front.url, failover.ENV
            self.durability = Durability(replicas=1, timeout_ms=failover.TIMEOUT_MS)
        self.producer.url, self.producer.durability = self.proxy.url, self.durability
        return durable

    async def _start_server(self, env: dict[str, str]) -> None:
        """With --webhooks: `offload server` receiving the simulator's webhooks, through the proxy like every
        client (see hooks.py); the simulator signs and faults them."""
        if not self.args.webhooks:
            return
        self.server = Server(self.out, {**env, "OFFLOAD_ADMIN_KEY": hostile.ADMIN_KEY})
        await asyncio.to_thread(self.sim.post, "/_sim/webhooks", self.server.sim_faults(self.p))
        config = worker_config(
            self.out / "offload-server.yaml",
            self.proxy.url,
            self.s3,
            self.sim.url,
            self.args.backend,
            self.p,
            self.server,
        )
        await asyncio.to_thread(self.server.start, config, "--body-timeout", str(hostile.BODY_TIMEOUT_S))

    def _schedule(self) -> None:
        self.schedule = Schedule(
            self.p,
            self.rng,
            self.slots,
            self.valkey,
            self.proxy,
            self.sim,
            operator=self._cancel_one,
            burst=self.producer.burst,
            failover=self.failover,
        )

    async def _fault_phase(self, started: float) -> None:
        """The producer enqueues while the schedule (and with the server, the attacker) breaks things."""
        p = self.p
        fault_s = p.minutes * 60
        producer = asyncio.create_task(self.producer.produce(started + fault_s * 0.85))
        self.schedule.start()
        attacker = hostile.Hostile(self.schedule, self.server.url, QUEUE, self.server.quiet) if self.server else None
        if attacker is not None and p.hostile_every > 0:
            attacker.start(p.hostile_every)
        deploys = Deploys(self.schedule, self.server) if self.server else None
        if deploys is not None and p.server_restart_every > 0:
            deploys.start(p.server_restart_every)
        log.warning("fault phase: %.0f s, %s", fault_s, self.pidns_note)
        down = None
        if self.args.providers == 2:
            down = asyncio.create_task(providers.outage(self.sim, self.args.backend, fault_s, self.schedule.note))
        await asyncio.sleep(fault_s)
        if down is not None:
            await within(down, 60)
        for stoppable in (attacker, deploys):
            if stoppable is not None:
                await stoppable.stop()
        await self.schedule.stop()
        await within(self.operator.settle(), 130)  # its resume retries for up to 120 s
        await within(producer, 120)

    async def _cancel_one(self) -> dict[str, Any] | None:
        return await self.operator.cancel_one(self.schedule.timeline)

    async def _until(self, check: Callable[[], object], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}; logs in {self.out}")
            await asyncio.sleep(0.2)

    async def _tail_events(self) -> None:
        """Every transition of every job, read straight from Valkey (not through the proxy) while it happens: the
        checker needs to know when a remote id was recorded, long after the capped stream has moved on."""
        streams = {f"offload:{{{q}}}:events": "0-0" for q in (QUEUE, CAPPED)}
        biggest = failovers = 0
        read: set[int] = set()  # entries read (after a failover's rewind, those read again are skipped)
        client = aioredis.Redis.from_url(
            self.read_url, decode_responses=True, socket_timeout=5, retry=Retry(NoBackoff(), 0)
        )
        while not self.stop_background.is_set():
            if self.failover is not None and self.failover.switches > failovers:
                # read on from the promoted replica's last entry: what was read past it from the old primary never
                # happened to the new one (taken back here), and the new primary's ids may be below it (held by a
                # clock step)
                failovers = self.failover.switches
                for q, kept in self.failover.kept_ids.items():
                    streams[f"offload:{{{q}}}:events"] = kept
                    self.samples["events_taken_back"] += self.log.take_back(f"offload:{{{q}}}:events", kept)
            try:
                reply = await client.xread(streams, count=5000, block=300)  # type: ignore[arg-type]
                got = cast(list[tuple[str, list[Entry]]] | None, reply)  # RESP2, decoded
            except (RedisError, OSError):
                await asyncio.sleep(0.2)
                continue
            received = time.time()
            if self.failover is not None and self.failover.switches > failovers:
                # the switch cut this read's connection after its reply came: the old primary's, read before it
                received = self.failover.switched_at - 0.001
            store_ms = None
            if got:  # (the store's clock now: an id ahead of it was held there by a step back, see _event_time)
                with contextlib.suppress(RedisError, OSError):
                    seconds, micros = await client.time()
                    store_ms = int(seconds) * 1000 + int(micros) // 1000
            for stream, entries in got or []:
                for entry_id, fields in entries:
                    streams[stream] = entry_id
                    entry = hash((stream, entry_id, fields.get("state"), fields.get("jobs"), fields.get("id")))
                    if entry in read:
                        continue
                    read.add(entry)
                    at = self._event_time(int(entry_id.split("-")[0]), received, store_ms)
                    if fields.get("state") == "clock_stepped_back":
                        step = (stream.split("{")[1].split("}")[0], at, int(fields["step_ms"]))
                        self.log.add(stream, entry_id, self.clock_events, step)
                    ids = (fields.get("jobs") or fields.get("id") or "").split()
                    biggest = max(biggest, len(ids))
                    for job_id in ids:
                        self.log.add(stream, entry_id, self.events[job_id], (at, fields.get("state", "?")))
        self.samples["event_ids_max"] = biggest
        await client.aclose()

    def _event_time(self, entry_ms: int, received: float, store_ms: int | None = None) -> float:
        """When an event happened on the true clock (the one the simulator stamps submissions with). Its stream id
        is the store's ms: off by the store's clock offset at the time, and held at the last id after a step back
        (ids only grow, so for as long as the step they name the moment of the step). An id ahead of the store's
        clock as read right after it (`store_ms`) is such a held one: the read itself, as the moment of the step
        would be seconds early (and a remote id recorded after a submission would seem recorded before it). Else,
        once the clock has been stepped: the id less an offset, where that time falls while the offset was in
        force and just before the read; else the read itself (events are read as they come, a moment late)."""
        if store_ms is not None and entry_ms > store_ms + HELD_MS:
            return received
        at = entry_ms / 1000
        history = self.clock.history
        if len(history) == 1 and history[0][1] == 0:
            return at
        # ids name the moment of a step back for as long as it: after one, only a reading just before the read fits
        lag = 2.0 if any(b[1] < a[1] for a, b in itertools.pairwise(history)) else 30.0
        fits = []
        for i, (start, offset) in enumerate(history):
            end = history[i + 1][0] if i + 1 < len(history) else float("inf")
            t = at - offset
            if start - 0.5 <= t <= end + 0.5 and received - lag <= t <= received + 0.05:
                fits.append(t)
        return max(fits) if fits else received

    async def _sample(self) -> None:
        """Valkey memory, the events streams' length and jobs in flight per live worker, every 2 s."""
        peak = length = 0
        while not self.stop_background.is_set():
            await asyncio.sleep(2)
            with contextlib.suppress(RedisError, OSError):
                memory = await self.direct.info("memory")
                peak = max(peak, int(memory["used_memory"]))
                self.samples["used_memory"] = int(memory["used_memory"])
                for q in (QUEUE, CAPPED):
                    length = max(length, int(await self.direct.xlen(f"offload:{{{q}}}:events")))
                if not self.schedule._stopping:
                    for slot in self.slots[:-1]:
                        life = slot.current
                        if life and life.read_id() and not slot.stopped:
                            owned = await self.direct.zcard(f"offload:{{{QUEUE}}}:owned:{life.worker_id}")
                            self.samples["in_flight"].append(int(owned))
        self.samples["used_memory_peak"] = peak
        self.samples["events_len_max"] = length

    async def _heal(self) -> None:
        """No more faults: the simulator behaves, stopped workers continue, dead slots are started again."""
        healthy = {
            "error_rate": 0,
            "rate_429": 0,
            "lost_response_rate": 0,
            "submit_latency": 0,
            "gateway_error_rate": 0,
        }
        await asyncio.to_thread(self.sim.post, "/_sim/config?merge=true", {"default": healthy})
        await asyncio.to_thread(self.sim.post, "/_sim/outage", {"mode": None})
        if self.server is not None:
            healed = {**self.server.sim_faults(self.p), "drop_rate": 0, "duplicate_rate": 0, "reorder_rate": 0}
            await asyncio.to_thread(self.sim.post, "/_sim/webhooks", healed | {"delay_s": 0})
        for slot in self.slots:
            slot.sigcont()
            if slot.current and slot.current.clock_skew_s:  # back on the true clock
                await asyncio.to_thread(slot.terminate)
            if not slot.running:
                slot.start()
        if self.clock.offset_s:
            self.clock.set(0.0)

    async def _gather(self, records: dict[str, dict[str, str]]) -> RunData:
        submissions = await asyncio.to_thread(self.sim.submissions)
        self.sim_stats = await asyncio.to_thread(self.sim.get, "/_sim/stats")
        if self.server is not None:
            self.hook_log = (await asyncio.to_thread(self.sim.get, "/_sim/webhooks"))["deliveries"]
        outputs, files = await asyncio.to_thread(collect.bucket, self.s3.client(), BUCKET, records)
        return RunData(
            acked=self.acked,
            sent=self.sent,
            records=records,
            submissions=submissions,
            outputs=outputs,
            files=files,
            lives={s.name: s.lives for s in self.slots},
            slot_ports={port: self.slots[n].name for n, port in enumerate(self.sim.slot_ports)},
            timeline=self.schedule.timeline,
            valkey_down=self.schedule.valkey_down,
            full=self.schedule.full,
            evicting=self.schedule.evicting,
            store_check_s=STORE_CHECK_S,
            appendfsync=self.args.aof,
            events=self.events,
            dropped=self.proxy.dropped,
            bucket=BUCKET,
            capped_queue=CAPPED,
            clock_events=self.clock_events,
            daily_job_cap=self.p.daily_job_cap,
            cap_rolled_at=self.settle.rolls[0] if self.settle.rolls else None,
            cap_rolls=self.settle.rolls,
            held_at_roll=self.settle.held_at_roll,
            counted_day1=self.settle.counted,
            unsent_day1=self.settle.unsent,
            samples=self.samples,
            synchronous=self.args.backend in SYNCHRONOUS,
            honoured=self.args.honour,
            internal_url=self.internal.url if self.internal else None,
            internal_hits=list(self.internal.hits) if self.internal else [],
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.webhooks:
        check_backend(args.backend)
    providers.check(args.backend, args.providers, args.webhooks)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", stream=sys.stderr)
    if args.autoscale:
        from bench.chaos.autoscale import main as autoscale_main

        print(json.dumps(autoscale_main(args)))
        return
    if args.hybrid:
        from bench.chaos.hybrid import main as hybrid_main

        doc = hybrid_main(args)
        print(json.dumps(doc), flush=True)
        if not doc["ok"]:
            raise SystemExit(1)
        return
    out = args.out or Path(tempfile.mkdtemp(prefix="offload-chaos-"))
    out.mkdir(parents=True, exist_ok=True)
    run = Run(args, profile_for(args), out)
    doc = asyncio.run(run.main())
    doc["passed"] = report.passed(doc)
    print(report.human(doc, run), flush=True)
    print(json.dumps(doc), flush=True)
    if not doc["passed"]:
        raise SystemExit(1)  # CI and scripts see a failed verdict in the exit status, not only in the text
