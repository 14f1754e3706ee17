"""Two real `offload server` processes on one Valkey, against the simulated Vast.ai API: only the elected leader
calls the provider (counted at the simulator and per process), and when the leader process is SIGKILLed the other
server takes over after the lock's TTL and performs the teardown itself.

(test_autoscale_e2e.py has the same property for two Autoscaler objects in one process; this is the deployment
shape: separate processes, each electing through the Redis lock, configured by offload.yaml and env only.)"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from support.autoscale_helpers import VAULT_KEY, sim_call
from support.dashboard_helpers import HttpWorker
from support.eventually import eventually_sync
from support.procs import die_with_parent
from support.server_helpers import client, direct_key
from support.servers import ValkeyServer, free_port

from bench import web
from offload.autoscale.provider_store import ProviderStore
from offload.autoscale.vault import Vault
from offload.connection import connect
from offload.testing.sim.config import SimConfig
from offload.testing.sim.server import running_sim

pytestmark = pytest.mark.xdist_group("autoscale-two-servers")
REPO = Path(__file__).resolve().parents[2]
QUEUE = "gpu"


@contextmanager
def offload_server(name: str, config: Path, redis_url: str, admin: str, tmp: Path) -> Iterator[tuple[str, Any]]:
    """`python -m offload server` in its own process; yields (base URL, Popen). Stopped (or reaped) on exit."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_")}
    env.update(OFFLOAD_ADMIN_KEY=admin, OFFLOAD_VAULT_MASTER_KEY=VAULT_KEY, PYTHONPATH=str(REPO))
    log = (tmp / f"{name}.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "offload",
            "server",
            "--port",
            str(port),
            "--config",
            str(config),
            "--url",
            redis_url,
            "--log-level",
            "warning",
            "--no-access-log",
            "--worker-lease",
            "10",
        ],
        cwd=tmp,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=die_with_parent,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert proc.poll() is None, (tmp / f"{name}.log").read_text()
            try:
                return web.get(f"{url}/healthz", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        eventually_sync(up, 60, f"server {name} to listen")
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        log.close()


async def _operator_provider(redis_url: str, name: str, kind: str, config: dict[str, Any]) -> None:
    """`offload providers create` as the operator runs it on the server's host (direct Redis access)."""
    redis = await connect(redis_url)
    try:
        await ProviderStore(redis, Vault(VAULT_KEY)).create(name, kind, config)
    finally:
        await redis.aclose()


def me(api: httpx.Client) -> dict[str, Any]:
    """The answering server's own autoscaler: its owner id, whether it leads, its provider calls."""
    server: dict[str, Any] = api.get("/v1/autoscale/status").json()["server"]
    return server


def test_two_server_processes_only_the_leader_rents_and_the_survivor_takes_over(tmp_path: Path) -> None:
    cfg = SimConfig.model_validate({"api_key": "k", "machines": {"boot_seconds": 0.2}})
    admin = "admin-" + secrets.token_hex(16)
    with ExitStack() as stack:
        valkey = stack.enter_context(ValkeyServer(tmp_path / "valkey", appendfsync="no"))
        sim_url = stack.enter_context(running_sim(cfg))
        config = tmp_path / "offload.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "storage": {"kind": "local", "path": str(tmp_path / "results")},
                    "queues": {
                        QUEUE: {
                            "autoscale": {
                                "enabled": True,
                                "provider": "v",
                                "max_workers": 1,
                                "poll_interval": "0.2s",
                                "boot_timeout": "60s",
                                "instance": {"image": "ghcr.io/me/worker:1", "max_price_per_hour": 1.0},
                                "scale_down": [{"trigger": "idle", "timeout": "1s"}],
                            }
                        }
                    },
                    "autoscaler": {
                        "public_url": "https://cp.example.com",
                        "tick": 0.1,
                        "leader_ttl": 6,  # a takeover while a lives would fail the test: renewals stall on a loaded box
                        "recent_task": 0,
                        "worker_key": direct_key(valkey.url, "worker", QUEUE),
                        "drain_settle": 0,
                        "orphan_sweep_interval": 60,
                    },
                }
            )
        )
        url_a, proc_a = stack.enter_context(offload_server("a", config, valkey.url, admin, tmp_path))
        api_a = stack.enter_context(client(url_a, admin))
        eventually_sync(lambda: me(api_a)["leader"], 60, "server a to lead")
        url_b, _ = stack.enter_context(offload_server("b", config, valkey.url, admin, tmp_path))
        api_b = stack.enter_context(client(url_b, admin))
        owner_a, owner_b = me(api_a)["owner"], me(api_b)["owner"]
        assert owner_a != owner_b and not me(api_b)["leader"]

        # the operator registers the provider with the CLI (encrypted in Redis); both processes can read it. One made
        # over the API would get none of the operator's secrets (the worker key of the offload.yaml block).
        provider = {"api_key": "k", "base_url": sim_url, "gpu_name": "RTX 4090"}
        asyncio.run(_operator_provider(valkey.url, "v", "vastai", provider))
        assert api_b.post(f"/v1/queues/{QUEUE}/jobs", json={"input": 1}).status_code == 201

        def rental() -> Any:
            rows = api_b.get("/v1/autoscale/status").json()["instances"]
            return rows[0] if rows and rows[0]["provider_id"] else None

        inst = eventually_sync(rental, 60, "a rental")

        def sim_total() -> int:
            return sum(sim_call("GET", f"{sim_url}/_sim/stats")["requests"].values())

        calls_a = me(api_a)["provider_calls"]
        assert calls_a > 0 and sim_total() >= calls_a  # (the adapter may retry, never fewer)
        assert me(api_b)["provider_calls"] == 0
        assert [m["phase"] for m in sim_call("GET", f"{sim_url}/_sim/machines")["machines"]] != []
        eventually_sync(lambda: me(api_a)["provider_calls"] > calls_a, 30, "the leader to keep polling the provider")
        assert me(api_b)["provider_calls"] == 0  # b has been running its loop all along, and never called

        # a GPU worker on the rented machine registers with its instance id and the token it was rented with (through b)
        wkey = api_b.post("/v1/keys", json={"scope": "worker", "queues": [QUEUE], "name": "rented"}).json()["token"]
        machine = next(m for m in sim_call("GET", f"{sim_url}/_sim/machines")["machines"] if inst["id"] in m["label"])
        token = machine["env"]["OFFLOAD_INSTANCE_TOKEN"]
        worker = HttpWorker(url_b, wkey, QUEUE, instance_id=inst["id"], instance_token=token)
        stack.callback(worker.http.close)
        job = worker.claim(1)[0]

        # the leader dies without releasing its lock; b takes over after the TTL
        token_a = api_b.get("/v1/autoscale/status").json()["leader"]["token"]
        proc_a.send_signal(signal.SIGKILL)
        proc_a.wait(10)
        worker.complete(job, {"ok": True})  # the queue is empty now: idle, then drain and teardown

        def torn_down() -> Any:
            worker.heartbeat([])  # the worker lives on until the survivor drains and destroys its machine
            row = next(i for i in api_b.get("/v1/autoscale/status").json()["instances"] if i["id"] == inst["id"])
            return row if row["status"] == "terminated" and row["teardown"] == "done" else None

        final = eventually_sync(torn_down, 60, "the survivor to drain and destroy the instance", every=0.2)
        assert final["worker_id"] == worker.id
        status = api_b.get("/v1/autoscale/status").json()
        assert status["leader"]["owner"] == owner_b and int(status["leader"]["token"]) > int(token_a)
        assert status["server"]["leader"] and status["server"]["provider_calls"] > 0
        assert [m["phase"] for m in sim_call("GET", f"{sim_url}/_sim/machines")["machines"]] == ["deleted"]
