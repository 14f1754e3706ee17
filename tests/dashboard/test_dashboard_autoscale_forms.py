"""The Autoscaling page's forms in a real headless Chromium against a real server and Valkey: an admin adds,
edits (without retyping the secret, which is kept) and deletes a provider, and sets up, edits (errors shown at
their fields) and removes a queue's autoscale block. `local` providers are listed read-only and never offered;
a block that would run commands on this host through one is refused by the server, and the page says why. A
provider's name and the settings typed in fields its next type shares survive a change of type. The raw secret
never reaches the page. Screenshots: docs/img/dashboard-autoscale-*-form.png."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from playwright.sync_api import Page, expect
from support.autoscale_helpers import VAULT_KEY
from support.dashboard_helpers import go, in_thread, save_screenshot, sign_in
from support.eventually import eventually_sync
from support.server_helpers import client, make_key, new_queue, server
from support.servers import ValkeyServer

from offload.autoscale.provider_store import ProviderStore
from offload.autoscale.vault import Vault
from offload.connection import connect

T = TypeVar("T")

pytestmark = pytest.mark.xdist_group("dashboard-autoscale")
RAW = "rpa_" + secrets.token_hex(12) + "WXYZ"
LOCAL = "here-" + secrets.token_hex(3)


@pytest.fixture(scope="module")
def api(valkey: ValkeyServer) -> Iterator[tuple[str, str]]:
    """A server (its autoscaler off: nothing is rented here) with the vault key, and a local provider made the
    operator's way (the provider store, as the CLI does), and two mock ones for the queue form."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OFFLOAD_VAULT_MASTER_KEY", VAULT_KEY)
        mp.setenv("OFFLOAD_AUTOSCALER", "off")
        with server(valkey.url) as srv:
            in_thread(lambda: _store(valkey.url, lambda s: s.create(LOCAL, "local", {"concurrency": 2})))
            # the queue form's providers: a block may name only existing ones
            in_thread(lambda: _store(valkey.url, lambda s: s.create("try-a", "mock", {})))
            in_thread(lambda: _store(valkey.url, lambda s: s.create("try-b", "mock", {})))
            yield srv


async def _store(url: str, fn: Callable[[ProviderStore], Awaitable[T]]) -> T:
    redis = await connect(url)
    try:
        return await fn(ProviderStore(redis, Vault(VAULT_KEY)))
    finally:
        await redis.aclose()


def _no_raw_secret(page: Page) -> None:
    assert RAW not in page.evaluate("document.documentElement.outerHTML")
    assert RAW not in page.evaluate("[...document.querySelectorAll('input')].map(i => i.value).join(' ')")


def submit(page: Page, form: str) -> None:
    page.locator(f"{form} button[type=submit]").click()


def test_admin_adds_edits_and_deletes_a_provider(
    api: tuple[str, str], page: Page, valkey: ValkeyServer, tmp_path: Path
) -> None:
    name = "gpu-" + secrets.token_hex(3)
    sign_in(page, *api)
    go(page, "#/autoscale")
    local = page.locator(f'#providers tr[data-provider="{LOCAL}"]')
    expect(local.locator('[data-col="managed"]')).to_have_text("runs on this host: managed from the CLI")
    expect(local.locator("button")).to_have_count(0)  # read-only: no edit, no delete
    add = page.locator('[data-action="new-provider"]')
    expect(add).to_have_text("Add a provider")
    add.click()
    form = page.locator("#provider-form")
    expect(form.locator("#pf-type option")).to_have_text(["mock", "runpod", "vastai"])  # never local
    form.get_by_label("Name").fill(name)
    form.get_by_label("Type").select_option("runpod")
    expect(form.get_by_label("api_key (required)")).to_have_attribute("type", "password")
    submit(page, "#provider-form")  # no API key: the server names the field
    expect(form.locator('[data-error-for="api_key"]')).to_have_text("Field required")
    form.get_by_label("api_key (required)").fill(RAW)
    form.get_by_label("gpu_type_ids").fill("NVIDIA RTX A5000")
    submit(page, "#provider-form")  # not JSON: caught in the page, at the field
    expect(form.locator('[data-error-for="gpu_type_ids"]')).to_contain_text("not valid JSON")
    form.get_by_label("gpu_type_ids").fill('["NVIDIA RTX A5000", "NVIDIA GeForce RTX 3090"]')
    form.get_by_label("cloud_type").select_option("COMMUNITY")
    form.get_by_label("container_disk_gb").fill("0")
    submit(page, "#provider-form")  # out of range: the server's message at the field
    expect(form.locator('[data-error-for="container_disk_gb"]')).to_contain_text("greater than or equal to 1")
    expect(form.locator('[data-error-for="api_key"]')).to_have_text("")  # errors are those of the last try
    save_screenshot(page, tmp_path, "dashboard-autoscale-provider-form.png")
    form.get_by_label("container_disk_gb").fill("40")
    expect(form.get_by_role("button", name="Create provider")).to_be_visible()
    submit(page, "#provider-form")
    expect(page.locator("#notice")).to_have_text(f"Created provider {name}")
    row = page.locator(f'#providers tr[data-provider="{name}"]')
    expect(row.locator('[data-col="config"]')).to_contain_text("api_key=****WXYZ")
    expect(row.locator('[data-col="config"]')).to_contain_text("cloud_type=COMMUNITY")
    _no_raw_secret(page)

    row.get_by_role("button", name="Edit provider").click()
    form = page.locator("#provider-form")
    secret = form.get_by_label("api_key (required)")
    expect(secret).to_have_value("")  # the secret is never put back in a field
    expect(secret).to_have_attribute("placeholder", "stored ****WXYZ: leave empty to keep it")
    expect(form.get_by_label("container_disk_gb")).to_have_value("40")
    form.get_by_label("cloud_type").select_option("SECURE")
    form.get_by_role("button", name=f"Save provider {name}").click()
    expect(page.locator("#notice")).to_have_text(f"Saved provider {name}")
    stored = in_thread(lambda: _store(valkey.url, lambda s: s.get(name, reveal=True))).config
    assert stored["api_key"] == RAW and stored["cloud_type"] == "SECURE" and stored["container_disk_gb"] == 40
    assert stored["gpu_type_ids"] == ["NVIDIA RTX A5000", "NVIDIA GeForce RTX 3090"]

    row.get_by_role("button", name="Delete provider").click()
    expect(page.locator("#confirm-text")).to_contain_text(f"Delete provider {name}?")
    page.locator("#confirm-ok").click()
    expect(page.locator("#notice")).to_have_text(f"Deleted provider {name}")
    expect(page.locator(f'#providers tr[data-provider="{name}"]')).to_have_count(0)
    _no_raw_secret(page)


def test_the_provider_form_keeps_what_was_typed_when_the_type_redraws_it(api: tuple[str, str], page: Page) -> None:
    """The natural order, name first and then the type: the name stays, and so do the settings typed in fields
    the next type also has; the ones it lacks are gone, and the provider is saved under the typed name."""
    name = "typed-" + secrets.token_hex(3)
    sign_in(page, *api)
    go(page, "#/autoscale")
    page.get_by_role("button", name="Add a provider").click()
    form = page.locator("#provider-form")
    form.get_by_label("Name", exact=True).fill(name)
    form.get_by_label("Type", exact=True).select_option("runpod")
    expect(form.get_by_label("Name", exact=True)).to_have_value(name)
    form.get_by_label("api_key (required)").fill(RAW)
    form.get_by_label("base_url").fill("https://rent.example.com/api")
    form.get_by_label("min_cuda_version").fill("12.4")
    form.get_by_label("gpu_type_id", exact=True).fill("NVIDIA RTX A5000")  # runpod's alone
    form.get_by_label("Type", exact=True).select_option("vastai")
    expect(form.get_by_label("Name", exact=True)).to_have_value(name)
    expect(form.get_by_label("base_url")).to_have_value("https://rent.example.com/api")
    expect(form.get_by_label("min_cuda_version")).to_have_value("12.4")
    expect(form.get_by_label("gpu_type_id", exact=True)).to_have_count(0)
    expect(form.get_by_label("gpu_name")).to_have_value("")  # vastai's alone: as for a fresh form
    form.get_by_role("button", name="Create provider").click()
    expect(page.locator("#notice")).to_have_text(f"Created provider {name}")
    with client(*api) as admin:
        saved = admin.get(f"/v1/autoscale/providers/{name}").json()
    assert saved["name"] == name and saved["type"] == "vastai", saved
    assert (
        saved["config"]["base_url"] == "https://rent.example.com/api" and saved["config"]["min_cuda_version"] == "12.4"
    )
    assert saved["config"]["api_key"] == "****WXYZ" and "gpu_type_id" not in saved["config"]
    expect(page.get_by_role("row").filter(has=page.get_by_role("cell", name=name, exact=True))).to_have_count(1)
    with client(*api) as admin:
        assert admin.delete(f"/v1/autoscale/providers/{name}").status_code in (200, 204)


def test_admin_sets_up_edits_and_removes_a_queue_block(api: tuple[str, str], page: Page, tmp_path: Path) -> None:
    queue = new_queue("as-form")
    sign_in(page, *api)
    go(page, "#/autoscale")
    page.get_by_role("button", name="Set up autoscaling for a queue").click()
    form = page.locator("#queue-form")
    form.get_by_label("Queue").fill(queue)
    form.get_by_label("Providers, in order of preference (comma-separated)").fill("try-a, try-b")
    form.get_by_label("Maximum workers").fill("0")
    form.get_by_label("Poll interval (e.g. 30s)").fill("soon")
    form.get_by_label("Scale-up triggers (JSON list)").fill('[{"trigger": "no_workers"}, {"trigger": "queue_depth"}]')
    form.get_by_role("button", name="Save autoscaling").click()
    expect(form.locator('[data-error-for="max_workers"]')).to_contain_text("greater than or equal to 1")
    expect(form.locator('[data-error-for="poll_interval"]')).to_contain_text("bad duration 'soon'")
    expect(form.locator('[data-error-for="scale_up"]')).to_have_text("1.threshold: Field required")
    save_screenshot(page, tmp_path, "dashboard-autoscale-queue-form.png")
    form.get_by_label("Maximum workers").fill("3")
    form.get_by_label("Poll interval (e.g. 30s)").fill("45s")
    form.get_by_label("Scale-up triggers (JSON list)").fill(
        '[{"trigger": "no_workers"}, {"trigger": "queue_depth", "threshold": 50}]'
    )
    form.get_by_label("Choose the provider").select_option("cheapest")
    form.get_by_label("Jobs per worker (ramp in one step)").fill("20")
    form.get_by_label("Rent spot (interruptible) machines").check()
    form.get_by_role("button", name="Save autoscaling").click()
    expect(form.locator('[data-error-for="instance.spot_max_price"]')).to_contain_text("required with spot: true")
    form.get_by_label("Spot max price per hour (USD)").fill("0.25")
    form.get_by_role("button", name="Save autoscaling").click()
    expect(page.locator("#notice")).to_have_text(f"Saved autoscaling of {queue}")
    with client(*api) as admin:
        got = admin.get(f"/v1/autoscale/queues/{queue}").json()
    assert got["source"] == "api"
    block = got["autoscale"]
    assert block["providers"] == ["try-a", "try-b"] and block["max_workers"] == 3 and block["choose"] == "cheapest"
    assert block["jobs_per_worker"] == 20 and block["poll_interval"] == "45s" and block["enabled"] is True
    assert block["instance"] == {"spot": True, "spot_max_price": 0.25}
    row = page.locator(f'#autoscale-queues tr[data-queue="{queue}"]')
    expect(row.locator('[data-col="config"]')).to_contain_text("provider try-a → try-b · workers 0-3 · cheapest")
    expect(row.locator('[data-col="config"]')).to_contain_text("spot ≤ $0.25/h")

    row.get_by_role("button", name="Edit autoscaling").click()
    form = page.locator("#queue-form")
    expect(form.get_by_label("Queue")).to_be_disabled()
    expect(form.get_by_label("Maximum workers")).to_have_value("3")
    expect(form.get_by_label("Providers, in order of preference (comma-separated)")).to_have_value("try-a, try-b")
    form.get_by_label("Providers, in order of preference (comma-separated)").fill("try-b")
    form.get_by_label("Deployment from git (JSON object; empty: none)").fill(
        '{"git_url": "https://github.com/example/models.git", "branch": "gpu-v2"}'
    )
    form.get_by_role("button", name=f"Save autoscaling of {queue}").click()
    expect(form.locator('[data-error-for="deployment"]')).to_have_text("set exactly one of handler or startup_cmd")
    form.get_by_label("Deployment from git (JSON object; empty: none)").fill(
        '{"git_url": "https://github.com/example/models.git", "branch": "gpu-v2", "handler": "app:run"}'
    )
    form.get_by_role("button", name=f"Save autoscaling of {queue}").click()
    expect(page.locator("#notice")).to_have_text(f"Saved autoscaling of {queue}")
    expect(row.locator('[data-col="config"]')).to_contain_text("deploy gpu-v2 of https://github.com/example/models.git")
    with client(*api) as admin:
        assert admin.get(f"/v1/autoscale/queues/{queue}").json()["autoscale"]["provider"] == "try-b"

    # commands that would run on this host through a local provider: the server refuses, the form says why
    row.get_by_role("button", name="Edit autoscaling").click()
    form = page.locator("#queue-form")
    form.get_by_label("Providers, in order of preference (comma-separated)").fill(LOCAL)
    form.get_by_role("button", name=f"Save autoscaling of {queue}").click()
    expect(form.locator('[data-error-for="form"]')).to_contain_text("runs on the server's own host")
    expect(form.locator('[data-error-for="form"]')).to_contain_text("offload.yaml")
    form.get_by_role("button", name="Cancel").click()
    expect(page.locator("#queue-form")).to_have_count(0)

    row.get_by_role("button", name="Edit autoscaling").click()
    page.get_by_role("button", name=f"Remove the dashboard setting of {queue}").click()
    page.locator("#confirm-ok").click()
    expect(page.locator("#notice")).to_contain_text(f"Removed the dashboard setting of {queue}")
    with client(*api) as admin:
        eventually_sync(
            lambda: admin.get(f"/v1/autoscale/queues/{queue}").status_code == 404, 5, "the block to be gone"
        )


def test_a_viewer_gets_no_forms(api: tuple[str, str], page: Page) -> None:
    sign_in(page, api[0], make_key(api[0], api[1], "viewer"))
    go(page, "#/autoscale")
    expect(page.locator(f'#providers tr[data-provider="{LOCAL}"]')).to_be_visible()
    for action in ("new-provider", "new-queue"):
        expect(page.locator(f'[data-action="{action}"]')).to_be_hidden()
        expect(page.locator(f'[data-action="{action}"]')).to_be_disabled()
    status = page.evaluate(
        """async () => (await fetch('/v1/autoscale/providers', {method: 'POST', headers: {Authorization:
             `Bearer ${sessionStorage.getItem('offload.key')}`, 'Content-Type': 'application/json'},
             body: JSON.stringify({name: 'x', type: 'mock', config: {}})})).status"""
    )
    assert status == 403
