"""The fault harness's producer: enqueues through the fault proxy (plain batches, batches with idempotency keys,
single jobs, the tutorial's JSON on the ingest list, the drain fault's bursts) and records what was acknowledged.
Only an enqueue that returned counts as acknowledged."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import defaultdict
from typing import Any

import orjson
from redis.exceptions import RedisError

from bench.chaos import egress
from bench.chaos.faults import Profile
from bench.chaos.options import MODEL
from offload.connection import connect
from offload.errors import StoreError, StoreFull
from offload.eventloop import within
from offload.queue.durability import Durability
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.testing.sim.store import input_key

log = logging.getLogger("chaos")
QUEUE = "chaos"
INGEST_LIST = "chaos:jobs"


class Producer:
    """Writes jobs of `QUEUE` to the store at `url`; `acked` (job id -> (queue, input id, when)) and `sent` (job
    id -> the input as sent) hold what the store acknowledged, `counts` the enqueue errors and bursts."""

    def __init__(
        self,
        p: Profile,
        rng: random.Random,
        backend: str,
        internal: egress.Internal | None,
    ) -> None:
        self.p, self.rng, self.backend, self.internal = p, rng, backend, internal
        self.url = ""  # the fault proxy's, set once it listens
        self.durability: Durability | None = None
        self.acked: dict[str, tuple[str, str, float]] = {}
        self.sent: dict[str, Any] = {}
        self.counts: dict[str, int] = defaultdict(int)

    def input(self, input_id: str) -> dict[str, Any]:
        """Distinct per job and echoed back by the simulator, so a result stored for the wrong job shows. For a
        chat-completions backend it is a request body the API accepts (model, messages); the id and the salt
        ride in `metadata` (string values, as OpenAI's metadata takes), where the simulator's submission log
        finds the id (`offload.testing.sim.store.input_key`) and its answer echoes the whole body back."""
        salt = self.rng.getrandbits(48)
        if self.backend == "openai":
            prompt = {"role": "user", "content": f"chaos {input_id} {salt}"}
            return {"model": MODEL, "messages": [prompt], "metadata": {"id": input_id, "salt": str(salt)}}
        return {"id": input_id, "prompt": f"chaos {input_id}", "salt": salt}

    async def produce(self, until: float) -> None:
        """Enqueue through the proxy: plain batches, batches with idempotency keys (retried with the same keys
        after an error) and single jobs. Only an enqueue that returned counts as acknowledged."""
        client = await connect(self.url, retry_for=60)
        store = QueueStore(client, durability=self.durability)
        n, tick = 0, time.time()
        began = tick
        while time.time() < until:
            due = self.p.jobs_per_s * (time.time() - began + 0.5)  # catch up after a slow batch (an outage)
            size = min(500, max(1, round(due - n)))
            mode = self.rng.choice(("plain", "keyed", "single", "tutorial"))
            specs = []
            for _ in range(size):
                n += 1
                job_input = self.input(f"job-{n}")
                if self.internal is not None and self.rng.random() < self.p.ssrf_share:
                    job_input = egress.hostile(job_input, self.internal.url, f"job-{n}")
                key = input_key(job_input) if mode == "keyed" else None
                specs.append(JobSpec(input=job_input, max_attempts=self.p.max_attempts, idempotency_key=key))
            for attempt in range(3 if mode == "keyed" else 1):
                try:
                    if mode == "tutorial":  # the tutorial's producer: RPUSH its JSON, ingested by the workers
                        ids = await self._push_tutorial(client, specs)
                    elif mode == "single":
                        ids = [await within(store.enqueue(QUEUE, spec), 30) for spec in specs]
                    else:
                        ids = await within(store.enqueue_many(QUEUE, specs), 30)
                except (RedisError, OSError, TimeoutError, StoreFull) as exc:  # (StoreFull: at maxmemory)
                    self.counts["enqueue_errors"] += 1
                    log.info("enqueue (%s, try %d) failed: %s", mode, attempt + 1, exc)
                    continue
                now = time.time()
                for job_id, spec in zip(ids, specs, strict=True):
                    self.acked[job_id] = (QUEUE, input_key(spec.input), now)
                    self.sent[job_id] = spec.input
                break
            tick += 0.5
            await asyncio.sleep(max(0.0, tick - time.time()))
        await client.aclose()

    async def burst(self, n: int) -> None:
        """`n` jobs at once (the drain fault's burst), through the proxy like every enqueue; acknowledged only if
        the enqueue returned."""
        self.counts["bursts"] += 1  # (every burst its own inputs, also when no job was acknowledged in between)
        tag = self.counts["bursts"]
        specs = [JobSpec(input=self.input(f"burst-{tag}-{i}"), max_attempts=self.p.max_attempts) for i in range(n)]
        try:
            client = await connect(self.url, retry_for=10)
            try:
                ids = await within(QueueStore(client, durability=self.durability).enqueue_many(QUEUE, specs), 30)
            finally:
                await client.aclose()
        except (RedisError, OSError, TimeoutError, StoreError) as exc:
            self.counts["enqueue_errors"] += 1
            log.info("burst enqueue failed: %s", exc)
            return
        now = time.time()
        for job_id, spec in zip(ids, specs, strict=True):
            self.acked[job_id] = (QUEUE, input_key(spec.input), now)
            self.sent[job_id] = spec.input

    async def _push_tutorial(self, client: Any, specs: list[JobSpec]) -> list[str]:
        """Tutorial JSON (`id`, `input`, `output_key`, `attempt`) on the ingest list, one RPUSH for the batch. The
        input carries an integer past 14 digits and an empty list, which must survive ingestion byte for byte."""
        entries = []
        for spec in specs:
            spec.input.update(big=12345678901234567, tags=[])  # (the simulator's chat endpoint takes extra fields)
            tid = input_key(spec.input).replace("job-", "t-")
            spec.input.get("metadata", spec.input)["id"] = tid  # where input_key found it
            entries.append(
                orjson.dumps({"id": tid, "input": spec.input, "output_key": f"results/{tid}.json", "attempt": 1})
            )
        if self.durability is None:
            await within(client.rpush(INGEST_LIST, *entries), 30)
        else:  # a durable tutorial producer WAITs for the replica after its RPUSH, on the same connection
            pipe = client.pipeline(transaction=False)
            pipe.rpush(INGEST_LIST, *entries)
            pipe.execute_command("WAIT", self.durability.replicas, self.durability.timeout_ms)
            self.durability.check((await within(pipe.execute(), 30))[1])
        return [f"{QUEUE}:{input_key(spec.input)}" for spec in specs]
