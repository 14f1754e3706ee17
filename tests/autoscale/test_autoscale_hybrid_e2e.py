"""Issue 40, end to end on real processes: one queue served by a rented fleet (the server's own autoscaler renting
`offload worker --handler` processes from the `local` provider) and a serverless overflow backend (the simulator's
RunPod API, served by `offload worker` as a separate process). A burst splits between the two kinds, and every job
runs exactly once: one claim, on one kind, never a GPU run and a provider submission for the same job."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.admin_redis import AdminRedis, redis_admin
from support.autoscale_helpers import VAULT_KEY, local_fleet
from support.eventually import eventually
from support.server_helpers import server
from support.servers import ValkeyServer, free_port
from test_worker import BACKENDS
from test_worker_crash import OFFLOAD, READY_LINE, base_env, spawn, stop

from bench import web
from offload.config import Settings
from offload.connection import connect
from offload.models import JobState
from offload.queue import keyspace
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.testing.sim.config import SimConfig
from offload.testing.sim.server import running_sim

BURST = 40
RUN_S = 0.5  # a job on a machine and at the provider alike


@pytest.fixture
async def r(valkey: ValkeyServer) -> AsyncIterator[AdminRedis]:
    client = redis_admin(await connect(valkey.url))
    yield client
    await client.aclose()


def _config(valkey: ValkeyServer, tmp_path: Path, sim: str, queue: str, url: str, worker_key: str) -> dict[str, Any]:
    return {
        "redis_url": valkey.url,
        "storage": {"kind": "local", "path": str(tmp_path / "results")},
        "backends": {"serverless": {**BACKENDS["runpod"], "base_url": sim, "api_key": "sim-key"}},
        "queues": {
            queue: {
                "poll_interval": 0.2,
                "autoscale": {
                    "enabled": True,
                    "provider": "here",
                    "min_workers": 1,
                    "max_workers": 1,
                    "poll_interval": "1s",
                    "boot_timeout": "60s",
                    "scale_up": [{"trigger": "no_workers"}],
                    "scale_down": [{"trigger": "idle", "timeout": "10m"}],
                    "instance": {
                        "env": {"OFFLOAD_TEST_SLOW": str(RUN_S), "OFFLOAD_TEST_RUNLOG": str(tmp_path / "runs.log")}
                    },
                    "overflow": {"backends": ["serverless"], "after": "4s"},
                },
            }
        },
        "autoscaler": {"public_url": url, "worker_key": worker_key, "tick": 0.2, "drain_settle": 1, "recent_task": 1},
    }


@pytest.mark.xdist_group("autoscale-e2e")
async def test_a_burst_splits_between_the_fleet_and_overflow_and_every_job_runs_once(
    r: AdminRedis, valkey: ValkeyServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OFFLOAD_VAULT_MASTER_KEY", VAULT_KEY)
    queue = "hybrid-" + secrets.token_hex(3)
    async with local_fleet(r, queue, "tests.support.handlers:logged_echo", tmp_path) as worker_key:
        with running_sim(SimConfig.model_validate({"default": {"latency": {"seconds": RUN_S}}})) as sim:
            await _burst(r, valkey, tmp_path, str(sim), queue, worker_key)


async def _burst(r: AdminRedis, valkey: ValkeyServer, tmp_path: Path, sim: str, queue: str, worker_key: str) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data = _config(valkey, tmp_path, sim, queue, url, worker_key)
    config = tmp_path / "offload.yaml"
    config.write_text(yaml.safe_dump(data))
    admin = "admin-" + secrets.token_hex(16)
    store = QueueStore(r)
    with server(valkey.url, settings=Settings.model_validate(data), port=port, admin_key=admin, max_wait_s=1):
        api = web.async_client(base_url=url, headers={"Authorization": f"Bearer {admin}"}, timeout=10)

        async def fleet_ready() -> bool:
            return any(w.get("instance_id") for w in (await api.get("/v1/workers")).json())

        await eventually(fleet_ready, 60, "the rented machine (min_workers 1) to register")
        overflow = spawn(
            [OFFLOAD, "worker", "--queue", queue, "--config", str(config)], base_env(), tmp_path, tmp_path / "ow.log"
        )
        try:
            await eventually(lambda: READY_LINE in (tmp_path / "ow.log").read_text(), 60, "the overflow worker")

            async def machine_counted() -> bool:  # by an evaluation since it came up: until then its reach is 0
                return int(await r.hget(keyspace.overflow_reach(queue), "idle") or 0) >= 1

            await eventually(machine_counted, 30, "the autoscaler's estimate to count the idle machine")
            warm = await store.enqueue(queue, JobSpec(input={"id": "warm"}))  # measures a run on the fleet
            await eventually(lambda: _done(store, [warm]), 30, "the warm-up job")
            ids = await store.enqueue_many(queue, [JobSpec(input={"id": f"j{i}"}) for i in range(BURST)])
            await eventually(lambda: _done(store, ids), 90, "the burst to finish")
        finally:
            stop(overflow)
        await api.aclose()
    jobs = [await store.get(i) for i in [warm, *ids]]
    assert all(j.state == JobState.SUCCEEDED and j.attempts == 1 for j in jobs), [
        (j.id, j.state, j.attempts) for j in jobs if j.state != JobState.SUCCEEDED or j.attempts != 1
    ]
    on_api = {j.id for j in jobs if j.backend == "serverless"}
    on_fleet = {j.id for j in jobs} - on_api
    gpu_runs = (tmp_path / "runs.log").read_text().split()
    assert sorted(gpu_runs) == sorted(on_fleet), "a GPU run per fleet job, none for a job the provider ran"
    submitted = [s["input_id"] for s in await _submissions(sim) if not s["replay"]]
    assert sorted(submitted) == sorted(j.input["id"] for j in jobs if j.id in on_api), "one submission per API job"
    assert warm in on_fleet
    print(f"split: {len(on_fleet)} on the fleet, {len(on_api)} on the API")
    assert on_api and len(on_fleet) > 1, f"the burst was not split: {len(on_fleet)} on the fleet, {len(on_api)} not"


async def _done(store: QueueStore, ids: list[str]) -> bool:
    states = [(await store.get(i)).state for i in ids]
    return all(state == JobState.SUCCEEDED for state in states)


async def _submissions(sim: str) -> list[dict[str, Any]]:
    async with web.async_client(base_url=sim, timeout=10) as http:
        page = (await http.get("/_sim/submissions", params={"limit": 1000})).json()
    return list(page["submissions"])
