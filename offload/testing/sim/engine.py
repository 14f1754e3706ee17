"""The simulator's core: shared state (`Sim`), the per-family `Dialect`, and the wrapper every route goes through.

A provider route is written as a plain handler that turns a request into a `Reply`. `Sim.endpoint` wraps it with
everything that is not the provider's logic and is the same for every family: request counting, auth, outage
windows, injected 429s and 5xx, Idempotency-Key replays, slow and lost submit responses, a gateway's 5xx after the
job was created, failing cancels, garbage bodies, and the submission log (`submissions`). A handler finds a job
through `Call.lookup`, which also plays a status store that lags the submit (`status_lag`). Keeping faults out of
the handlers means each fault behaves identically across families and each handler reads like the provider's
documentation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn, cast

import orjson
from starlette.requests import Request
from starlette.responses import Response

from offload.clock import Clock
from offload.errors import OffloadError
from offload.testing.sim.batches import BatchStore
from offload.testing.sim.config import FAMILIES, Behaviour, Family, Op, SimConfig
from offload.testing.sim.faults import (
    ConnectionReset,
    RuntimeOutage,
    garble,
    gateway_page,
    outage_mode,
    retry_after_value,
)
from offload.testing.sim.files import output_for
from offload.testing.sim.inputs import InputFetcher
from offload.testing.sim.stats import Stats
from offload.testing.sim.store import Job, JobStore, Outcome, input_key
from offload.testing.sim.submissions import Submission, SubmissionLog
from offload.testing.sim.webhooks import Event as HookEvent
from offload.testing.sim.webhooks import HookSender, Render

HOLD_STEP = 0.25  # seconds between checks while holding a synchronous request (a cancel can end a job early)
BATCH_CREATES = frozenset({"openai.batches", "anthropic.batches"})  # provider batch creates (lost_response_rate)


@dataclass(slots=True)
class Reply:
    """A JSON answer before it is rendered, so the fault layer can still garble it."""

    body: Any
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    media_type: str = "application/json"
    raw: bytes | None = None

    def render(self) -> Response:
        content = self.raw if self.raw is not None else orjson.dumps(self.body)
        return Response(content, status_code=self.status, headers=self.headers, media_type=self.media_type)


class ErrorReply(OffloadError):
    """Raised by a handler to answer with an error reply (bad body, unknown id) from anywhere in its code; the
    simulator turns it into that reply, so it never leaves it."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(reply.status)
        self.reply = reply


class Dialect:
    """How one provider spells auth and errors. Subclasses override `error` and, where the provider differs,
    `throttled` / `unavailable`; `required` names the fields a garbled body loses."""

    family: Family = "jobs"
    schemes: tuple[str, ...] = ("Bearer",)
    bare_key_ok: bool = False
    query_key_ok: bool = False  # `?api_key=` (Vast.ai, RunPod GraphQL)
    required: tuple[str, ...] = ("id", "status")

    def credential(self, request: Request) -> str | None:
        """The header that carries the API key (Anthropic also takes `x-api-key`)."""
        return request.headers.get("authorization")

    def authorized(self, header: str | None, api_key: str | None) -> bool:
        if not header or not header.strip():
            return False
        scheme, _, token = header.strip().partition(" ")
        if token.strip() and scheme.lower() in {s.lower() for s in self.schemes}:
            credential = token.strip()
        elif self.bare_key_ok and not token and scheme.lower() not in {s.lower() for s in self.schemes}:
            credential = scheme
        else:
            return False
        return api_key is None or credential == api_key

    def error(self, status: int, message: str, *, code: str | None = None) -> Reply:
        return Reply({"error": message}, status)

    def unauthorized(self) -> Reply:
        return self.error(401, "Unauthorized", code="invalid_api_key")

    def throttled(self, behaviour: Behaviour, headers: dict[str, str]) -> Reply:
        reply = self.error(429, "Too Many Requests", code="rate_limit_exceeded")
        reply.headers.update(headers)
        return reply

    def unavailable(self) -> Reply:
        return self.error(503, "Service Unavailable", code="service_unavailable")

    def precheck(self, request: Request) -> Reply | None:
        """A refusal the provider gives an authorized request before anything else (a required header
        missing), or None."""
        return None


@dataclass(slots=True)
class Call:
    """One request being served: what a handler needs besides the request itself."""

    sim: Sim
    request: Request
    dialect: Dialect
    behaviour: Behaviour
    now: float
    created: Job | None = None
    op: Op = "submit"
    route: str = ""

    @property
    def base_url(self) -> str:
        public = self.sim.config.public_url
        return public.rstrip("/") if public else str(self.request.base_url).rstrip("/")

    def lookup(self, job_id: str) -> Job | None:
        """The family's job `job_id` as the provider's status store sees it now: on the status and result routes,
        absent for `status_lag` seconds after its submit (a status read that lags the submit answers 404)."""
        job = self.sim.store.get(job_id, self.now, self.dialect.family)
        lag = self.behaviour.status_lag
        if job is not None and lag > 0 and self.op in ("status", "result") and self.now < job.created + lag:
            self.sim.stats.fault(self.route, "status_lag")
            return None
        return job

    def reject(self, status: int, message: str, *, code: str | None = None) -> NoReturn:
        raise ErrorReply(self.dialect.error(status, message, code=code))

    async def json(self) -> Any:
        body = await self.request.body()
        if not body:
            return None
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            self.reject(400, "Request body is not valid JSON", code="invalid_json")

    async def json_object(self) -> dict[str, Any]:
        data = await self.json()
        if not isinstance(data, dict):
            self.reject(400, "Request body must be a JSON object", code="invalid_request")
        return data

    def submit(
        self,
        target: str,
        payload: Any,
        *,
        job_id: str | None = None,
        meta: dict[str, Any] | None = None,
        run_timeout: float | None = None,
        hard_ttl: float | None = None,
    ) -> Job:
        """Create a remote job with its whole timeline, and count it as a submission of its input id."""
        job = self.sim.new_job(
            self.dialect.family,
            target,
            payload,
            self.behaviour,
            self.now,
            job_id=job_id,
            meta=meta,
            run_timeout=run_timeout,
            hard_ttl=hard_ttl,
        )
        self.created = job
        return job

    async def hold(self, job: Job, seconds: float) -> None:
        """Keep a synchronous request open until the job ends or `seconds` pass (capped by `max_wait`)."""
        deadline = self.now + min(seconds, self.sim.config.max_wait)
        while True:
            now = self.sim.clock()
            left = min(deadline, job.ended_at()) - now
            if left <= 0:
                break
            await asyncio.sleep(min(left, HOLD_STEP))
        self.now = self.sim.clock()

    def webhook(
        self, job: Job, url: Any, view: Callable[[Call, Job], dict[str, Any]], event: HookEvent = "completed"
    ) -> None:
        """Send `url` the job's final state when it ends, or (`event="start"`) the job as created, at once.
        `view(call, job)` renders the body as a poll at that moment would see it (a stale body, for a reordered
        delivery, is the view from while the job still ran)."""
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            return

        def render(at: float) -> dict[str, Any]:
            return view(dataclasses.replace(self, now=at), job)

        hook: Render = render
        self.sim.hooks.schedule(job, url, hook, event)

    def output(self, job: Job) -> dict[str, Any]:
        b = self.behaviour
        out = output_for(self.base_url, job.id, job.input, b.files_per_job, b.file_type)
        if b.output_bytes:
            out["padding"] = "x" * b.output_bytes
        return out


Handler = Callable[[Call], Awaitable[Reply | Response]]


class Sim:
    """Everything the routes share. Replacing the config keeps jobs and counters; `reset` clears them."""

    def __init__(self, config: SimConfig | None = None, clock: Clock = time.time) -> None:
        self.clock = clock
        self.store = JobStore()
        self.batches = BatchStore()
        self.stats = Stats()
        self.submissions = SubmissionLog()
        self.runtime_outages: list[RuntimeOutage] = []
        self.inputs = InputFetcher()  # URL inputs downloaded and checksummed, as a provider fetches them
        self._issued: set[str] = set()
        self.hooks = HookSender(clock, random.Random())  # its own draws: webhook faults never reshuffle others
        self.apply(config or SimConfig())

    def apply(self, config: SimConfig) -> None:
        self.config = config
        self.applied_at = self.clock()
        self.rng = random.Random(config.seed)
        self._behaviours: dict[str, Behaviour] = {f: config.behaviour(f) for f in FAMILIES}

    def reset(self) -> None:
        self.store.clear()
        self.batches.clear()
        self.stats = Stats()
        self.submissions.clear()
        self._issued.clear()  # a reset simulator is a fresh one: the same seed gives the same ids again
        self.runtime_outages.clear()
        self.hooks.reset()
        self.inputs.clear()
        self.apply(self.config)

    def behaviour(self, family: str) -> Behaviour:
        return self._behaviours[family]

    def chance(self, rate: float) -> bool:
        """Draw only for non-zero rates, so enabling one fault does not reshuffle the others' sequences."""
        return rate > 0 and self.rng.random() < rate

    def uuid(self) -> str:
        return self._fresh(lambda: str(uuid.UUID(int=self.rng.getrandbits(128), version=4)))

    def token(self, length: int, alphabet: str = "abcdefghijklmnopqrstuvwxyz0123456789") -> str:
        return self._fresh(lambda: "".join(self.rng.choice(alphabet) for _ in range(length)))

    def _fresh(self, draw: Callable[[], str]) -> str:
        """A value never handed out before by this simulator. Applying a config restarts the seeded sequence,
        which would otherwise repeat the ids of the first jobs: a poll of an old job would read a new one."""
        while (value := draw()) in self._issued:
            pass
        self._issued.add(value)
        return value

    def new_job(
        self,
        family: str,
        target: str,
        payload: Any,
        behaviour: Behaviour,
        now: float,
        *,
        job_id: str | None,
        meta: dict[str, Any] | None,
        run_timeout: float | None,
        hard_ttl: float | None,
        key: str | None = None,
    ) -> Job:
        started = now + behaviour.queue_delay.sample(self.rng)
        run = behaviour.latency.sample(self.rng)
        outcome: Outcome = "failed" if self.chance(behaviour.fail_rate) else "succeeded"
        if run_timeout is not None and run > run_timeout:
            run, outcome = run_timeout, "timed_out"
        job = Job(
            id=job_id or self.uuid(),
            family=family,
            target=target,
            input=payload,
            input_key=key or input_key(payload),
            created=now,
            started=started,
            finished=started + run,
            outcome=outcome,
            error=behaviour.error_message if outcome == "failed" else None,
            meta=meta or {},
            result_ttl=behaviour.result_ttl,
            hard_ttl_at=None if hard_ttl is None else now + hard_ttl,
            keep_after_expiry=family == "replicate" and behaviour.expiry_mode == "data_removed",
        )
        self.store.add(job)
        self.stats.submitted(family, job.input_key)
        self.inputs.watch(job.id, payload)
        return job

    def endpoint(
        self,
        dialect: Dialect,
        route: str,
        op: Op,
        handler: Handler,
    ) -> Callable[[Request], Awaitable[Response]]:
        """A Starlette endpoint: counting, auth, faults, then the handler, then faults on its answer."""

        async def serve(request: Request) -> Response:
            response = await self._serve(request, dialect, route, op, handler)
            self.stats.status(route, response.status_code)
            return response

        return serve

    async def _serve(self, request: Request, dialect: Dialect, route: str, op: Op, handler: Handler) -> Response:
        """One request: refused before its handler, replayed from its key, or handled and then faulted."""
        stats = self.stats  # a reset during the request leaves its counts with the counters it began on
        stats.request(route)
        now = self.clock()
        call = Call(self, request, dialect, self._behaviours[dialect.family], now, op=op, route=route)
        refused = self._refuse(call, stats)
        if refused is not None:
            return refused
        sent_key = request.headers.get("idempotency-key") if op == "submit" else None
        key = sent_key if self.config.honour_idempotency_key else None  # the key the cache works with
        if key is not None:
            replayed = await self._replay(call, key, stats)
            if replayed is not None:
                return replayed
        result = await self._handle(call, handler, key)
        entry: Submission | None = None
        if call.created is not None:
            entry = self._log(request, dialect.family, route, call.created, sent_key, now, replay=False)
            dropped = await self._answer_created(call, result, entry, key, stats)
            if dropped is not None:
                return dropped
        elif op == "submit" and isinstance(result, Reply) and 200 <= result.status < 300:
            delay = call.behaviour.submit_latency.sample(self.rng)  # a slow create of another kind (a machine rental)
            if delay > 0:
                await asyncio.sleep(delay)
            if route in BATCH_CREATES and self.chance(call.behaviour.lost_response_rate):
                stats.fault(route, "lost_response")  # the batch exists; its answer never comes
                return ConnectionReset()
        return self._finish(call, result, entry, stats)

    def _refuse(self, call: Call, stats: Stats) -> Response | None:
        """The answer given before the handler runs, if any: unauthorized, an outage, an injected 429 or 5xx, a
        failing cancel."""
        request, dialect, behaviour, route = call.request, call.dialect, call.behaviour, call.route
        auth = dialect.credential(request)
        if auth is None and dialect.query_key_ok and request.query_params.get("api_key"):
            auth = "Bearer " + request.query_params["api_key"]
        if not dialect.authorized(auth, self.config.api_key):
            return dialect.unauthorized().render()
        refused = dialect.precheck(request)
        if refused is not None:
            return refused.render()
        mode = outage_mode(behaviour, dialect.family, call.now, self.applied_at, self.runtime_outages)
        if mode == "429":
            stats.fault(route, "storm_429")
            return self._throttled(dialect, behaviour, call.now)
        if mode is not None:
            stats.fault(route, "outage_" + mode)
            return ConnectionReset() if mode == "reset" else dialect.unavailable().render()
        faulty = call.op in behaviour.faults_on
        if faulty and self.chance(behaviour.rate_429):
            stats.fault(route, "429" if behaviour.retry_after_header else "429_bare")
            return self._throttled(dialect, behaviour, call.now)
        if faulty and self.chance(behaviour.error_rate):
            code = behaviour.error_statuses[self.rng.randrange(len(behaviour.error_statuses))]
            stats.fault(route, str(code))
            return dialect.error(code, "Simulated server error", code="server_error").render()
        if call.op == "cancel" and behaviour.cancel_error is not None:
            stats.fault(route, f"cancel_{behaviour.cancel_error}")
            return dialect.error(behaviour.cancel_error, "Simulated cancel failure", code="cancel_failed").render()
        return None

    async def _replay(self, call: Call, key: str, stats: Stats) -> Response | None:
        """An Idempotency-Key seen before: its first answer again, a 409 while that is still being made, a 422
        for another body; None for a new key."""
        family, request, now = call.dialect.family, call.request, call.now
        verdict = self.submissions.begin(family, key, await request.body(), now, self.config.idempotency_ttl)
        if verdict == "new":
            return None
        if verdict == "busy":
            stats.fault(call.route, "idempotency_conflict")
            message = "A request with this Idempotency-Key is being processed"
            return call.dialect.error(409, message, code="idempotency_conflict").render()
        if verdict == "mismatch":
            message = "Idempotency-Key reused with a different request body"
            return call.dialect.error(422, message, code="idempotency_mismatch").render()
        assert verdict.job is not None
        stats.replayed(family)
        replayed = self._log(request, family, call.route, verdict.job, key, now, replay=True)
        replayed.responded, replayed.status = self.clock(), verdict.reply.status
        return cast(Reply, verdict.reply).render()

    async def _handle(self, call: Call, handler: Handler, key: str | None) -> Reply | Response:
        """The handler's answer (an `ErrorReply` becomes its reply). Only a job accepted with a 2xx is
        remembered under its key: a rejected, throttled or failed submit may be retried with it."""
        try:
            outcome = await handler(call)
        except ErrorReply as rejected:
            outcome = rejected.reply
        except BaseException:
            if key is not None:
                self.submissions.abandon(call.dialect.family, key)
            raise
        if key is not None and not _accepted(call, outcome):
            self.submissions.abandon(call.dialect.family, key)
        return outcome

    async def _answer_created(
        self, call: Call, result: Reply | Response, entry: Submission, key: str | None, stats: Stats
    ) -> Response | None:
        """A created job's answer: after the submit latency, then perhaps lost (a reset) or replaced by a
        gateway's error page (the job exists, and the key cache keeps the real answer); None to send it."""
        assert call.created is not None
        behaviour, route = call.behaviour, call.route
        delay = behaviour.submit_latency.sample(self.rng) if call.op == "submit" else 0.0
        try:
            if delay > 0:
                await asyncio.sleep(delay)  # the key stays "in progress" (409) until the answer goes out
        finally:
            if key is not None and _accepted(call, result):
                self.submissions.done(call.dialect.family, key, call.created, result)
        entry.responded = self.clock()
        if self.chance(behaviour.lost_response_rate):
            stats.fault(route, "lost_response")
            entry.lost, entry.status = True, 599
            return ConnectionReset()
        if call.op == "submit" and self.chance(behaviour.gateway_error_rate):
            code = behaviour.gateway_statuses[self.rng.randrange(len(behaviour.gateway_statuses))]
            stats.fault(route, f"gateway_{code}")
            entry.gateway, entry.status = True, code
            return gateway_page(code)
        return None

    def _finish(self, call: Call, result: Reply | Response, entry: Submission | None, stats: Stats) -> Response:
        """The answer rendered, garbled now and then (`malformed_rate`), its status in the submission log."""
        if not isinstance(result, Reply):
            if entry is not None:
                entry.status = result.status_code
            return result
        if entry is not None:
            entry.status = result.status
        behaviour = call.behaviour
        faulty = call.op in behaviour.faults_on
        if faulty and 200 <= result.status < 300 and self.chance(behaviour.malformed_rate):
            stats.fault(call.route, "malformed")
            garbled = Reply(result.body, result.status, result.headers, result.media_type)  # the cache keeps
            garbled.raw = garble(result.body, behaviour, self.rng, call.dialect.required)  # the clean answer
            return garbled.render()
        return result.render()

    def _throttled(self, dialect: Dialect, behaviour: Behaviour, now: float) -> Response:
        headers = {"Retry-After": retry_after_value(behaviour, now)} if behaviour.retry_after_header else {}
        return dialect.throttled(behaviour, headers).render()

    def _log(
        self, request: Request, family: str, route: str, job: Job, key: str | None, now: float, *, replay: bool
    ) -> Submission:
        server = request.scope.get("server")
        return self.submissions.add(
            family,
            route,
            job,
            key=key,
            user_agent=request.headers.get("user-agent"),
            port=int(server[1]) if server else None,
            arrival=now,
            replay=replay,
        )


def _accepted(call: Call, outcome: Reply | Response) -> bool:
    """A job created and answered with a 2xx: what an Idempotency-Key is remembered for."""
    return call.created is not None and isinstance(outcome, Reply) and 200 <= outcome.status < 300
