"""`python -m bench.chaos --autoscale`: the offload server SIGKILLed while it rents a GPU machine, again and again.

A real `offload server` autoscales one queue (min_workers machines) against the simulator's Vast.ai API, whose
rental call is slowed (`submit_latency`) so that a kill lands inside it: the harness watches the simulator's
request counter and SIGKILLs the server the moment a rental call arrives, then starts a new server process on the
same Valkey. The journal (an instance is recorded as provisioning, with its `offload-as-…` label, before the
call) must let the new server adopt the machine the dead one was renting instead of renting another. At the
end the queue is scaled to zero (with a boot timeout of 1 s: no worker ever starts on a simulated machine). The
verdict: no machine leaked (alive at the provider with no record, or left after the teardown), none doubled (two
live machines for one label), never more than the queue's maximum.

The operator sets up as on the server's host: the provider with the CLI's store (its origin: the operator's), a
worker key, a vault credential for github.com, and an offload.yaml block with a deployment and an `instance.env`
secret. With `--faults hostile` (in `all`), every round also plays a hostile admin key and a hostile rented
machine (bench/chaos/hostile_admin.py); the verdict then also needs none of the operator's secrets at the attacker's
listener, every attack refused, and each machine's own token still registering it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
import signal
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench import web
from bench.chaos.hostile_admin import Attacker, Listener
from bench.chaos.procs import (
    HOST,
    OFFLOAD,
    Sim,
    Valkey,
    base_env,
    free_port,
    graceful_stop,
    reap,
    signal_group,
    spawn,
)
from offload.access.api_keys import check_admin_key

QUEUE = "gpu"
ATTACK_QUEUE = "attacker"
VAULT_KEY = "chaos-master-key-0123456789abcdef"
SIM_KEY = "k"


class Server:
    """`offload server` as a process that can be SIGKILLed and started again on the same port."""

    def __init__(self, out: Path, config: Path, redis_url: str, admin: str, *extra: str) -> None:
        self.out, self.config, self.redis_url, self.admin = out, config, redis_url, admin
        self.extra = list(extra)  # more `offload server` options (the hybrid scenario's short worker lease)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        self.starts += 1
        env = base_env(OFFLOAD_ADMIN_KEY=self.admin, OFFLOAD_VAULT_MASTER_KEY=VAULT_KEY)
        self.proc = spawn(
            [
                OFFLOAD,
                "server",
                "--host",
                HOST,
                "--port",
                str(self.port),
                "--config",
                str(self.config),
                "--url",
                self.redis_url,
                "--log-level",
                "warning",
                "--no-access-log",
                *self.extra,
            ],
            self.out / f"server-{self.starts}.log",
            env,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(httpx.TransportError):
                if web.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"offload server did not start; see {self.out}")

    def kill(self) -> None:
        if self.proc is not None:
            signal_group(self.proc, signal.SIGKILL)
            reap(self.proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            signal_group(self.proc, signal.SIGTERM)
            reap(self.proc, 20)

    def graceful_stop(self, bound: float) -> tuple[int | None, float]:
        assert self.proc is not None
        return graceful_stop(self.proc, bound)

    def call(self, method: str, path: str, body: Any = None) -> httpx.Response:
        return web.request(
            method, f"{self.url}{path}", json=body, timeout=30, headers={"Authorization": f"Bearer {self.admin}"}
        )

    def api(self, method: str, path: str, body: Any = None) -> Any:
        r = self.call(method, path, body)
        if r.status_code >= 400:
            raise RuntimeError(f"{method} {path}: {r.status_code} {r.text[:300]}")
        return r.json() if r.content else None


def _operator(redis_url: str, sim_url: str, git_token: str) -> str:
    """What the operator does on the server's host (direct Redis access): the provider `v` at the simulator, the
    vault credential `gh` for github.com, and the worker key rented machines get (returned)."""
    from offload.access.api_keys import KeyStore
    from offload.autoscale.credentials import Credentials
    from offload.autoscale.provider_store import ProviderStore
    from offload.autoscale.vault import Vault
    from offload.connection import connect

    async def go() -> str:
        redis = await connect(redis_url)
        try:
            vault = Vault(VAULT_KEY)
            config = {"api_key": SIM_KEY, "base_url": sim_url, "gpu_name": "RTX 4090"}
            await ProviderStore(redis, vault).create("v", "vastai", config)
            await Credentials(redis, vault).set("gh", git_token, "github.com")
            return (await KeyStore(redis).create("worker", [QUEUE], "rented machines"))[1]
        finally:
            await redis.aclose()

    return asyncio.run(go())


def _config(path: Path, results: Path, machines: int, worker_key: str, hf_token: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "storage": {"kind": "local", "path": str(results)},
                "queues": {
                    QUEUE: {
                        "autoscale": {
                            "enabled": True,
                            "provider": "v",
                            "min_workers": machines,
                            "max_workers": machines,
                            "poll_interval": "0.3s",
                            "boot_timeout": "30m",
                            "instance": {
                                "image": "ghcr.io/example/worker:1",
                                "max_price_per_hour": 1.0,
                                "env": {"HF_TOKEN": hf_token},
                            },
                            "deployment": {
                                "git_url": "https://github.com/example/private.git",
                                "handler": "app:run",
                                "git_credential": "gh",
                            },
                            "scale_down": [{"trigger": "idle", "timeout": "1s"}],
                        }
                    }
                },
                "autoscaler": {
                    "public_url": "https://cp.example.com",
                    "worker_key": worker_key,
                    "tick": 0.1,
                    "leader_ttl": 2,
                    "recent_task": 0,
                    "drain_settle": 0,
                    "orphan_sweep_interval": 3600,
                },
            }
        )
    )
    return path


def _tokens(server: Server, sim: Sim) -> list[tuple[str, str]]:
    """(instance id, the token its machine received) of each live rental, as a machine would know its own."""
    rows = {r["id"]: r for r in server.api("GET", "/v1/autoscale/status")["instances"]}
    out = []
    for m in sim.get("/_sim/machines")["machines"]:
        inst = str(m["label"]).removeprefix("offload-")
        row = rows.get(inst)
        token = (m.get("env") or {}).get("OFFLOAD_INSTANCE_TOKEN")
        if row and token and m["phase"] != "deleted" and row["status"] in ("provisioning", "booting", "running"):
            out.append((inst, token))
    return out


def _wait(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, RuntimeError):
            if got := check():
                return got
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")


def admin_key() -> str:
    """A bootstrap admin key the server accepts: the project's strength rule, checked here so a weak one fails
    at once instead of as a server that never starts."""
    return check_admin_key(secrets.token_hex(32))


def verdict(result: dict[str, Any]) -> bool:
    """Passed only if the scenario happened (rentals made, a kill landed in one, the fleet reached its size) and
    nothing leaked, doubled, went over the maximum or outlived the teardown."""
    happened = (
        result["rental_calls"] > 0
        and result["server_kills_mid_rental"] > 0
        and result["machines_alive"] >= result["max_workers"]
    )
    broken = result["leaked"] or result["doubled"] or result["over_max"] or result["left_after_teardown"]
    return happened and not broken


def main(args: argparse.Namespace) -> dict[str, Any]:
    out = args.out or Path(tempfile.mkdtemp(prefix="offload-chaos-autoscale-"))
    out.mkdir(parents=True, exist_ok=True)
    machines, rounds = 3, 6
    hostile = args.faults == "all" or "hostile" in args.faults.split(",")
    given = {"vault git token": "ghp_" + secrets.token_hex(20), "offload.yaml HF_TOKEN": "hf_" + secrets.token_hex(20)}
    valkey = Valkey(out / "valkey", "always").start()
    sim = Sim(out, 0).start()
    given["worker key"] = _operator(valkey.url, sim.url, given["vault git token"])
    config = _config(
        out / "offload.yaml", out / "results", machines, given["worker key"], given["offload.yaml HF_TOKEN"]
    )
    server = Server(out, config, valkey.url, admin_key())
    listener = Listener()
    attacker = Attacker(server.call, listener, QUEUE, ATTACK_QUEUE)
    stack = contextlib.ExitStack()
    stack.enter_context(listener.running())
    try:
        _slow_rentals(sim, args.seed)
        server.start()
        kills = _kill_mid_rentals(server, sim, rounds, attacker if hostile else None, given["worker key"])
        result = _fleet_after_kills(server, sim, machines, kills)
        _scale_to_zero(server)
        with contextlib.suppress(TimeoutError):
            _wait(lambda: not _live(sim), 90, "the teardown")
        result["left_after_teardown"] = len(_live(sim))
        if hostile:
            result["hostile"] = _hostile_result(attacker, listener, given)
        bad_hostile = hostile and bool(
            attacker.refusals or attacker.own_refused or attacker.leaked(given) or not attacker.own_registrations
        )
        result["ok"] = verdict(result) and not bad_hostile
        return result
    finally:
        stack.close()
        for stop in (server.stop, sim.stop, valkey.stop):
            with contextlib.suppress(Exception):
                stop()


def _slow_rentals(sim: Sim, seed: int) -> None:
    """Slow the simulator's rental call so that a kill can land inside it."""
    sim.post(
        "/_sim/config",
        {
            "api_key": SIM_KEY,
            "seed": seed,
            "machines": {"boot_seconds": 0.5},
            "families": {"vastai": {"submit_latency": 1.5}},
        },
    )


def _rents(sim: Sim) -> int:
    return int(sim.get("/_sim/stats")["requests"].get("vastai.rent", 0))


def _live(sim: Sim) -> list[dict[str, Any]]:
    return [m for m in sim.get("/_sim/machines")["machines"] if m["provider"] == "vastai" and m["phase"] != "deleted"]


def _kill_mid_rentals(
    server: Server, sim: Sim, rounds: int, attacker: Attacker | None, worker_key: str
) -> list[dict[str, Any]]:
    """SIGKILL the server inside each rental call and start it again; with an attacker, attack every round."""
    kills: list[dict[str, Any]] = []
    for n in range(rounds):
        before = _rents(sim)
        try:
            _wait(lambda before=before: _rents(sim) > before, 30, f"rental call {n + 1}")
        except TimeoutError:
            break  # the fleet is complete: no more rentals to interrupt
        server.kill()  # inside the rental call: the simulator answers 1.5 s later, to nobody
        kills.append({"round": n + 1, "at": time.time(), "rent_calls": _rents(sim)})
        time.sleep(2.0)  # the call completes at the provider meanwhile; the leader lock's TTL runs out
        server.start()
        if attacker is not None:
            attacker.admin_round()
            attacker.machine_round(server.url, worker_key, _tokens(server, sim))
    return kills


def _fleet_after_kills(server: Server, sim: Sim, machines: int, kills: list[dict[str, Any]]) -> dict[str, Any]:
    """Once the fleet settles: machines leaked, doubled or over the maximum."""

    def settled() -> list[dict[str, Any]] | None:
        rows = server.api("GET", "/v1/autoscale/status")["instances"]
        ok = len(_live(sim)) >= machines and all(r["provider_id"] for r in rows if not r.get("destroyed_at"))
        return rows if ok else None

    with contextlib.suppress(TimeoutError):
        _wait(settled, 60, "the fleet to reach min_workers")
    time.sleep(3)  # a few more evaluations: a doubled rental would show now
    rows = server.api("GET", "/v1/autoscale/status")["instances"]
    machines_now = _live(sim)
    recorded = {str(r["provider_id"]) for r in rows if r.get("provider_id") and r["status"] != "terminated"}
    labels = Counter(m["label"] for m in machines_now)
    return {
        "mode": "autoscale",
        "server_kills_mid_rental": len(kills),
        "server_starts": server.starts,
        "rental_calls": _rents(sim),
        "machines_alive": len(machines_now),
        "max_workers": machines,
        "leaked": sorted(m["id"] for m in machines_now if m["id"] not in recorded),
        "doubled": sorted(label for label, count in labels.items() if count > 1),
        "over_max": max(0, len(machines_now) - machines),
    }


def _scale_to_zero(server: Server) -> None:
    server.api(
        "PUT",
        f"/v1/autoscale/queues/{QUEUE}",
        {
            "enabled": True,
            "provider": "v",
            "min_workers": 0,
            "max_workers": 1,
            "poll_interval": "0.3s",
            "boot_timeout": "1s",
            "scale_down": [{"trigger": "idle", "timeout": "1s"}],  # no worker ever boots
            "instance": {"image": "ghcr.io/example/worker:1", "max_price_per_hour": 1.0},
        },
    )


def _hostile_result(attacker: Attacker, listener: Listener, given: dict[str, str]) -> dict[str, Any]:
    return {
        "attacks": attacker.attacks,
        "not_refused": attacker.refusals,
        "foreign_registrations_accepted": attacker.foreign_registrations,
        "own_registrations": attacker.own_registrations,
        "own_registrations_refused": attacker.own_refused,
        "requests_at_listener": len(listener.seen),
        "operator_secrets_at_listener": attacker.leaked(given),
    }
