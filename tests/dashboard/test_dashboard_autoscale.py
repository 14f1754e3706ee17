"""The dashboard's Autoscaling page in a real headless Chromium against a real server (its own autoscaler running)
and a real Valkey: a queue autoscaled through the `mock` provider rents an instance, and the page shows the
queue's config and spend, the instance row and the providers with their secrets masked (the raw secret is never
in the DOM). An admin protects and unprotects the instance from the page; a viewer only looks."""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect
from support.dashboard_helpers import go, save_screenshot, sign_in
from support.eventually import eventually_sync
from support.fleet_spend import autoscaling_server, rent
from support.server_helpers import client, make_key, new_queue
from support.servers import ValkeyServer

from bench import web

pytestmark = pytest.mark.xdist_group("dashboard-autoscale")
RAW_SECRET = "rpa_" + secrets.token_hex(12) + "WXYZ"
QUEUE = new_queue("as-ui")
MOCK = "mock-" + secrets.token_hex(3)


@pytest.fixture(scope="module")
def api(valkey: ValkeyServer) -> Iterator[tuple[str, str]]:
    """A server whose autoscaler wakes often; the vault key is in its environment (providers need it)."""
    with autoscaling_server(valkey.url) as srv:
        yield srv


@pytest.fixture(scope="module")
def rented(api: tuple[str, str]) -> dict[str, Any]:
    """A mock provider, a queue block using it, one job: the server's autoscaler rents one instance."""
    with client(*api) as admin:
        body = {"name": "rp-" + MOCK, "type": "runpod", "config": {"api_key": RAW_SECRET}}
        r = admin.post("/v1/autoscale/providers", json=body)
        assert r.status_code == 201, r.text
        return rent(admin, QUEUE, mock=MOCK, price=0.42, daily_spend_cap=25)


def _no_raw_secret(page: Page) -> None:
    assert RAW_SECRET not in page.content()
    assert RAW_SECRET not in page.evaluate("document.documentElement.outerHTML + document.body.innerText")


def test_admin_sees_instances_config_spend_and_masked_providers(
    api: tuple[str, str], rented: dict[str, Any], page: Page, tmp_path: Path
) -> None:
    sign_in(page, *api)
    page.click('[data-nav="autoscale"]')
    expect(page.locator('[data-nav="autoscale"]')).to_have_class("on")
    row = page.locator(f'#instances tr[data-instance="{rented["id"]}"]')
    expect(row).to_be_visible()
    expect(row).to_contain_text(QUEUE)
    expect(row.locator('[data-col="provider"]')).to_have_text(MOCK)
    expect(row.locator('[data-col="status"]')).to_contain_text(re.compile("booting|running"))
    expect(row.locator('[data-col="worker"]')).to_have_text("—")
    expect(row.locator('[data-col="protected"]')).to_have_text("no")
    expect(row.locator('[data-col="cost"]')).to_contain_text("$0.")

    q = page.locator(f'#autoscale-queues tr[data-queue="{QUEUE}"]')
    expect(q.locator('[data-col="config"]')).to_contain_text(f"enabled · provider {MOCK} · workers 0-1")
    expect(q.locator('[data-col="config"]')).to_contain_text("day cap $25")
    expect(q.locator('[data-col="source"]')).to_have_text("api")
    expect(q.locator('[data-col="active"]')).to_have_text("1")
    expect(q.locator('[data-col="spend-day"]')).to_contain_text("$")
    expect(q.locator('[data-col="spend-month"]')).to_contain_text("$")
    why = q.locator('[data-col="why"]')  # why the autoscaler does what it does, from its last evaluation
    expect(why).to_contain_text("desired 1 (active 1, billed 1, floor 0)")
    expect(why).to_contain_text("because: no_workers: 1 pending, no live worker")
    expect(page.locator("#autoscale-leader")).to_contain_text("token")

    masked = page.locator(f'#providers tr[data-provider="rp-{MOCK}"] [data-col="config"]')
    expect(masked).to_contain_text("api_key=****WXYZ")
    _no_raw_secret(page)

    # protect from the page: the API (the autoscaler's source of truth) agrees, and back
    row.locator('[data-action="protect"]').click()
    expect(page.locator("#notice")).to_contain_text(f"Protected {rented['id']}")
    expect(row.locator('[data-col="protected"]')).to_have_text("yes")
    with client(*api) as admin:
        eventually_sync(
            lambda: next(i for i in admin.get("/v1/autoscale/status").json()["instances"] if i["id"] == rented["id"])[
                "protect"
            ],
            5,
            "the protect flag in the API",
        )
    save_screenshot(page, tmp_path, "dashboard-autoscale.png")
    row.locator('[data-action="unprotect"]').click()
    expect(row.locator('[data-col="protected"]')).to_have_text("no")
    _no_raw_secret(page)


def test_viewer_only_looks(api: tuple[str, str], rented: dict[str, Any], page: Page) -> None:
    viewer = make_key(api[0], api[1], "viewer")
    sign_in(page, api[0], viewer)
    go(page, "#/autoscale")
    row = page.locator(f'#instances tr[data-instance="{rented["id"]}"]')
    expect(row).to_be_visible()
    expect(row.locator('[data-action="protect"]')).to_be_hidden()
    expect(row.locator('[data-action="protect"]')).to_be_disabled()
    expect(page.locator(f'#providers tr[data-provider="rp-{MOCK}"]')).to_contain_text("****WXYZ")
    _no_raw_secret(page)
    # the server is what refuses: a forced request from the page with the viewer key is a 403
    status = page.evaluate(
        """async (id) => (await fetch(`/v1/autoscale/instances/${id}/protect`, {method: "POST",
             headers: {Authorization: `Bearer ${sessionStorage.getItem("offload.key")}`}})).status""",
        rented["id"],
    )
    assert status == 403
    with web.client(base_url=api[0], headers={"Authorization": f"Bearer {viewer}"}) as v:
        assert v.get("/v1/autoscale/queues").json()[QUEUE]["autoscale"]["provider"] == MOCK


def test_a_restricted_viewer_gets_an_explanation(api: tuple[str, str], page: Page) -> None:
    sign_in(page, api[0], make_key(api[0], api[1], "viewer", [QUEUE]))
    go(page, "#/autoscale")
    expect(page.locator("main")).to_contain_text("needs an admin key or an unrestricted viewer key")
