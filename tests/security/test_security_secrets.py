"""The operator's secrets stay with the operator. On a real server (its own
Valkey, its autoscaler running) with every key kind, a hostile listener as the "provider" an admin key picks
(it records everything it is sent), the simulator as the operator's own provider, and real worker registrations:

- an admin key cannot make the rental request carry the operator's worker key, vault git token or offload.yaml
  `instance.env` to a host it picks (a provider of its own, or one under the name an offload.yaml block uses);
- a masked `instance.env` value sent back is kept only for the block, providers (where they point) and commands
  it was given for; a provider moved afterwards does not receive it;
- a vault credential goes only to the git host it is bound to;
- the operator's providers cannot be changed, deleted or replaced over the API;
- a rented machine registers only as the instance it was rented as (its instance token);
- viewers see a deployment's commands (and a provider's on-start script) masked;
- a weak OFFLOAD_ADMIN_KEY is refused at start, in one line naming it.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from support.autoscale_helpers import VAULT_KEY, Clock, make_scaler, queue_block, sim_call, worker_token
from support.eventually import eventually_sync
from support.security_helpers import Echo, echo_server, leaks
from support.server_helpers import client, make_key, new_queue, server
from support.servers import ValkeyServer

from offload.access.api_keys import KeyStore, check_admin_key
from offload.autoscale import keyspace
from offload.autoscale.credentials import Credentials
from offload.autoscale.provider_store import ProviderStore
from offload.autoscale.providers.runpod import RunPodConfig, RunPodProvider
from offload.autoscale.vault import ENV as VAULT_ENV
from offload.autoscale.vault import Vault
from offload.connection import connect
from offload.errors import ConfigError
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.redis_client import RedisClient
from offload.testing.sim.config import SimConfig
from offload.testing.sim.server import running_sim

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.xdist_group("security-secrets")


def run(redis_url: str, fn: Callable[[RedisClient], Awaitable[T]]) -> T:
    """`fn(redis)` on a connection of its own: what the operator does on the server's host (direct Redis access)."""

    async def go() -> T:
        redis = await connect(redis_url)
        try:
            return await fn(redis)
        finally:
            await redis.aclose()

    return asyncio.run(go())


def _operator(url: str, given: dict[str, str], sim_url: str, queues: list[str]) -> str:
    """The operator's worker key (for `queues`), its provider `sim` (the simulator's RunPod API) and its vault
    credential `gh` for github.com."""

    async def go(redis: RedisClient) -> str:
        vault = Vault(VAULT_KEY)
        await ProviderStore(redis, vault).create(
            "sim", "runpod", {"api_key": "k", "base_url": sim_url, "gpu_type_id": "NVIDIA RTX A5000", "api": "rest"}
        )
        await Credentials(redis, vault).set("gh", given["git token"], "github.com")
        return (await KeyStore(redis).create("worker", queues, "rented machines"))[1]

    result: str = run(url, go)
    return result


def _block(provider: str, **more: Any) -> dict[str, Any]:
    return {
        "enabled": True,
        "provider": provider,
        "max_workers": 1,
        "poll_interval": "0.2s",
        "boot_timeout": "10m",
        "scale_up": [{"trigger": "queue_depth", "threshold": 0}],
        "instance": {"image": "ghcr.io/example/worker:1", **more.pop("instance", {})},
        **more,
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    given = {"git token": "ghp_" + secrets.token_hex(20), "yaml HF_TOKEN": "hf_" + secrets.token_hex(20)}
    yaml_q, rent_q = new_queue("yaml"), new_queue("rent")
    saved = os.environ.get(VAULT_ENV)
    os.environ[VAULT_ENV] = VAULT_KEY
    sim_cfg = SimConfig.model_validate({"api_key": "k", "machines": {"boot_seconds": 0}})
    try:
        with (
            ValkeyServer(tmp_path_factory.mktemp("secrets-valkey"), appendfsync="no") as valkey,
            echo_server() as hostile,
            running_sim(sim_cfg) as sim_url,
        ):
            worker_key = _operator(valkey.url, given, sim_url, [yaml_q, rent_q])
            deployment = {"git_url": "https://github.com/example/private.git", "handler": "app:run"}
            settings = {
                "autoscaler": {"public_url": "https://cp.example.com", "worker_key": worker_key, "tick": 0.1},
                "queues": {
                    # the operator's block names a provider `gpu` it has not made yet (nor ever will, here)
                    yaml_q: {
                        "autoscale": _block(
                            "gpu",
                            instance={"env": {"HF_TOKEN": given["yaml HF_TOKEN"]}},
                            deployment={**deployment, "git_credential": "gh"},
                        )
                    },
                    rent_q: {"autoscale": {**_block("sim"), "min_workers": 1, "max_workers": 2}},
                },
            }
            with server(valkey.url, settings=settings) as (url, admin):
                yield {
                    "url": url,
                    "admin": admin,
                    "valkey": valkey.url,
                    "hostile": hostile,
                    "sim": sim_url,
                    "given": given,
                    "worker key": worker_key,
                    "yaml": yaml_q,
                    "rent": rent_q,
                }
    finally:
        if saved is None:
            os.environ.pop(VAULT_ENV, None)
        else:
            os.environ[VAULT_ENV] = saved


def _evaluated(admin: httpx.Client, *queues: str) -> bool:
    """Every queue had a provider chosen or refused in an evaluation (after any create call it made)."""
    shown = admin.get("/v1/autoscale/status").json()["queues"]
    return all((shown.get(q) or {}).get("decision", {}).get("provider") for q in queues)


def _received(echo: Echo, prefix: str = "") -> list[tuple[str, str]]:
    return [(f"{m} {p}", f"{h} {b}") for m, p, h, b in echo.requests if p.startswith(prefix)]


def test_an_admin_key_ships_none_of_the_operators_secrets_to_a_host_it_picks(world: dict[str, Any]) -> None:
    hostile: Echo = world["hostile"]
    path = "/t1"
    base = hostile.url + path
    atk, own_q = new_queue("atk"), new_queue("own")
    with client(world["url"], world["admin"]) as admin:
        own_key = make_key(world["url"], world["admin"], "worker", [own_q])  # a key the admin key mints itself
        config = {"api_key": "rpa_attacker_0123456789", "base_url": base, "gpu_type_id": "X", "api": "rest"}
        for name in ("gpu", "mine"):  # `gpu`: the name the operator's offload.yaml block rents from
            r = admin.post("/v1/autoscale/providers", json={"name": name, "type": "runpod", "config": config})
            assert r.status_code == 201, r.text
        deployment = {"git_url": "https://github.com/attacker/x.git", "handler": "a:b", "git_credential": "gh"}
        r = admin.put(f"/v1/autoscale/queues/{atk}", json=_block("mine", deployment=deployment))
        assert r.status_code == 403 and "vault credential" in r.json()["detail"], r.text
        keyed = {"name": "mine-keyed", "type": "runpod", "config": {**config, "worker_key": own_key}}
        assert admin.post("/v1/autoscale/providers", json=keyed).status_code == 201
        assert admin.put(f"/v1/autoscale/queues/{atk}", json=_block("mine")).status_code == 200
        assert admin.put(f"/v1/autoscale/queues/{own_q}", json=_block("mine-keyed")).status_code == 200
        for q in (world["yaml"], atk, own_q):
            assert admin.post(f"/v1/queues/{q}/jobs", json={"input": 1}).status_code == 201
        # the provider carrying a worker key of its own rents (with that key): the listener does get rentals
        eventually_sync(
            lambda: any(own_key in b for _, b in _received(hostile, path)), 30, "the keyed provider's rental"
        )
        eventually_sync(lambda: _evaluated(admin, world["yaml"], atk, own_q), 30, "the three queues to be evaluated")
        skipped = {
            q: admin.get("/v1/autoscale/status").json()["queues"][q]["decision"]["provider"]["skipped"]
            for q in (world["yaml"], atk)
        }
    assert "cannot go to it" in skipped[world["yaml"]]["gpu"], skipped
    assert "its own worker_key" in skipped[atk]["mine"], skipped
    operators = {**world["given"], "operator's worker key": world["worker key"]}
    assert leaks(operators, _received(hostile, path)) == []


def test_a_masked_value_is_kept_only_for_where_it_was_given(world: dict[str, Any]) -> None:
    hostile: Echo = world["hostile"]
    q, token = new_queue("masked"), "hf_api_" + secrets.token_hex(20)
    legit, moved = world["sim"], hostile.url + "/t2"
    moved_path = "/t2"
    with client(world["url"], world["admin"]) as admin:
        # offload.yaml's value, sent back masked: never restored into a block an admin key writes
        shown = admin.get(f"/v1/autoscale/queues/{world['yaml']}").json()["autoscale"]
        assert shown["instance"]["env"]["HF_TOKEN"].startswith("****")
        shown.pop("deployment")
        for changes in ({"provider": "sim"}, {"provider": "sim", "max_workers": 2}):
            r = admin.put(f"/v1/autoscale/queues/{world['yaml']}", json={**shown, **changes})
            assert r.status_code == 422 and "offload.yaml" in r.text, r.text

        key = make_key(world["url"], world["admin"], "worker", [q])
        for name in ("a", "b"):
            config = {"api_key": "rpa_0123456789abcdef", "base_url": legit, "gpu_type_id": "NVIDIA RTX A5000"}
            body = {"name": f"{name}-{q}", "type": "runpod", "config": {**config, "api": "rest", "worker_key": key}}
            assert admin.post("/v1/autoscale/providers", json=body).status_code == 201
        block = {**_block(f"a-{q}", instance={"env": {"HF_TOKEN": token}}), "enabled": False}
        assert admin.put(f"/v1/autoscale/queues/{q}", json=block).status_code == 200
        shown = admin.get(f"/v1/autoscale/queues/{q}").json()["autoscale"]
        changed: tuple[dict[str, Any], ...] = (
            {"provider": f"b-{q}"},
            {"instance": {**shown["instance"], "image": "ghcr.io/attacker/dump-env:1"}},
            {"deployment": {"git_url": "https://github.com/attacker/x.git", "startup_cmd": "env"}},
        )
        for changes in changed:
            r = admin.put(f"/v1/autoscale/queues/{q}", json={**shown, **changes})
            assert r.status_code == 422 and "give the value again" in r.text, (changes, r.text)
        r = admin.put(f"/v1/autoscale/queues/{q}", json={**shown, "enabled": True})
        assert r.status_code == 200, r.text  # nothing that decides where it goes changed: kept (no job yet)

        # the provider is moved afterwards (its own secrets given again, as a move requires): the value stays put
        r = admin.patch(
            f"/v1/autoscale/providers/a-{q}",
            json={"base_url": moved, "api_key": "rpa_attacker_0123456789", "worker_key": key},
        )
        assert r.status_code == 200, r.text
        r = admin.put(f"/v1/autoscale/queues/{q}", json={**shown, "enabled": True, "max_workers": 2})
        assert r.status_code == 422, r.text  # sent back now, it is refused too
        assert admin.post(f"/v1/queues/{q}/jobs", json={"input": 1}).status_code == 201
        eventually_sync(lambda: _evaluated(admin, q), 30, "the queue to be evaluated")
        skipped = admin.get("/v1/autoscale/status").json()["queues"][q]["decision"]["provider"]["skipped"]
        assert "re-created or moved" in skipped[f"a-{q}"], skipped
    assert leaks({"HF_TOKEN": token}, _received(hostile, moved_path)) == []


async def test_a_vault_credential_goes_only_to_its_git_host(
    fast_valkey_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(VAULT_ENV, VAULT_KEY)
    r = await connect(fast_valkey_url)
    token = "ghp_" + secrets.token_hex(20)
    vault = Vault(VAULT_KEY)
    await Credentials(r, vault).set("gh", token, "github.com")
    await r.set(keyspace.credential("old"), vault.encrypt(token, "credential:old"))  # stored before the binding
    await r.sadd(keyspace.CREDENTIALS, "old")
    sent: dict[str, bool] = {}
    with echo_server() as echo:
        for name, url, cred in (
            ("elsewhere", "https://git.attacker.example/x.git", "gh"),
            ("userinfo", "ssh://github.com@attacker.example/x.git", "gh"),
            ("legacy", "https://github.com/example/x.git", "old"),
            ("github", "https://github.com/example/x.git", "gh"),
        ):
            clock = Clock()
            deployment = {"git_url": url, "handler": "app:run", "git_credential": cred}
            s, _ = make_scaler(
                r,
                clock,
                queue_block(
                    provider="rp",
                    deployment=deployment,
                    max_workers=1,
                    instance={"gpu": "RTX 4090", "image": "img"},  # no price cap: the echo quotes no price
                ),
                queue=f"q-{name}",
                alerts={"cooldown": 0},
                server={"public_url": "https://cp.example.com", "worker_key": await worker_token(r, f"q-{name}")},
            )
            before = len(echo.requests)
            s.override = {"rp": RunPodProvider("rp", RunPodConfig(api_key="k", base_url=echo.url, api="rest"))}
            await QueueStore(r).enqueue(f"q-{name}", JobSpec(input=1))
            await s.tick(force=True)
            sent[name] = any(token in b for _, _, _, b in echo.requests[before:])
            if name != "github":
                assert any("bound to" in a["message"] for a in s.alerter.sent), (name, s.alerter.sent)
            await s.leader.release()
            await s.override["rp"].aclose()
            await s.aclose()
    assert sent == {"elsewhere": False, "userinfo": False, "legacy": False, "github": True}
    await r.aclose()


def test_the_operators_providers_cannot_be_changed_deleted_or_replaced_over_the_api(world: dict[str, Any]) -> None:
    hostile: Echo = world["hostile"]
    legacy = new_queue("legacy")

    async def older(redis: RedisClient) -> None:  # a record written before origins were recorded: not the operator's
        await ProviderStore(redis, Vault(VAULT_KEY)).create(legacy, "mock", {})
        await redis.hdel(keyspace.provider(legacy), "origin")

    run(world["valkey"], older)
    with client(world["url"], world["admin"]) as admin:
        calls: tuple[Callable[[], httpx.Response], ...] = (
            lambda: admin.patch("/v1/autoscale/providers/sim", json={"gpu_type_id": "X"}),
            lambda: admin.patch(
                "/v1/autoscale/providers/sim", json={"base_url": hostile.url, "api_key": "rpa_attacker_0123456789"}
            ),
            lambda: admin.delete("/v1/autoscale/providers/sim"),
        )
        for call in calls:
            r = call()
            assert r.status_code == 403 and "made by the operator" in r.json()["detail"], r.text
        r = admin.post(
            "/v1/autoscale/providers",
            json={
                "name": "sim",
                "type": "runpod",
                "config": {"api_key": "rpa_0123456789abcd", "base_url": hostile.url},
            },
        )
        assert r.status_code == 422, r.text  # it still exists: no re-creating it elsewhere
        shown = admin.get("/v1/autoscale/providers/sim").json()
        assert shown["origin"] == "operator" and shown["config"]["base_url"] == world["sim"], shown
        assert admin.get(f"/v1/autoscale/providers/{legacy}").json()["origin"] == "api"
        assert admin.patch(f"/v1/autoscale/providers/{legacy}", json={"boot_seconds": 1}).status_code == 200
        run(world["valkey"], lambda redis: ProviderStore(redis).adopt(legacy))  # `offload providers adopt`
        assert admin.delete(f"/v1/autoscale/providers/{legacy}").status_code == 403


def _rented(world: dict[str, Any], admin: httpx.Client) -> list[tuple[str, str]]:
    """(instance id, the instance token its machine received) of the operator's rentals for the rent queue."""

    def found() -> list[tuple[str, str]] | None:
        rows = [
            i
            for i in admin.get("/v1/autoscale/status").json()["instances"]
            if i["queue"] == world["rent"] and i["provider_id"] and i["status"] in ("booting", "running")
        ]
        machines = {m["label"]: m for m in sim_call("GET", f"{world['sim']}/_sim/machines")["machines"]}
        pairs = [(i["id"], machines[f"offload-{i['id']}"]["env"].get("OFFLOAD_INSTANCE_TOKEN", "")) for i in rows]
        return pairs if pairs else None

    result: list[tuple[str, str]] = eventually_sync(found, 30, "a rental for the rent queue")
    return result


def _another(token: str) -> str:
    """The token with its first character changed (a fixed "x" + token[1:] is the token itself 1 time in 64)."""
    return ("y" if token[0] == "x" else "x") + token[1:]


def test_a_machine_registers_only_as_the_instance_it_was_rented_as(world: dict[str, Any]) -> None:
    q, other = world["rent"], new_queue("other")
    with client(world["url"], world["admin"]) as admin:
        ((inst, token), *_) = _rented(world, admin)
        assert "token" not in str(admin.get("/v1/autoscale/status").json()["instances"])  # not even its hash
    both = make_key(world["url"], world["admin"], "worker", [q, other])
    with client(world["url"], both) as machine:

        def register(**body: Any) -> httpx.Response:
            return machine.post("/v1/workers/register", json={"queues": [q], **body})

        for body, why in (
            ({"instance_id": inst}, "instance_token"),
            ({"instance_id": inst, "instance_token": _another(token)}, "instance_token"),
            ({"instance_id": inst, "instance_token": token, "queues": [other]}, "another queue"),
            ({"instance_id": "as-00000000000000ff", "instance_token": token}, "rented no such instance"),
        ):
            r = register(**body)
            assert r.status_code == 403 and why in r.json()["detail"], (body, r.text)
        r = register(instance_id=inst, instance_token=token)
        assert r.status_code == 201, r.text
        worker = r.json()["worker_id"]
        assert machine.post(f"/v1/workers/{worker}/heartbeat", json={"instance_id": inst}).status_code == 200
        r = machine.post(f"/v1/workers/{worker}/heartbeat", json={"instance_id": "as-00000000000000ff"})
        assert r.status_code == 403, r.text
        assert register(instance_id="i-0abc").status_code == 201  # not an autoscaler id: a free-form label
    with client(world["url"], world["admin"]) as admin:
        listed = [w for w in admin.get("/v1/workers").json() if w.get("instance_id") == inst]
        assert [w["id"] for w in listed] == [worker], listed


def test_viewers_see_commands_masked(world: dict[str, Any]) -> None:
    q, token = new_queue("cmds"), "ghp_" + secrets.token_hex(20)
    deployment = {
        "git_url": "https://github.com/example/x.git",
        "setup_cmd": f"pip install git+https://x:{token}@github.com/example/lib.git",
        "startup_cmd": f"HF_TOKEN={token} python serve.py",
    }
    onstart = f"echo {token} > /root/.token"
    viewer = make_key(world["url"], world["admin"], "viewer")
    with client(world["url"], world["admin"]) as admin:
        body = {"name": f"v-{q}", "type": "vastai", "config": {"api_key": "vast-0123456789abcdef", "onstart": onstart}}
        assert admin.post("/v1/autoscale/providers", json=body).status_code == 201
        block = {**_block(f"v-{q}", deployment=deployment), "enabled": False}
        assert admin.put(f"/v1/autoscale/queues/{q}", json=block).status_code == 200
        seen = admin.get(f"/v1/autoscale/queues/{q}").json()["autoscale"]["deployment"]
        assert seen["setup_cmd"] == deployment["setup_cmd"]  # the admin key that may set them sees them
        assert admin.get(f"/v1/autoscale/providers/v-{q}").json()["config"]["onstart"] == onstart
    with client(world["url"], viewer) as v:
        for path in (
            f"/v1/autoscale/queues/{q}",
            "/v1/autoscale/queues",
            "/v1/autoscale/providers",
            f"/v1/autoscale/providers/v-{q}",
        ):
            r = v.get(path)
            assert r.status_code == 200 and token not in r.text and "****" in r.text, (path, r.text)
        shown = v.get(f"/v1/autoscale/queues/{q}").json()["autoscale"]["deployment"]
        assert shown["setup_cmd"] == shown["startup_cmd"] == "****" and shown["git_url"] == deployment["git_url"]


WEAK = (
    "a" * 40,
    "0123456789" * 4,
    "passwordpasswordpasswordpassword",
    "boot-admin-0123456789abcdef-0123456789",
    "qwertyuiopasdfghjklzxcvbnmqwertyuiop",
    "Tr0ub4dor&3Tr0ub4dor&3Tr0ub4dor&3!!",
)


@pytest.mark.parametrize("weak", WEAK)
def test_a_weak_admin_key_is_refused_at_start(weak: str) -> None:
    env = {**os.environ, "OFFLOAD_ADMIN_KEY": weak, "OFFLOAD_REDIS_URL": "redis://127.0.0.1:1/0"}
    proc = subprocess.run(
        [sys.executable, "-m", "offload", "server", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert "OFFLOAD_ADMIN_KEY is too easy to guess" in lines[0] and weak not in lines[0], lines


def test_a_random_admin_key_is_accepted() -> None:
    for token in (
        secrets.token_hex(16),
        secrets.token_hex(32),
        secrets.token_urlsafe(24),
        "boot-" + secrets.token_urlsafe(24),
    ):
        assert check_admin_key(token) == token
    for weak in WEAK:
        with pytest.raises(ConfigError, match="OFFLOAD_ADMIN_KEY is too easy to guess"):
            check_admin_key(weak)
