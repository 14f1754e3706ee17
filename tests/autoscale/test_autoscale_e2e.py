"""End to end, in real time: the server's own autoscaler with the `local` provider boots a real
`offload worker --handler` process for jobs on an empty queue; it registers with its instance id, works, is
drained after the idle timeout and destroyed. And two autoscalers at once against the simulated Vast.ai API:
only the leader ever calls the provider, and the other takes over when the leader dies."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from support.admin_redis import AdminRedis, redis_admin
from support.autoscale_helpers import VAULT_KEY, local_fleet, put_worker, sim_call, worker_token
from support.eventually import eventually
from support.server_helpers import server
from support.servers import ValkeyServer, free_port

from bench import web
from offload.access.api_keys import KeyStore
from offload.autoscale.providers.vastai import VastConfig, VastProvider
from offload.autoscale.scaler import Autoscaler
from offload.config import Settings
from offload.connection import connect
from offload.eventloop import within
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.testing.sim.config import SimConfig
from offload.testing.sim.server import running_sim


@pytest.fixture
async def r(valkey: ValkeyServer) -> AsyncIterator[AdminRedis]:
    client = redis_admin(await connect(valkey.url))
    await redis_admin(client).flushdb()
    yield client
    await redis_admin(client).flushdb()
    await client.aclose()


@pytest.mark.xdist_group("autoscale-e2e")
async def test_local_provider_end_to_end(
    r: AdminRedis, valkey: ValkeyServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OFFLOAD_VAULT_MASTER_KEY", VAULT_KEY)
    queue = "e2e-" + secrets.token_hex(3)
    async with local_fleet(r, queue, "tests.support.handlers:echo", tmp_path) as worker_token:
        await _local_end_to_end(r, valkey, tmp_path, queue, worker_token)


async def _local_end_to_end(r: AdminRedis, valkey: ValkeyServer, tmp_path: Path, queue: str, worker_token: str) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    settings = Settings.model_validate(
        {
            "storage": {"kind": "local", "path": str(tmp_path / "results")},
            "queues": {
                queue: {
                    "autoscale": {
                        "enabled": True,
                        "provider": "here",
                        "max_workers": 1,
                        "poll_interval": "1s",
                        "boot_timeout": "60s",
                        "scale_up": [{"trigger": "no_workers"}],
                        "scale_down": [{"trigger": "idle", "timeout": "3s"}],
                    }
                }
            },
            "autoscaler": {
                "public_url": url,
                "worker_key": worker_token,
                "tick": 0.2,
                "drain_settle": 1,
                "recent_task": 1,
            },
        }
    )
    admin = "admin-" + secrets.token_hex(16)
    with server(valkey.url, settings=settings, port=port, admin_key=admin, worker_lease_ms=1500, max_wait_s=1):
        api = web.async_client(base_url=url, headers={"Authorization": f"Bearer {admin}"}, timeout=10)
        store = QueueStore(r)
        ids = await store.enqueue_many(queue, [JobSpec(input={"n": i}) for i in range(5)])

        async def rented() -> Any:
            rows = (await api.get("/v1/autoscale/status")).json()["instances"]
            return rows[0] if rows else None

        inst = await eventually(rented, 30, "a rental")
        # within one poll interval (plus a tick), on the store's clock: from the first job's record to the
        # instance's, so the test's own polling, slowed on a loaded machine, is not counted
        first = await store.get(ids[0])
        assert inst["created_at"] - first.created_at / 1000 < 1.0 + 1.0, (inst["created_at"], first.created_at)

        async def registered() -> Any:
            workers = (await api.get("/v1/workers")).json()
            return next((w for w in workers if w.get("instance_id") == inst["id"]), None)

        worker = await eventually(registered, 30, "the worker to register with its instance id")

        async def done() -> bool:
            counts = (await store.stats(queue)).counts
            return counts["succeeded"] == len(ids)

        await eventually(done, 30, "the jobs to finish")
        job = await store.get(ids[0])
        assert job.result is not None

        async def gone() -> Any:
            rows = (await api.get("/v1/autoscale/status")).json()["instances"]
            row = next(x for x in rows if x["id"] == inst["id"])
            return row if row["status"] == "terminated" else None

        try:
            final = await eventually(gone, 30, "drain and teardown after the idle timeout")
        except AssertionError:
            print((await api.get("/v1/autoscale/status")).json())
            raise
        assert final["worker_id"] == worker["id"] and final["teardown"] == "done"
        kinds = [e["kind"] for e in (await api.get("/v1/autoscale/events")).json()]
        assert kinds.index("provisioning") < kinds.index("ready") < kinds.index("draining") < kinds.index("destroyed")
        assert await r.hlen("offload:{as}:local:here") == 0  # the process record is gone with the process
        assert not any(w.get("instance_id") == inst["id"] for w in (await api.get("/v1/workers")).json())
        metrics = (await api.get("/metrics")).text
        assert "offload_autoscale_instances" in metrics and "offload_autoscale_leader_token" in metrics
        await api.aclose()


@pytest.mark.xdist_group("autoscale-e2e")
async def test_two_autoscalers_only_the_leader_calls_the_provider(r: AdminRedis) -> None:
    cfg = SimConfig.model_validate({"api_key": "k", "machines": {"boot_seconds": 0.2}})
    with running_sim(cfg) as sim_url:
        settings = Settings.model_validate(
            {
                "queues": {
                    "gpu": {
                        "autoscale": {
                            "enabled": True,
                            "provider": "v",
                            "max_workers": 2,
                            "poll_interval": "0.2s",
                            "boot_timeout": "60s",
                            "instance": {"image": "ghcr.io/me/worker:1", "max_price_per_hour": 1.0},
                            "scale_down": [{"trigger": "idle", "timeout": "1s"}],
                        }
                    }
                },
                "autoscaler": {
                    "public_url": "https://cp.example.com",
                    "worker_key": await worker_token(r),
                    "tick": 0.05,
                    "recent_task": 0,
                    "leader_ttl": 1.0,
                    "drain_settle": 0,
                    "orphan_sweep_interval": 0.5,
                },
            }
        )

        def scaler(owner: str) -> Autoscaler:
            vast = VastProvider("v", VastConfig(api_key="k", base_url=sim_url, gpu_name="RTX 4090"))
            return Autoscaler(r, settings, owner=owner, provider_override={"v": vast}, env={})

        a, b = scaler("server-a"), scaler("server-b")
        stop_a, stop_b = asyncio.Event(), asyncio.Event()
        task_a = asyncio.create_task(a.run(stop_a))
        await eventually(lambda: _true(a.leader.token), 5, "server-a to lead")
        task_b = asyncio.create_task(b.run(stop_b))
        await QueueStore(r).enqueue("gpu", JobSpec(input=1))

        async def instance() -> Any:
            live = await a.instances.live()
            return live[0] if live and live[0].provider_id else None

        inst = await eventually(instance, 10, "a rental")
        await put_worker(r, "w1", "gpu", inst.id, time.time())
        await QueueStore(r).purge("gpu", "queued")

        def sim_requests() -> int:
            return sum(sim_call("GET", f"{sim_url}/_sim/stats")["requests"].values())

        await asyncio.sleep(0.5)  # both loops run side by side for a while
        assert a.provider_calls > 0 and b.provider_calls == 0
        assert sim_requests() >= a.provider_calls  # (the adapter may retry, never fewer)
        # the leader dies without releasing its lock; the other takes over after the TTL and finishes the job
        a.leader.release = _no_release  # type: ignore[method-assign]
        stop_a.set()
        await within(task_a, 10)

        async def destroyed() -> bool:
            got = await b.instances.get(inst.id)
            return got is not None and got.status == "terminated"

        for _ in range(40):  # the stand-in worker keeps heart-beating while b takes over and drains it
            await put_worker(r, "w1", "gpu", inst.id, time.time())
            if await destroyed():
                break
            await asyncio.sleep(0.1)
        assert await destroyed()
        assert b.provider_calls > 0
        calls_a = a.provider_calls
        await asyncio.sleep(0.3)
        assert a.provider_calls == calls_a  # the dead leader made no call after it died
        machines = sim_call("GET", f"{sim_url}/_sim/machines")["machines"]
        assert [m["phase"] for m in machines] == ["deleted"]
        stop_b.set()
        await within(task_b, 10)
        await a.aclose()


async def _no_release() -> None:
    """A dead process releases nothing."""


async def _true(value: Any) -> Any:
    return value


async def test_autoscale_api(
    r: AdminRedis, valkey: ValkeyServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OFFLOAD_VAULT_MASTER_KEY", VAULT_KEY)
    monkeypatch.setenv("OFFLOAD_AUTOSCALER", "off")
    admin = "admin-" + secrets.token_hex(16)
    _, viewer = await KeyStore(r).create("viewer", [], "dashboards")
    with server(valkey.url, {"kind": "local", "path": str(tmp_path)}, admin_key=admin) as (url, _):
        async with (
            web.async_client(base_url=url, headers={"Authorization": f"Bearer {admin}"}) as api,
            web.async_client(base_url=url, headers={"Authorization": f"Bearer {viewer}"}) as view,
        ):
            body = {"name": "gpu-runpod", "type": "runpod", "config": {"api_key": "rpa_abcdefghijkl1234"}}
            assert (await view.post("/v1/autoscale/providers", json=body)).status_code == 403
            created = await api.post("/v1/autoscale/providers", json=body)
            assert created.status_code == 201 and created.json()["config"]["api_key"] == "****1234"
            bad = await api.post("/v1/autoscale/providers", json={"name": "x", "type": "gcp"})
            assert bad.status_code == 422 and "type: unknown provider type" in bad.text
            kept = await api.patch(
                "/v1/autoscale/providers/gpu-runpod", json={"api_key": "****1234", "cloud_type": "COMMUNITY"}
            )
            assert kept.status_code == 200 and kept.json()["config"]["cloud_type"] == "COMMUNITY"
            listed = (await view.get("/v1/autoscale/providers")).json()
            assert listed[0]["config"]["api_key"] == "****1234" and "rpa_" not in str(listed)
            block = {"enabled": True, "provider": "gpu-runpod", "max_workers": 0}
            wrong = await api.put("/v1/autoscale/queues/gpu", json=block)
            assert wrong.status_code == 422 and "queues.gpu.autoscale.max_workers" in wrong.text
            block["max_workers"] = 2
            for missing in ({"provider": "gpu-runpd"}, {"provider": None, "providers": ["gpu-runpod", "gpu-runpd"]}):
                typo = await api.put("/v1/autoscale/queues/gpu", json={**block, **missing})
                assert typo.status_code == 422 and "provider 'gpu-runpd' does not exist" in typo.text, typo.text
                assert "queues.gpu.autoscale.provider" in typo.text
            assert (await api.put("/v1/autoscale/queues/gpu", json=block)).status_code == 200
            got = (await view.get("/v1/autoscale/queues/gpu")).json()
            assert got == {"source": "api", "autoscale": block}
            scaler = Autoscaler(r, Settings(), env={})
            assert (await scaler.configs())["gpu"].max_workers == 2
            assert (await api.post("/v1/autoscale/instances/as-none/protect")).status_code == 404
            status = (await view.get("/v1/autoscale/status")).json()
            assert status["instances"] == [] and status["leader"] is None
            assert (await api.delete("/v1/autoscale/providers/gpu-runpod")).status_code == 204
            await scaler.aclose()
