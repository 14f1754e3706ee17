"""Autoscale configuration (validation names the field), cron, the vault, the provider store (encrypted, masked,
kept when not retyped) and the CLI around them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from support.admin_redis import AdminRedis, redis_admin
from support.autoscale_helpers import VAULT_KEY
from typer.testing import CliRunner

from offload.autoscale import keyspace
from offload.autoscale.provider_store import ProviderInUse, ProviderStore
from offload.autoscale.settings import Cron, validate_autoscale
from offload.autoscale.vault import Vault, VaultError
from offload.cli.app import app
from offload.config import load_settings
from offload.connection import connect
from offload.errors import ConfigError
from offload.schema import parse_duration


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"enabled": True, "max_workers": 2}, "q.provider: required"),
        ({"enabled": True, "provider": "p"}, "q.max_workers: required"),
        ({"provider": "p", "min_workers": 3, "max_workers": 2}, "q.min_workers: 3 is above max_workers"),
        ({"poll_interval": "soon"}, "q.poll_interval: bad duration"),
        ({"scale_up": [{"trigger": "queue_depth"}]}, "q.scale_up.0.threshold: Field required"),
        ({"scale_up": [{"trigger": "schedule", "cron": "0 25 * * *"}]}, "q.scale_up.0.cron: bad cron '0 25 * * *'"),
        ({"scale_up": [{"trigger": "grow"}]}, "q.scale_up.0"),
        ({"scale_down": [{"trigger": "idle", "timeout": 0}]}, "q.scale_down.0.timeout"),
        ({"instance": {"disk_gb": 0}}, "q.instance.disk_gb"),
        ({"instance": {"env": {"OFFLOAD_TOKEN": "x"}}}, "q.instance.env: OFFLOAD_TOKEN is set by"),
        ({"timezone": "Mars/Olympus"}, "q.timezone: unknown time zone"),
    ],
)
def test_validation_names_the_field(block: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate_autoscale(block, "q")
    assert str(err.value).startswith(message), str(err.value)


def test_defaults_and_durations() -> None:
    cfg = validate_autoscale({"enabled": True, "provider": "p", "max_workers": 2}, "q")
    assert cfg.poll_interval == 30 and cfg.boot_timeout == 1200 and cfg.min_workers == 0
    assert [t.trigger for t in cfg.scale_up] == ["no_workers"] and [t.trigger for t in cfg.scale_down] == [
        "idle",
        "cost",
    ]
    assert parse_duration("1h30m") == 5400 and parse_duration("250ms") == 0.25 and parse_duration(12) == 12


def test_offload_yaml_autoscale_block_is_checked_with_its_path(tmp_path: Path) -> None:
    f = tmp_path / "offload.yaml"
    f.write_text("queues:\n  gpu:\n    autoscale: {enabled: true, provider: p, max_workers: 0}\n")
    with pytest.raises(ConfigError, match=r"^queues\.gpu\.autoscale\.max_workers: Input should be greater"):
        load_settings(f, env={})
    f.write_text(
        "queues:\n  gpu:\n    autoscale: {enabled: true, provider: p, max_workers: 2}\nautoscaler: {tick: -1}\n"
    )
    with pytest.raises(ConfigError, match=r"^autoscaler\.tick"):
        load_settings(f, env={})
    f.write_text("queues:\n  gpu:\n    autoscale: {enabled: true, provider: p, max_workers: 2}\n")
    assert load_settings(f, env={}).queues["gpu"].backend is None  # a GPU-worker queue needs no backend


def test_cron_last_fire() -> None:
    monday_0800 = 1_800_000_000 - 1_800_000_000 % 86400 + 8 * 3600  # 2027-01-15 is a Friday
    c = Cron("0 8 * * 1-5")
    assert c.last_fire(monday_0800 + 59, 120) == monday_0800
    assert c.last_fire(monday_0800 - 60, 120) is None
    assert Cron("*/15 * * * *").last_fire(monday_0800 + 16 * 60, 3600) == monday_0800 + 15 * 60
    assert Cron("0 9 * * *", "Europe/Paris").last_fire(monday_0800 + 60, 120) == monday_0800  # 09:00 CET
    assert Cron("0 8 * * 0,7").last_fire(monday_0800 + 2 * 86400, 3 * 86400) == monday_0800 + 2 * 86400  # Sunday
    # Europe's spring change (2027-03-28): 02:30 does not exist in Berlin; the fire comes at 03:00 CEST (01:00 UTC)
    spring = 1_806_195_600  # 2027-03-28 01:00 UTC
    assert Cron("30 2 * * *", "Europe/Berlin").last_fire(spring + 60, 120) == spring
    with pytest.raises(ValueError, match="5 fields"):
        Cron("0 0 8 * * *")  # seconds: not standard cron


def test_vault_round_trip_and_refusals() -> None:
    v = Vault(VAULT_KEY)
    token = v.encrypt("rpa_secret", "provider:a")
    assert "rpa_secret" not in token and v.decrypt(token, "provider:a") == "rpa_secret"
    with pytest.raises(VaultError, match="does not decrypt"):
        v.decrypt(token, "provider:b")  # moved onto another record
    with pytest.raises(VaultError, match="another OFFLOAD_VAULT_MASTER_KEY"):
        Vault("another-master-key-0123456789").decrypt(token, "provider:a")
    with pytest.raises(VaultError, match="not set"):
        Vault.from_env({})


@pytest.fixture
async def r(fast_valkey_url: str) -> AsyncIterator[AdminRedis]:
    client = redis_admin(await connect(fast_valkey_url))
    yield client
    await client.aclose()


async def test_provider_store_encrypts_masks_and_keeps_untyped_secrets(r: AdminRedis) -> None:
    with pytest.raises(VaultError):
        await _no_key_create(r)
    store = ProviderStore(r, Vault(VAULT_KEY))
    rec = await store.create("gpu-vast", "vastai", {"api_key": "vast-key-1234567890", "gpu_name": "RTX 4090"})
    assert rec.config["api_key"] == "****7890" and rec.config["gpu_name"] == "RTX 4090"
    raw = await r.hgetall(keyspace.provider("gpu-vast"))
    assert "vast-key-1234567890" not in json.dumps(raw)
    await store.update("gpu-vast", {"api_key": "****7890", "max_price_per_hour": 0.6})  # the form sent it back
    revealed = (await store.get("gpu-vast", reveal=True)).config
    assert revealed["api_key"] == "vast-key-1234567890" and revealed["max_price_per_hour"] == 0.6
    await store.update("gpu-vast", {"api_key": "new-key-abcdefghijkl"})
    assert (await store.get("gpu-vast", reveal=True)).config["api_key"] == "new-key-abcdefghijkl"
    with pytest.raises(ConfigError, match=r"config\.min_reliability"):
        await store.update("gpu-vast", {"min_reliability": 3})
    with pytest.raises(ConfigError, match=r"config\.api_key: Field required"):
        await store.create("rp", "runpod", {})
    await r.sadd(keyspace.LIVE, "as-1")
    await r.hset(keyspace.instance("as-1"), mapping={"provider": "gpu-vast", "status": "running"})
    with pytest.raises(ProviderInUse):
        await store.delete("gpu-vast")


async def _no_key_create(r: AdminRedis) -> None:
    import os

    saved = os.environ.pop("OFFLOAD_VAULT_MASTER_KEY", None)
    try:
        await ProviderStore(r).create("x", "runpod", {"api_key": "rpa_0123456789abcdef"})
    finally:
        if saved is not None:
            os.environ["OFFLOAD_VAULT_MASTER_KEY"] = saved


def test_cli_providers_and_status(fast_valkey_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    monkeypatch.delenv("OFFLOAD_VAULT_MASTER_KEY", raising=False)
    res = runner.invoke(
        app,
        [
            "providers",
            "add",
            "rp",
            "--type",
            "runpod",
            "--url",
            fast_valkey_url,
            "--config",
            '{"api_key": "rpa_0123456789abcdef"}',
        ],
    )
    assert res.exit_code == 1 and "OFFLOAD_VAULT_MASTER_KEY is not set" in res.output
    monkeypatch.setenv("OFFLOAD_VAULT_MASTER_KEY", VAULT_KEY)
    res = runner.invoke(
        app,
        [
            "autoscale",
            "providers",
            "create",
            "rp",
            "--type",
            "runpod",
            "--url",
            fast_valkey_url,
            "--config",
            '{"api_key": "rpa_0123456789abcdef"}',
            "--set",
            'gpu_type_ids=["NVIDIA RTX A5000"]',
        ],
    )
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["providers", "show", "rp", "--url", fast_valkey_url])
    shown = json.loads(res.output)
    assert shown["config"]["api_key"] == "****cdef" and shown["config"]["gpu_type_ids"] == ["NVIDIA RTX A5000"]
    res = runner.invoke(
        app,
        [
            "providers",
            "add",
            "bad",
            "--type",
            "vastai",
            "--url",
            fast_valkey_url,
            "--set",
            "api_key=k",
            "--set",
            "countries=5",
        ],
    )
    assert res.exit_code == 1 and "config.countries" in res.output
    res = runner.invoke(app, ["autoscale", "status", "--url", fast_valkey_url])
    assert res.exit_code == 0 and "INSTANCE ID" in res.output and "leader: none" in res.output
    res = runner.invoke(app, ["autoscale", "protect", "as-nope", "--url", fast_valkey_url])
    assert res.exit_code == 1 and "no instance" in res.output
    res = runner.invoke(app, ["providers", "remove", "rp", "--yes", "--url", fast_valkey_url])
    assert res.exit_code == 0 and "deleted" in res.output


def test_the_docs_autoscaling_example_loads(tmp_path: Path) -> None:
    import re

    page = (Path(__file__).parents[2] / "docs" / "how-to" / "autoscaling.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", page, re.S)
    assert block, "the docs' autoscaling example is missing"
    f = tmp_path / "offload.yaml"
    f.write_text(block.group(1))
    settings = load_settings(f, env={"OFFLOAD_WORKER_API_KEY": "ofk_w", "HOOK_TOKEN": "t", "SMTP_PASSWORD": "p"})
    cfg = validate_autoscale(settings.queues["inference"].autoscale, "q")
    assert cfg.max_workers == 4 and [t.trigger for t in cfg.scale_up] == [
        "no_workers",
        "queue_depth",
        "latency",
        "schedule",
    ]
