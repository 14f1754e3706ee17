"""`/_sim/*`: the test hooks. Inspect counters and jobs, replace the config, toggle outages, reset, and serve the
files that outputs link to. No auth and no injected faults here: these routes are how a test observes and
steers the simulator, so they must always answer.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from offload.testing.sim.config import FAMILIES, Family, SimConfig
from offload.testing.sim.engine import Sim
from offload.testing.sim.faults import RuntimeOutage
from offload.testing.sim.files import CONTENT_TYPES, file_bytes, parse_name
from offload.testing.sim.webhooks import HookFaults

DEFAULT_LIST_LIMIT = 1000
SUBMISSIONS_PAGE = 10_000


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def _error(status: int, message: str, **extra: Any) -> Response:
    return _json({"error": message, **extra}, status)


async def _body(request: Request) -> Any:
    raw = await request.body()
    return orjson.loads(raw) if raw.strip() else None


class OutageRequest(BaseModel):
    """`POST /_sim/outage`: start an outage now (`mode`), for `seconds` or until cleared; `mode: null` clears.
    Mode `429` is a rate-limit storm: every request of the family is throttled (with Retry-After)."""

    model_config = ConfigDict(extra="forbid")
    family: Family | None = None
    mode: Literal["503", "reset", "429"] | None = "503"
    seconds: float | None = None


class Control:
    """The `/_sim/*` handlers, one method each."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim

    async def stats(self, request: Request) -> Response:
        self.sim.store.purge(self.sim.clock())
        return _json(self.sim.stats.snapshot(len(self.sim.store)))

    async def get_config(self, request: Request) -> Response:
        return _json(self.sim.config.public_dump())

    async def set_config(self, request: Request) -> Response:
        """Replace the whole config, or with `?merge=true` change only the given fields (jobs and counters
        stay either way). Windows in `outages` restart from now; so does the random sequence (seed)."""
        merge = request.query_params.get("merge", "").lower() in ("1", "true")
        try:
            body = await _body(request) or {}
            if merge and not isinstance(body, dict):
                return _error(400, "a merge needs a JSON object")
            config = self.sim.config.merged(body) if merge else SimConfig.model_validate(body)
        except orjson.JSONDecodeError:
            return _error(400, "body is not valid JSON")
        except ValidationError as exc:
            return _error(422, "invalid config", details=orjson.loads(exc.json()))
        if config.fal_prefix != self.sim.config.fal_prefix:
            return _error(400, "fal_prefix is fixed when the server starts; restart to change it")
        self.sim.apply(config)
        return _json(self.sim.config.public_dump())

    async def reset(self, request: Request) -> Response:
        self.sim.reset()
        return _json({"ok": True})

    async def outage(self, request: Request) -> Response:
        try:
            ask = OutageRequest.model_validate(await _body(request) or {})
        except (orjson.JSONDecodeError, ValidationError) as exc:
            return _error(422, f"invalid outage request: {exc}")
        now = self.sim.clock()
        if ask.mode is None:
            self.sim.runtime_outages[:] = [o for o in self.sim.runtime_outages if ask.family not in (None, o.family)]
        else:
            end = None if ask.seconds is None else now + ask.seconds
            self.sim.runtime_outages.append(RuntimeOutage(ask.family, ask.mode, now, end))
        return _json(
            {
                "outages": [
                    {"family": o.family, "mode": o.mode, "start": o.start, "end": o.end}
                    for o in self.sim.runtime_outages
                ]
            }
        )

    async def jobs(self, request: Request) -> Response:
        """Filter by family, status (simulator phase), target, input_id, and `tag`: a substring of the
        metadata/webhook the client sent, which is how a test finds an orphaned submission."""
        q = request.query_params
        now = self.sim.clock()
        self.sim.store.purge(now)
        try:
            limit = int(q.get("limit", DEFAULT_LIST_LIMIT))
        except ValueError:
            return _error(400, "limit must be an integer")
        tag = q.get("tag")
        matched = []
        for job in self.sim.store:
            if q.get("family") not in (None, job.family) or q.get("target") not in (None, job.target):
                continue
            if q.get("input_id") not in (None, job.input_key) or q.get("status") not in (None, job.phase(now)):
                continue
            if tag is not None and tag not in orjson.dumps(job.meta).decode():
                continue
            matched.append(job)
        return _json({"count": len(matched), "jobs": [j.summary(now) for j in matched[:limit]]})

    async def job(self, request: Request) -> Response:
        now = self.sim.clock()
        found = self.sim.store.get(request.path_params["job_id"], now)
        if found is None:
            return _error(404, "job not found")
        return _json(found.summary(now))

    async def job_inputs(self, request: Request) -> Response:
        """The input URLs the simulator downloaded for a remote job, with their sizes and SHA-256 (sim/inputs.py)."""
        view = self.sim.inputs.view(request.path_params["job_id"])
        return _error(404, "no URL inputs for this job") if view is None else _json(view)

    async def files(self, request: Request) -> Response:
        """Bytes for an output file while its job exists; 404 once the job expired, as provider files do."""
        name = request.path_params["name"]
        self.sim.stats.request("sim.files")
        parsed = parse_name(name)
        owner = self.sim.store.get(parsed[0], self.sim.clock()) if parsed else None
        if parsed is None or owner is None:
            self.sim.stats.status("sim.files", 404)
            return _error(404, "file not found")
        ext = parsed[1]
        size = self.sim.behaviour(owner.family).file_size
        self.sim.stats.status("sim.files", 200)
        return Response(file_bytes(name, ext, size), media_type=CONTENT_TYPES[ext])

    async def submissions(self, request: Request) -> Response:
        """The submission log, oldest first, `limit` entries after `after` (a seq); `next` is the `after` of the
        following page, null at the end. Each entry says who sent it (User-Agent worker id, port), when it
        arrived and was answered, whether it was a replay or its answer was lost, and how its remote job ended."""
        q = request.query_params
        try:
            after = int(q.get("after", 0))
            limit = min(int(q.get("limit", SUBMISSIONS_PAGE)), SUBMISSIONS_PAGE)
        except ValueError:
            return _error(400, "after and limit must be integers")
        if after < 0 or limit < 1:
            return _error(400, "after must be >= 0 and limit >= 1")
        now = self.sim.clock()
        page = [entry.view(now) for entry in self.sim.submissions.page(after, limit)]
        last = page[-1]["seq"] if page else after
        more = last < len(self.sim.submissions)
        return _json({"total": len(self.sim.submissions), "submissions": page, "next": last if more else None})

    async def set_webhooks(self, request: Request) -> Response:
        """Webhook fault knobs (drop/duplicate/reorder rates, delay) and the Replicate signing secret."""
        try:
            faults = HookFaults.model_validate(await _body(request) or {})
        except (orjson.JSONDecodeError, ValidationError) as exc:
            return _error(422, f"invalid webhook settings: {exc}")
        self.sim.hooks.configure(faults)
        return _json(faults.model_dump(exclude={"replicate_secret"}))

    async def webhooks(self, request: Request) -> Response:
        """Every webhook delivery so far: job, when the job ended and the hook went out, faults, HTTP statuses."""
        return _json({"deliveries": self.sim.hooks.sent})

    async def jwks(self, request: Request) -> Response:
        """The public keys fal-scheme webhooks are signed with (fal publishes its own as a JWKS)."""
        return _json(self.sim.hooks.jwks())

    async def health(self, request: Request) -> Response:
        return _json({"ok": True, "families": list(FAMILIES), "jobs": len(self.sim.store)})


def routes(sim: Sim) -> list[Route]:
    c = Control(sim)
    return [
        Route("/_sim/health", c.health, methods=["GET"]),
        Route("/_sim/stats", c.stats, methods=["GET"]),
        Route("/_sim/config", c.get_config, methods=["GET"]),
        Route("/_sim/config", c.set_config, methods=["POST"]),
        Route("/_sim/reset", c.reset, methods=["POST"]),
        Route("/_sim/outage", c.outage, methods=["POST"]),
        Route("/_sim/jobs", c.jobs, methods=["GET"]),
        Route("/_sim/submissions", c.submissions, methods=["GET"]),
        Route("/_sim/jobs/{job_id}", c.job, methods=["GET"]),
        Route("/_sim/jobs/{job_id}/inputs", c.job_inputs, methods=["GET"]),
        Route("/_sim/files/{name}", c.files, methods=["GET"]),
        Route("/_sim/webhooks", c.webhooks, methods=["GET"]),
        Route("/_sim/webhooks", c.set_webhooks, methods=["POST"]),
        Route("/_sim/fal/jwks.json", c.jwks, methods=["GET"]),
    ]
