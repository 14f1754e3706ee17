"""The dashboard's server side over real HTTP (no browser): its static files (public, no data, strict CSP, nothing
outside the three listed files), and the two routes it added, `whoami` and `budget`, under every scope."""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections.abc import Iterator

import pytest
from support.server_helpers import client, make_key, new_queue, server
from support.servers import ValkeyServer

from bench import web
from offload.connection import connect
from offload.queue.store import QueueStore

SECRET = "sk-" + secrets.token_hex(16)
CAPPED = new_queue("capped")


@pytest.fixture(scope="module")
def api(valkey: ValkeyServer) -> Iterator[tuple[str, str]]:
    settings = {
        "backends": {"gpu": {"kind": "http-job", "base_url": "http://127.0.0.1:9", "api_key": SECRET}},
        "queues": {CAPPED: {"backend": "gpu", "daily_job_cap": 50, "daily_spend_cap": 12.5}},
    }
    with server(valkey.url, settings=settings) as srv:
        yield srv


def test_static_files_are_public_with_a_strict_policy(api: tuple[str, str]) -> None:
    with client(api[0]) as anon:
        r = anon.get("/", follow_redirects=False)
        assert r.status_code == 307 and r.headers["location"] == "/ui/"
        assert anon.get("/ui", follow_redirects=False).headers["location"] == "/ui/"
        page = anon.get("/ui/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<script type="module" src="app.js">' in page.text and '<input id="key"' in page.text
        csp = page.headers["content-security-policy"]
        for rule in ("script-src 'self'", "default-src 'none'", "form-action 'none'", "frame-ancestors 'none'"):
            assert rule in csp
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert page.headers["x-content-type-options"] == "nosniff" and page.headers["referrer-policy"] == "no-referrer"
        js = anon.get("/ui/app.js")
        assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
        # no HTML sinks at all: the DOM is built from text (the browser tests feed it markup to prove it)
        assert not re.search(r"\.(inner|outer)HTML\s*=|insertAdjacentHTML|document\.write|\beval\(", js.text)
        assert "sessionStorage" in js.text and "localStorage" not in js.text and "document.cookie" not in js.text
        assert anon.get("/ui/style.css").headers["content-type"].startswith("text/css")
        # only the listed files: no directory listing, no traversal, no other package file
        for path in ("/ui/dashboard.py", "/ui/..%2fapp.py", "/ui/../auth.py", "/ui/static", "/ui/%2e%2e/state.py"):
            r = anon.get(path)
            assert r.status_code == 404 and "import" not in r.text, path
        # the page and the API description carry no data; the API still needs a key
        assert anon.get("/v1/dashboard/whoami").status_code == 401
        assert anon.get("/v1/dashboard/budget").status_code == 401
        assert "/v1/dashboard/whoami" in anon.get("/openapi.json").json()["paths"]


def test_an_unchanged_file_revalidates_to_a_304(api: tuple[str, str]) -> None:
    """Served `no-cache` (an upgraded server never runs a stale script), so each load revalidates: with the ETag an
    unchanged file (the 51 KB chart library) comes back as a 304 with no body, and the same security headers."""
    with client(api[0]) as anon:
        for path in ("/ui/", "/ui/app.js", "/ui/vendor/uPlot.iife.min.js"):
            first = anon.get(path)
            etag = first.headers["etag"]
            assert first.status_code == 200 and first.content and first.headers["cache-control"] == "no-cache"
            again = anon.get(path, headers={"If-None-Match": etag})
            assert again.status_code == 304 and again.content == b"" and again.headers["etag"] == etag, path
            assert again.headers["content-security-policy"] == first.headers["content-security-policy"]
            stale = anon.get(path, headers={"If-None-Match": '"0123456789abcdef0123456789abcdef"'})
            assert stale.status_code == 200 and stale.content == first.content, path
        assert anon.get("/ui/app.js").headers["etag"] != anon.get("/ui/charts.js").headers["etag"]


def test_whoami_tells_each_scope_what_it_may_do(api: tuple[str, str]) -> None:
    url, boot = api
    q = new_queue()
    expected = {
        "admin": (["*"], True, True, True),
        "viewer": (["*"], False, False, True),
        "producer": ([q], False, True, False),
        "worker": ([q], False, False, False),
    }
    for scope, (queues, can_admin, can_cancel, can_see_workers) in expected.items():
        token = boot if scope == "admin" else make_key(url, boot, scope, [q] if scope in ("producer", "worker") else [])
        with client(url, token) as c:
            r = c.get("/v1/dashboard/whoami")
            assert r.status_code == 200, r.text
            doc = r.json()
            assert (doc["scope"], doc["queues"], doc["can_admin"], doc["can_cancel"], doc["can_see_workers"]) == (
                scope,
                queues,
                can_admin,
                can_cancel,
                can_see_workers,
            )
            assert token not in r.text and (scope == "admin" or token.split("_")[1] not in r.text)  # nor its id
    restricted = make_key(url, boot, "viewer", [q])
    with client(url, restricted) as c:
        assert c.get("/v1/dashboard/whoami").json()["can_see_workers"] is False
    with client(url, "ofk_000000000000_forged") as c:
        assert c.get("/v1/dashboard/whoami").status_code == 401


def test_budget_shows_usage_and_caps_per_readable_queue(api: tuple[str, str], valkey: ValkeyServer) -> None:
    url, boot = api
    other = new_queue("other")
    with client(url, boot) as admin:
        job = admin.post(f"/v1/queues/{CAPPED}/jobs", json={"input": 1}).json()["id"]
        admin.post(f"/v1/queues/{other}/jobs", json={"input": 1})
    window = time.strftime("%Y%m%d", time.gmtime())  # the store's day: its clock is this machine's

    async def count() -> None:
        redis = await connect(valkey.url)
        store = QueueStore(redis)
        assert await store.reserve(job, job_cap=50, spend_cap=12.5, cost=0.75) is None
        await redis.aclose()

    asyncio.run(count())
    with client(url, boot) as admin:
        budgets = {b["queue"]: b for b in admin.get("/v1/dashboard/budget").json()}
    assert budgets[CAPPED] == {
        "queue": CAPPED,
        "window": window,
        "jobs_used": 1,
        "jobs_cap": 50,
        "spend_used": 0.75,
        "spend_cap": 12.5,
    }
    assert budgets[other]["jobs_cap"] is None and budgets[other]["jobs_used"] == 0
    with client(url, make_key(url, boot, "viewer", [other])) as viewer:  # only the queues the key may read
        assert [b["queue"] for b in viewer.get("/v1/dashboard/budget").json()] == [other]
    with client(url, make_key(url, boot, "producer", [CAPPED])) as producer:
        assert [b["queue"] for b in producer.get("/v1/dashboard/budget").json()] == [CAPPED]
    with client(url, make_key(url, boot, "worker", [CAPPED])) as worker:
        r = worker.get("/v1/dashboard/budget")
        assert r.status_code == 403 and r.json()["error"] == "forbidden"
    with client(url, boot) as admin:
        assert SECRET not in admin.get("/v1/dashboard/budget").text


def test_the_dashboard_never_gets_a_key_from_the_url(api: tuple[str, str]) -> None:
    """The API reads keys from headers only: a key in the query string (what an EventSource would need) is
    ignored, so the dashboard's fetch()-based event stream is the only way in."""
    url, boot = api
    with web.client(base_url=url, timeout=10) as anon:
        for params in ({"token": boot}, {"api_key": boot}, {"key": boot}, {"access_token": boot}):
            assert anon.get("/v1/dashboard/whoami", params=params).status_code == 401
            with anon.stream("GET", "/v1/events", params=params) as r:
                assert r.status_code == 401
