"""The autoscaler's side of the security review: no admin key is a shell on the
server's host, a spawned local worker gets a minimal environment, provider errors are redacted at the source,
moving a provider to another endpoint needs its secrets again, instance.env never leaves the server or sits
in Redis in clear, a worker's own `protected` needs its provider's consent, the worker key is checked before it
is shipped, and the vault derives its key slowly and reports damage as its own error. Real Valkey, real HTTP
servers, real processes."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import orjson
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from support.admin_redis import AdminRedis, redis_admin
from support.autoscale_helpers import VAULT_KEY, Clock, make_scaler, put_worker, queue_block, stored, worker_token
from support.security_helpers import echo_server, redis_dump
from support.server_helpers import client, make_key, new_queue, server
from support.servers import ValkeyServer

from offload.access.api_keys import KeyStore
from offload.autoscale import keyspace
from offload.autoscale.provider_store import ProviderStore
from offload.autoscale.providers import LaunchSpec, ProviderError
from offload.autoscale.providers.local import LocalConfig, LocalProvider
from offload.autoscale.providers.mock import MockConfig, MockProvider
from offload.autoscale.providers.runpod import RunPodConfig, RunPodProvider
from offload.autoscale.scaler import Autoscaler
from offload.autoscale.vault import ENV as VAULT_ENV
from offload.autoscale.vault import Vault, VaultError
from offload.connection import connect
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.redis_client import RedisClient

T = TypeVar("T")


@pytest.fixture
async def r(valkey: ValkeyServer) -> AsyncIterator[AdminRedis]:
    redis = redis_admin(await connect(valkey.url))
    yield redis
    await redis.aclose()


@pytest.fixture(scope="module")
def api(valkey: ValkeyServer) -> Iterator[tuple[str, str]]:
    saved = os.environ.get(VAULT_ENV)
    os.environ[VAULT_ENV] = VAULT_KEY
    try:
        with server(valkey.url) as srv:
            yield srv
    finally:
        if saved is None:
            os.environ.pop(VAULT_ENV, None)
        else:
            os.environ[VAULT_ENV] = saved


def _store(url: str, fn: Callable[[RedisClient], Awaitable[T]]) -> T:
    async def go() -> T:
        redis = await connect(url)
        try:
            return await fn(redis)
        finally:
            await redis.aclose()

    return asyncio.run(go())


def test_commands_on_the_servers_host_cannot_be_set_over_the_api(api: tuple[str, str], valkey: ValkeyServer) -> None:
    url, boot = api
    q = new_queue("host")
    name = f"here-{q}"
    with client(url, boot) as admin:  # the admin-key root shell: a local provider whose handler is os:system
        r = admin.post(
            "/v1/autoscale/providers", json={"name": "sh", "type": "local", "config": {"handler": "os:system"}}
        )
        assert r.status_code == 403 and "offload.yaml or with the `offload` CLI" in r.json()["detail"], r.text
        # the operator creates one with the CLI (direct Redis access): it cannot be changed over the API either
        _store(
            valkey.url,
            lambda red: ProviderStore(red, Vault(VAULT_KEY)).create(
                name, "local", {"handler": "tests.support.handlers:echo"}
            ),
        )
        r = admin.patch(f"/v1/autoscale/providers/{name}", json={"python": "/bin/sh"})
        assert r.status_code == 403, r.text
        base = {"enabled": True, "provider": name, "max_workers": 1}
        for instance in ({"handler": "os:system"}, {"env": {"PYTHONPATH": "/tmp/evil"}}):
            r = admin.put(f"/v1/autoscale/queues/{q}", json={**base, "instance": instance})
            assert r.status_code == 403, r.text
            assert r.json()["detail"].startswith(f"queues.{q}.autoscale.instance."), r.text
        assert admin.put(f"/v1/autoscale/queues/{q}", json=base).status_code == 200  # the operator's handler runs
        assert admin.delete(f"/v1/autoscale/providers/{name}").status_code == 403  # the operator's, not the API's
        # commands for rented machines run there, not here: still settable
        assert (
            admin.post(
                "/v1/autoscale/providers",
                json={"name": f"rp-{q}", "type": "runpod", "config": {"api_key": "rpa_0123456789abcdef"}},
            ).status_code
            == 201
        )
        r = admin.put(
            f"/v1/autoscale/queues/{q}",
            json={**base, "provider": f"rp-{q}", "instance": {"handler": "mypkg:run", "image": "img"}},
        )
        assert r.status_code == 200, r.text


async def test_an_api_set_block_never_runs_here_even_once_its_provider_turns_local(
    r: AdminRedis, tmp_path: Path
) -> None:
    q = new_queue("later")
    block = queue_block(provider="later", instance={"handler": "os:system"})
    await r.set(keyspace.queue_config(q), orjson.dumps(block))  # as PUT /v1/autoscale/queues stores it
    await r.sadd(keyspace.QUEUE_CONFIGS, q)
    local = LocalProvider("later", LocalConfig(log_dir=str(tmp_path)), r)
    clock = Clock()
    s, _ = make_scaler(
        r,
        clock,
        queue=new_queue("unused"),
        server={"public_url": "http://127.0.0.1:9", "worker_key": await worker_token(r, q)},
    )
    s.override = {"later": local}
    await QueueStore(r).enqueue(q, JobSpec(input="echo pwned"))
    try:
        await s.tick(force=True)
        assert await local.list() == []
        assert any(
            "instance.handler of an autoscale block set over the HTTP API" in a["message"] for a in s.alerter.sent
        ), s.alerter.sent
    finally:
        for m in await local.list():
            await local.destroy(m.provider_id)
        await r.delete(keyspace.queue_config(q))
        await r.srem(keyspace.QUEUE_CONFIGS, q)
        await s.aclose()


async def test_a_local_worker_gets_a_minimal_environment(
    r: AdminRedis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secrets_ = {
        VAULT_ENV: "vault-0123456789abcdef",
        "OFFLOAD_REDIS_URL": "redis://:pw-0123456789@db:6379/0",
        "REDIS_URL": "redis://:pw-0123456789@db:6379/0",
        "OFFLOAD_ADMIN_KEY": "a" * 40,
        "AWS_SECRET_ACCESS_KEY": "aws-0123456789abcdef",
        "GPU_API_KEY": "gpu-0123456789abcdef",
    }
    for k, v in secrets_.items():
        monkeypatch.setenv(k, v)
    local = LocalProvider("env", LocalConfig(handler="tests.support.handlers:echo", log_dir=str(tmp_path)), r)
    spec = LaunchSpec(
        label="offload-as-envtest",
        queue="q",
        image=None,
        gpu=None,
        gpu_count=1,
        disk_gb=None,
        max_price_per_hour=None,
        env={"OFFLOAD_SERVER": "http://127.0.0.1:9", "OFFLOAD_TOKEN": "ofk_w_token", "OFFLOAD_QUEUE": "q"},
    )
    machine = await local.create(spec)
    try:
        pid = int(machine.raw["pid"])
        environ = (await asyncio.to_thread(Path(f"/proc/{pid}/environ").read_bytes)).decode(errors="replace")
        names = {entry.split("=", 1)[0] for entry in environ.split("\0") if entry}
    finally:
        await local.destroy(machine.provider_id)
    assert not names & set(secrets_), names & set(secrets_)
    assert not any(v in environ for v in secrets_.values())
    assert {"OFFLOAD_TOKEN", "OFFLOAD_SERVER", "OFFLOAD_QUEUE", "PATH"} <= names


async def test_provider_errors_are_redacted_at_the_source() -> None:
    """A provider that echoes the request (its Bearer key, the worker key in the rent body) into an error."""
    key = "rpkey-0123456789abcdef0123"
    with echo_server() as echo:
        provider = RunPodProvider("rp", RunPodConfig(api_key=key, base_url=echo.url, gpu_type_id="X", api="rest"))
        spec = LaunchSpec(
            label="offload-as-x",
            queue="q",
            image="img",
            gpu=None,
            gpu_count=1,
            disk_gb=None,
            max_price_per_hour=None,
            env={"OFFLOAD_TOKEN": "ofk_0123456789ab_workersecret0123456"},
        )
        with pytest.raises(ProviderError) as err:
            await provider.create(spec)
        await provider.aclose()
    assert key in str(echo.requests[0][2])  # it was sent, and echoed...
    assert key not in str(err.value) and "workersecret0123456" not in str(err.value)  # ...but never repeated


def test_moving_a_provider_to_another_endpoint_needs_its_secrets_again(api: tuple[str, str]) -> None:
    url, boot = api
    name = new_queue("move")
    with client(url, boot) as admin:
        assert (
            admin.post(
                "/v1/autoscale/providers",
                json={"name": name, "type": "vastai", "config": {"api_key": "vast-0123456789abcdef"}},
            ).status_code
            == 201
        )
        r = admin.patch(f"/v1/autoscale/providers/{name}", json={"base_url": "https://attacker.example.com"})
        assert r.status_code == 422 and r.json()["detail"].startswith("config.api_key: changing base_url"), r.text
        r = admin.patch(
            f"/v1/autoscale/providers/{name}", json={"base_url": "https://attacker.example.com", "api_key": "****cdef"}
        )
        assert r.status_code == 422, r.text  # sent back masked is not given again
        r = admin.patch(
            f"/v1/autoscale/providers/{name}",
            json={"base_url": "https://vast.example.com", "api_key": "vast-new-0123456789"},
        )
        assert r.status_code == 200 and r.json()["config"]["api_key"] == "****6789", r.text
        assert admin.patch(f"/v1/autoscale/providers/{name}", json={"gpu_name": "A100"}).status_code == 200


def test_instance_env_is_masked_on_read_and_sealed_at_rest(api: tuple[str, str], valkey: ValkeyServer) -> None:
    url, boot = api
    q = new_queue("env")
    token = "hf_" + "s3cr3t" * 6
    viewer = make_key(url, boot, "viewer")
    with client(url, boot) as admin:
        p = {"name": f"p-{q}", "type": "mock", "config": {}}  # the values are bound to the providers they go to
        assert admin.post("/v1/autoscale/providers", json=p).status_code == 201
        block = {"enabled": False, "provider": p["name"], "instance": {"env": {"HF_TOKEN": token, "MODE": "fast"}}}
        assert admin.put(f"/v1/autoscale/queues/{q}", json=block).status_code == 200
        with client(url, viewer) as v:
            for path in (f"/v1/autoscale/queues/{q}", "/v1/autoscale/queues"):
                text = v.get(path).text
                assert token not in text and "****" in text, text
        shown = admin.get(f"/v1/autoscale/queues/{q}").json()["autoscale"]
        assert shown["instance"]["env"]["HF_TOKEN"] == "****" + token[-4:]
        shown["instance"]["env"]["MODE"] = "slow"  # a form that sends the masked value back keeps the token
        assert admin.put(f"/v1/autoscale/queues/{q}", json=shown).status_code == 200
    assert token not in redis_dump(valkey.url)

    async def effective(red: RedisClient) -> dict[str, str]:
        scaler = Autoscaler(red, env={}, providers=ProviderStore(red, Vault(VAULT_KEY)))
        try:
            return (await scaler.configs())[q].instance.env
        finally:
            await scaler.aclose()

    assert _store(valkey.url, effective) == {"HF_TOKEN": token, "MODE": "slow"}


async def test_a_workers_own_protected_flag_needs_its_providers_consent(r: AdminRedis) -> None:
    for trusted in (False, True):
        await r.flushdb()
        clock = Clock()
        s, _ = make_scaler(
            r,
            clock,
            queue_block(scale_down=[{"trigger": "idle", "timeout": "1m"}]),
            mock=MockConfig(allow_worker_protect=trusted),
        )
        await QueueStore(r, clock_ms=clock.ms).enqueue("gpu", JobSpec(input=1))
        await s.tick()
        inst = (await s.instances.live())[0]
        await QueueStore(r).purge("gpu", "queued")
        for _ in range(8):  # the worker claims OFFLOAD_PROTECTED=true, idle for 4 minutes
            await put_worker(r, "w1", "gpu", inst.id, clock(), protected=True)
            clock.advance(30)
            await s.tick()
        status = (await stored(s, inst.id)).status
        assert (status == "running") is trusted, (trusted, status)


class Shipping(MockProvider):
    """A mock that, like every real provider, would hand the worker key to a machine."""

    type = "shipping"


async def test_the_worker_key_is_checked_before_it_is_shipped(r: AdminRedis) -> None:
    await r.flushdb()
    ks = KeyStore(r)
    _, producer = await ks.create("producer", ["gpu"])
    _, other = await ks.create("worker", ["elsewhere"])
    revoked_key, revoked = await ks.create("worker", ["gpu"])
    await ks.revoke(revoked_key.id)
    _, good = await ks.create("worker", ["gpu"])
    for token, why in (
        (producer, "is a producer key"),
        (other, "does not cover queue 'gpu'"),
        (revoked, "not a valid API key"),
        ("ofk_made_up", "not a valid API key"),
        (good, None),
    ):
        clock = Clock()
        s, _ = make_scaler(r, clock, alerts={"cooldown": 0}, server={"worker_key": token})
        ship = Shipping("m", MockConfig(), r, clock)
        s.override = {"m": ship}
        await QueueStore(r).enqueue("gpu", JobSpec(input=1))
        assert await s.tick(force=True)
        rented = await ship.all_ids()
        if why is None:
            assert len(rented) == 1
        else:
            assert rented == [] and why in s.alerter.sent[-1]["message"], (why, s.alerter.sent)
            assert token not in s.alerter.sent[-1]["message"]
        await s.leader.release()
        await s.aclose()


def test_the_vault_derives_slowly_migrates_old_records_and_reports_damage(valkey: ValkeyServer) -> None:
    vault = Vault(VAULT_KEY + "-slow")
    t0 = time.perf_counter()
    token = vault.encrypt("hello", "ctx")  # the first use derives the key (scrypt, not a fast HKDF)
    assert time.perf_counter() - t0 > 0.01 and token.startswith("v2:")
    assert vault.decrypt(token, "ctx") == "hello"
    version, salt, fingerprint, blob = token.split(":")
    with pytest.raises(VaultError, match="damaged"):
        vault.decrypt(f"{version}:{salt}:{fingerprint}:{blob[:-3]}!!", "ctx")
    with pytest.raises(VaultError, match="another OFFLOAD_VAULT_MASTER_KEY"):
        Vault("another-master-key-123").decrypt(token, "ctx")

    # a record written by the previous version (v1: HKDF) is still read, and rewritten as v2 on first read
    hk = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"offload-vault", info=b"provider-secrets")
    key = hk.derive(VAULT_KEY.encode())
    nonce = os.urandom(12)
    sealed = AESGCM(key).encrypt(nonce, orjson.dumps({"api_key": "old-0123456789abcd"}), b"provider:old")
    v1 = (
        "v1:"
        + hashlib.sha256(b"offload-vault-fp" + key).hexdigest()[:12]
        + ":"
        + base64.urlsafe_b64encode(nonce + sealed).decode()
    )

    async def go(red: RedisClient) -> tuple[str, str | None]:
        await red.hset(
            keyspace.provider("old"),
            mapping={
                "type": "vastai",
                "config": "{}",
                "secrets": v1,
                "secret_fields": "api_key",
                "created_at": 1,
                "updated_at": 1,
            },
        )
        record = await ProviderStore(red, Vault(VAULT_KEY)).get("old", reveal=True)
        return record.config["api_key"], await red.hget(keyspace.provider("old"), "secrets")

    secret, stored = _store(valkey.url, go)
    assert secret == "old-0123456789abcd" and stored is not None and stored.startswith("v2:")
