"""History charts on the dashboard (issue 41, item 2) in a real headless Chromium against a real server, Valkey and
history API: a queue that ran jobs charts them, and the chart's table holds what ran and what the API returns; the
range switch changes the points; the overview, the queue page and the Autoscaling page (a machine rented through
the server's autoscaler and the mock provider) draw with no CSP violation and no console error; a backend named like
markup in offload.yaml stays text. The charting library is served from the package (vendor/), under the strict CSP."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import BrowserContext, Locator, Page, expect
from support.dashboard_helpers import HttpWorker, enqueue, go, save_screenshot, sign_in, store_call
from support.eventually import eventually_sync
from support.fleet_spend import PRICE, autoscaling_server, rent
from support.server_helpers import client, make_key, new_queue
from support.servers import ValkeyServer

from bench import web
from offload.queue.store import QueueStore
from offload.server.dashboard import ASSETS

pytestmark = pytest.mark.xdist_group("dashboard-charts")
ROOT = Path(__file__).resolve().parents[2]
HOSTILE = '<img src=x onerror="window.__xss=7">'  # a backend's name in offload.yaml: any string
RAN = new_queue("charts")
PAID = new_queue("img-src-x.onerror")  # as markup-shaped as the queue name rules allow
FLEET = new_queue("charts-fleet")
COSTS = (0.05, 0.07)  # what the hostile backend charged for PAID's two jobs
THROUGHPUT = "Throughput and failures"
# Every console error and every CSP violation (the event, not only its console line) is kept for the test to check.
INLINE = "() => { const s = document.createElement('script'); s.text = 'window.__ran = 1'; document.head.append(s); }"
WATCH = "window.__csp = []; document.addEventListener('securitypolicyviolation', (e) => window.__csp.push(`${e.violatedDirective} ${e.blockedURI}`));"  # noqa: E501


@pytest.fixture(scope="module")
def api(valkey: ValkeyServer) -> Iterator[tuple[str, str]]:
    """The server's autoscaler rents FLEET a machine first. Its history samples every half second (once a minute by
    default: the Autoscaling test waited up to a minute for the next sample to hold the machine)."""
    extra = {
        "backends": {HOSTILE: {"kind": "http-job", "base_url": "http://127.0.0.1:9"}},
        "queues": {PAID: {"backend": HOSTILE}},
    }
    with autoscaling_server(valkey.url, extra, history_sample_s=0.5) as srv:
        with client(*srv) as admin:
            rent(admin, FLEET)
        yield srv


@pytest.fixture(scope="module")
def ran(api: tuple[str, str]) -> None:
    """RAN: seven jobs, five succeeded and two dead (failed for good at their only attempt), through a GPU worker."""
    url, boot = api
    with client(url, boot) as admin:
        enqueue(admin, RAN, *range(7), max_attempts=1)
    worker = HttpWorker(url, make_key(url, boot, "worker", [RAN]), RAN)
    try:
        jobs = worker.claim(7)
        for job in jobs[:5]:
            worker.complete(job, {"n": job["input"]})
        for job in jobs[5:]:
            worker.fail(job, "bad input")
    finally:
        worker.close()


@pytest.fixture(scope="module")
def paid(api: tuple[str, str], valkey: ValkeyServer) -> None:
    """PAID: two jobs a dispatch worker ran at the hostile backend (through the store, as a dispatch worker does)."""
    with client(*api) as admin:
        enqueue(admin, PAID, 1, 2)

    async def dispatch(store: QueueStore) -> None:
        jobs = await store.claim(PAID, "dispatch-1", 2, 60_000)
        for job, n in zip(jobs, range(2), strict=True):
            await store.checkpoint(job.id, job.token, HOSTILE, f"remote-{n}")
        done = [(j.id, j.token, f"results/{j.id}.json", cost) for j, cost in zip(jobs, COSTS, strict=True)]
        await store.complete_many(PAID, done)

    store_call(valkey.url, dispatch)


class Watch:
    """A page's console errors and CSP violations, from its first load on."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.errors: list[str] = []
        page.add_init_script(WATCH)
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("response", lambda r: self.errors.append(f"HTTP {r.status} {r.url}") if r.status >= 400 else None)

    def assert_clean(self) -> None:
        assert self.page.evaluate("window.__csp") == []
        assert self.errors == []
        assert self.page.evaluate("window.__xss") is None


def stamp(t: int) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M")


def history(admin: httpx.Client, path: str, span: str) -> list[dict[str, Any]]:
    r = admin.get(path, params={"range": span})
    assert r.status_code == 200, r.text
    points: list[dict[str, Any]] = r.json()["points"]
    return points


def open_table(page: Page, title: str) -> Locator:
    """The chart's table, its "Table" disclosure opened (idempotent: an open one stays open)."""
    figure = page.get_by_role("figure", name=title)
    expect(figure.locator("canvas").first).to_be_visible()  # the plot is drawn
    details = figure.locator("details")
    if details.get_attribute("open") is None:
        figure.get_by_text("Table", exact=True).click()
    return figure.get_by_role("table", name=title, exact=True)


def read(table: Locator) -> dict[str, list[str]]:
    """Time (UTC) -> the row's cells as shown."""
    rows: list[list[str]] = table.evaluate("t => [...t.tBodies[0].rows].map(r => [...r.cells].map(c => c.textContent))")
    return {r[0]: r[1:] for r in rows}


def counts(points: list[dict[str, Any]]) -> dict[str, list[str]]:
    keys = ("enqueued", "succeeded", "failed", "dead", "cancelled")
    return {stamp(p["t"]): [str(p[k]) for k in keys] for p in points}


def column_sum(rows: dict[str, list[str]], i: int) -> float:
    return sum(float(v.lstrip("$")) for r in rows.values() if (v := r[i]) != "—")


def same_points(shown: dict[str, list[str]], api: dict[str, list[str]]) -> None:
    """The table and the API agree on every bucket both have (a minute may have turned between the two reads)."""
    common = shown.keys() & api.keys()
    assert len(common) >= len(api) - 1, (sorted(shown)[-3:], sorted(api)[-3:])
    assert {k: shown[k] for k in common} == {k: api[k] for k in common}


def test_a_queue_charts_what_ran_and_the_range_switch_changes_the_points(
    api: tuple[str, str], ran: None, admin: httpx.Client, page: Page, tmp_path: Path
) -> None:
    watch = Watch(page)
    sign_in(page, *api)
    go(page, f"#/queues/{RAN}")
    table = open_table(page, THROUGHPUT)
    expect(table.get_by_role("row")).to_have_count(61)  # the header and 60 one-minute points

    def what_ran() -> dict[str, list[str]] | None:
        rows = read(table)
        return rows if [column_sum(rows, i) for i in range(5)] == [7, 5, 0, 2, 0] else None

    shown = eventually_sync(what_ran, 30, "the table to hold 7 enqueued, 5 succeeded, 2 dead")
    api_points = history(admin, f"/v1/queues/{RAN}/history", "hour")
    assert [sum(p[k] for p in api_points) for k in ("enqueued", "succeeded", "dead")] == [7, 5, 2]
    same_points(shown, counts(api_points))

    # numbers on hover: the legend shows the point under the cursor (the newest, at the right edge)
    figure = page.get_by_role("figure", name=THROUGHPUT)
    box = figure.locator(".u-over").bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + box["width"] - 1, box["y"] + box["height"] / 2)
    legend = figure.locator(".u-legend")
    expect(legend.locator(".u-series", has_text="Succeeded").locator(".u-value")).to_have_text(re.compile(r"^\d+$"))
    expect(legend.locator(".u-series").first.locator(".u-value")).to_have_text(
        re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d$")
    )
    save_screenshot(page, tmp_path, "dashboard-charts.png")

    ranges = page.get_by_role("group", name="History range")
    for label, span, allowed in (
        ("Last day", "day", (24, 96)),
        ("Last week", "week", (168,)),
        ("Last hour", "hour", (60,)),
    ):
        n = len(history(admin, f"/v1/queues/{RAN}/history", span))
        assert n in allowed
        ranges.get_by_role("button", name=label).click()
        expect(ranges.get_by_role("button", name=label)).to_have_attribute("aria-pressed", "true")
        expect(table.get_by_role("row")).to_have_count(n + 1)
        rows = read(table)
        assert [column_sum(rows, i) for i in (1, 3)] == [5, 2]  # a longer range still holds what ran
    watch.assert_clean()


def test_overview_charts_sum_every_queue(
    api: tuple[str, str], ran: None, paid: None, admin: httpx.Client, page: Page
) -> None:
    watch = Watch(page)
    sign_in(page, *api)
    table = open_table(page, THROUGHPUT)
    expect(table.get_by_role("row")).to_have_count(61)

    def agreed() -> bool:
        shown, api_rows = read(table), counts(history(admin, "/v1/history", "hour"))
        common = shown.keys() & api_rows.keys()
        return len(common) >= 59 and all(shown[k] == api_rows[k] for k in common)

    eventually_sync(agreed, 30, "the overview's table to equal GET /v1/history")
    rows = read(table)
    assert column_sum(rows, 1) >= 5 and column_sum(rows, 3) >= 2  # RAN's, among every queue's
    spend = read(open_table(page, "Spend by kind"))
    serverless = sum(p["spend_usd"].get("serverless", 0) for p in history(admin, "/v1/history", "hour"))
    assert column_sum(spend, 0) == pytest.approx(serverless, abs=1e-3) and serverless >= sum(COSTS) - 1e-9
    watch.assert_clean()


def test_hostile_backend_names_stay_text(api: tuple[str, str], paid: None, page: Page) -> None:
    watch = Watch(page)
    sign_in(page, *api)
    go(page, f"#/queues/{PAID}")
    expect(page.get_by_role("heading", name=f"Queue {PAID}")).to_be_visible()
    table = open_table(page, "Spend by backend")
    expect(table.get_by_role("columnheader", name=HOSTILE, exact=True)).to_have_count(1)
    assert column_sum(read(table), 0) == pytest.approx(sum(COSTS), abs=1e-3)
    figure = page.get_by_role("figure", name="Spend by backend")
    expect(figure.locator(".u-legend")).to_contain_text(HOSTILE)  # the legend names the line, as text
    expect(page.get_by_role("region", name="History").locator("img, script, svg")).to_have_count(0)
    spend = read(open_table(page, "Spend by kind"))
    assert column_sum(spend, 0) == pytest.approx(sum(COSTS), abs=1e-3)
    watch.assert_clean()


def test_autoscaling_page_charts_the_fleet(api: tuple[str, str], admin: httpx.Client, page: Page) -> None:
    """FLEET's machine (rented when the module began) in the fleet size and cost charts, once sampled."""
    watch = Watch(page)
    sign_in(page, *api)
    go(page, "#/autoscale")
    machines = open_table(page, "Fleet size")
    cost = open_table(page, "Fleet cost")
    expect(machines.get_by_role("row")).to_have_count(61)

    def sampled() -> bool:  # the panel reloads every 15 s
        return column_sum(read(machines), 0) >= 1

    eventually_sync(sampled, 150, "a fleet sample with FLEET's machine in the chart", every=1)
    points = {stamp(p["t"]): p for p in history(admin, "/v1/history", "hour")}
    prices = read(cost)
    shown = {t: (n[0], prices[t][0]) for t, n in read(machines).items() if t in points and t in prices}
    assert len(shown) >= 59
    for t, (n, usd_h) in shown.items():
        p = points[t]
        assert n == ("—" if p["fleet_machines"] is None else str(p["fleet_machines"])), t
        assert (None if usd_h == "—" else float(usd_h.lstrip("$"))) == pytest.approx(p["fleet_usd_per_h"], abs=1e-4)
    assert max(p["fleet_usd_per_h"] or 0 for p in points.values()) >= PRICE - 1e-9  # FLEET's machine, at its price
    watch.assert_clean()


def test_the_charting_library_is_served_from_the_package_under_the_csp(
    api: tuple[str, str], browser: BrowserContext
) -> None:
    """uPlot comes from the server (no CDN), with the dashboard's CSP; the CSP still refuses inline code (so the
    checks above would see a chart that needed it)."""
    base = api[0]
    with web.client(base_url=base) as http:
        js = http.get("/ui/vendor/uPlot.iife.min.js")
        assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
        assert js.text.startswith("/*! https://github.com/leeoniya/uPlot (v1.6.32) */")
        csp = js.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert http.get("/ui/vendor/uPlot.min.css").status_code == 200
        for wrong in ("/ui/vendor/uPlot.LICENSE", "/ui/vendor/..%2Fapp.js", "/ui/vendor/app.js"):
            assert http.get(wrong).status_code == 404, wrong
    page = browser.new_page()  # not the fixture's: this page breaks the CSP on purpose
    try:
        page.add_init_script(WATCH)
        page.goto(f"{base}/ui/")
        page.evaluate(INLINE)
        eventually_sync(lambda: page.evaluate("window.__csp.length") > 0, 10, "the CSP to report the inline script")
        assert page.evaluate("window.__ran") is None
    finally:
        page.close()


def test_the_package_data_ships_every_dashboard_file() -> None:
    """pyproject's package data globs take every file the dashboard serves, and uPlot's license with them."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["offload"]
    static = ROOT / "offload" / "server" / "static"
    files = [f"server/static/{name}" for name in ASSETS] + ["server/static/vendor/uPlot.LICENSE"]
    for rel in files:
        assert (static.parent.parent / rel).is_file(), rel
        assert any(fnmatch.fnmatch(rel, g) and rel.count("/") == g.count("/") for g in globs), rel
    assert "MIT License" in (static / "vendor" / "uPlot.LICENSE").read_text()
