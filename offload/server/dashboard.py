"""The operator dashboard: static files served by the server itself, plus the two reads the API lacked.

The dashboard is plain HTML, a few vanilla JS modules, one stylesheet and a charting library (uPlot, in
static/vendor/) shipped as package data, so there is no build step, no CDN and nothing to install beside the
server. It talks to the same `/v1` API as everyone else, with the key the operator typed, sent as
`Authorization: Bearer` from `sessionStorage` (never a cookie, never the URL), so it has exactly the permissions
of that key and the server stays the only place that enforces them.

The static routes are public, like `/docs`: they carry no data. They are served with a strict Content Security
Policy (scripts from this origin only, no inline script, no framing, no form submissions), so even a rendering
bug could not run a job's input as code; the JS builds the DOM with `textContent` only, which is the first line.
uPlot keeps to the same policy: it styles through the CSSOM (not style attributes) and labels with `textContent`.

Live updates read `/v1/events` with `fetch()` and a streamed body rather than `EventSource`: EventSource cannot
send a header, and putting the key in the query string (or a cookie other pages could ride on) is what the API
refuses to accept. So the stream needs no new auth route at all.

Two routes exist for the dashboard's sake:
- `GET /v1/dashboard/whoami`: the key's scope and queues, so the page can hide actions the key may not take
  (hiding is a courtesy; the routes answer 403 regardless).
- `GET /v1/dashboard/budget`: today's cap usage per visible queue, which `/v1/queues` does not carry (it is
  counted at submit time by the dispatch workers, under the cap window key).
"""

from __future__ import annotations

import asyncio
import hashlib
from functools import cache
from importlib import resources

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import RedirectResponse, Response
from pydantic import BaseModel, Field

from offload.server.auth import GuardedRoute, Principal, can_read
from offload.server.state import ServerState, get_state

router = APIRouter(route_class=GuardedRoute)
PREFIX = "/ui/"
ASSETS = {  # the whole public surface of the dashboard: nothing else under /ui/ is served
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "autoscale.js": "text/javascript; charset=utf-8",
    "spend.js": "text/javascript; charset=utf-8",
    "search.js": "text/javascript; charset=utf-8",
    "story.js": "text/javascript; charset=utf-8",
    "charts.js": "text/javascript; charset=utf-8",
    "dom.js": "text/javascript; charset=utf-8",
    "live.js": "text/javascript; charset=utf-8",
    "callbacks.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    # the charting library, shipped inside the package (no CDN): uPlot, its version in docs/how-to/dashboard.md
    "vendor/uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "vendor/uPlot.min.css": "text/css; charset=utf-8",
}
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",  # a presigned output link opened from here learns nothing of the page
    "Cache-Control": "no-cache",  # revalidate: an upgraded server never runs a stale script
}


@cache
def _asset(name: str) -> tuple[bytes, str]:
    """Read once per process: the files are package data and change only with the package. With its ETag (its
    content's hash), so a revalidation (`no-cache`) of an unchanged file is a 304 and no body."""
    body = resources.files("offload.server").joinpath("static", *name.split("/")).read_bytes()
    return body, '"' + hashlib.sha256(body).hexdigest()[:32] + '"'


@router.get("/", include_in_schema=False)
async def root() -> RedirectResponse:
    return RedirectResponse(PREFIX, status_code=307)


@router.get("/ui", include_in_schema=False)
async def ui_bare() -> RedirectResponse:
    return RedirectResponse(PREFIX, status_code=307)


@router.get("/ui/", include_in_schema=False)
async def ui_index(request: Request) -> Response:
    return _serve("index.html", request)


@router.get("/ui/{name}", include_in_schema=False)
async def ui_asset(name: str, request: Request) -> Response:
    """Only the listed files: a name from the URL never reaches the file system as a path."""
    return _serve(name, request)


@router.get("/ui/vendor/{name}", include_in_schema=False)
async def ui_vendor(name: str, request: Request) -> Response:
    return _serve(f"vendor/{name}", request)


def _serve(name: str, request: Request) -> Response:
    if name not in ASSETS:
        raise HTTPException(404, f"no dashboard file {name!r}")
    body, etag = _asset(name)
    headers = {**SECURITY_HEADERS, "ETag": etag}
    if etag in request.headers.get("if-none-match", ""):
        return Response(status_code=304, headers=headers)
    return Response(body, media_type=ASSETS[name], headers=headers)


class WhoAmI(BaseModel):
    """What the presented key may do. Never the token, its id or its hash: the id is part of the token."""

    scope: str
    name: str
    queues: list[str] = Field(..., description="['*'] for every queue.")
    can_admin: bool = Field(..., description="Pause, resume, purge, requeue, release.")
    can_cancel: bool = Field(..., description="Cancel jobs (admins and producers, on their queues).")
    can_see_workers: bool = Field(..., description="Read /v1/workers and /metrics (they span every queue).")


class BudgetView(BaseModel):
    queue: str
    window: str = Field(..., description="The cap window: the job store's UTC day, YYYYMMDD.")
    jobs_used: int
    jobs_cap: int | None = None
    spend_used: float
    spend_cap: float | None = None


@router.get(
    "/v1/dashboard/whoami",
    response_model=WhoAmI,
    tags=["dashboard"],
    summary="The presented key's scope and queues (for hiding actions it may not take)",
)
async def whoami(key: Principal) -> WhoAmI:
    doc = key.to_dict()
    return WhoAmI(
        scope=key.scope,
        name=key.name,
        queues=doc["queues"],
        can_admin=key.scope == "admin",
        can_cancel=key.scope in ("admin", "producer"),
        can_see_workers=key.scope == "admin" or (key.scope == "viewer" and key.queues is None),
    )


async def _budget(state: ServerState, queue: str) -> BudgetView:
    window, jobs, spend = await state.store.usage(queue)  # the store's day: the one the workers count in
    caps = state.options.settings.queues.get(queue)
    return BudgetView(
        queue=queue,
        window=window,
        jobs_used=jobs,
        spend_used=round(spend, 6),
        jobs_cap=caps.daily_job_cap if caps else None,
        spend_cap=caps.daily_spend_cap if caps else None,
    )


@router.get(
    "/v1/dashboard/budget",
    response_model=list[BudgetView],
    tags=["dashboard"],
    summary="Cap usage and caps of the job store's UTC day, per queue the key may read",
)
async def budget(request: Request, key: Principal) -> list[BudgetView]:
    state = get_state(request)
    names = sorted(set(await state.store.queues()) | set(state.options.settings.queues))
    visible = [q for q in names if can_read(key, q)]
    if key.scope == "worker":
        raise HTTPException(403, "a worker key may not read budgets")
    return list(await asyncio.gather(*(_budget(state, q) for q in visible)))
