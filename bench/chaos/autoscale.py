"""`python -m bench.chaos --autoscale`: the offload server SIGKILLed while it rents a GPU machine, again and again.

A real `offload server` autoscales one queue (min_workers machines) against the simulator's Vast.ai API, whose
rental call is slowed (`submit_latency`) so that a kill lands inside it: the harness watches the simulator's
request counter and SIGKILLs the server the moment a rental call arrives, then starts a new server process on the
same Valkey. The journal (an instance is recorded as provisioning, with its `offload-as-…` label, before the
call) must let the new server adopt the machine the dead one was renting instead of renting another. At the
end the queue is scaled to zero (with a boot timeout of 1 s: no worker ever starts on a simulated machine). The
verdict: no machine leaked (alive at the provider with no record, or left after the teardown), none doubled (two
live machines for one label), never more than the queue's maximum.
"""

from __future__ import annotations

import argparse
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

from bench.chaos.procs import HOST, OFFLOAD, Sim, Valkey, base_env, free_port, reap, signal_group, spawn

QUEUE = "gpu"
VAULT_KEY = "chaos-master-key-0123456789abcdef"
SIM_KEY = "k"


class Server:
    """`offload server` as a process that can be SIGKILLed and started again on the same port."""

    def __init__(self, out: Path, config: Path, redis_url: str, admin: str) -> None:
        self.out, self.config, self.redis_url, self.admin = out, config, redis_url, admin
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
            ],
            self.out / f"server-{self.starts}.log",
            env,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
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

    def api(self, method: str, path: str, body: Any = None) -> Any:
        r = httpx.request(
            method, f"{self.url}{path}", json=body, timeout=30, headers={"Authorization": f"Bearer {self.admin}"}
        )
        if r.status_code >= 400:
            raise RuntimeError(f"{method} {path}: {r.status_code} {r.text[:300]}")
        return r.json() if r.content else None


def _config(path: Path, results: Path, machines: int) -> Path:
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
                            "instance": {"image": "ghcr.io/example/worker:1", "max_price_per_hour": 1.0},
                            "scale_down": [{"trigger": "idle", "timeout": "1s"}],
                        }
                    }
                },
                "autoscaler": {
                    "public_url": "https://cp.example.com",
                    "worker_key": "ofk_placeholder",
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


def _wait(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, RuntimeError):
            if got := check():
                return got
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")


def main(args: argparse.Namespace) -> dict[str, Any]:
    out = args.out or Path(tempfile.mkdtemp(prefix="offload-chaos-autoscale-"))
    out.mkdir(parents=True, exist_ok=True)
    machines, rounds = 3, 6
    valkey = Valkey(out / "valkey", "always").start()
    sim = Sim(out, 0).start()
    server = Server(
        out, _config(out / "offload.yaml", out / "results", machines), valkey.url, "admin-" + secrets.token_hex(12)
    )
    kills: list[dict[str, Any]] = []
    try:
        sim.post(
            "/_sim/config",
            {
                "api_key": SIM_KEY,
                "seed": args.seed,
                "machines": {"boot_seconds": 0.5},
                "families": {"vastai": {"submit_latency": 1.5}},
            },
        )
        server.start()
        server.api(
            "POST",
            "/v1/autoscale/providers",
            {
                "name": "v",
                "type": "vastai",
                "config": {"api_key": SIM_KEY, "base_url": sim.url, "gpu_name": "RTX 4090"},
            },
        )

        def rents() -> int:
            return int(sim.get("/_sim/stats")["requests"].get("vastai.rent", 0))

        for n in range(rounds):
            before = rents()
            try:
                _wait(lambda before=before: rents() > before, 30, f"rental call {n + 1}")
            except TimeoutError:
                break  # the fleet is complete: no more rentals to interrupt
            server.kill()  # inside the rental call: the simulator answers 1.5 s later, to nobody
            kills.append({"round": n + 1, "at": time.time(), "rent_calls": rents()})
            time.sleep(2.0)  # the call completes at the provider meanwhile; the leader lock's TTL runs out
            server.start()

        def live() -> list[dict[str, Any]]:
            return [
                m
                for m in sim.get("/_sim/machines")["machines"]
                if m["provider"] == "vastai" and m["phase"] != "deleted"
            ]

        def settled() -> list[dict[str, Any]] | None:
            rows = server.api("GET", "/v1/autoscale/status")["instances"]
            ok = len(live()) >= machines and all(r["provider_id"] for r in rows if not r.get("destroyed_at"))
            return rows if ok else None

        with contextlib.suppress(TimeoutError):
            _wait(settled, 60, "the fleet to reach min_workers")
        time.sleep(3)  # a few more evaluations: a doubled rental would show now
        rows = server.api("GET", "/v1/autoscale/status")["instances"]
        machines_now = live()
        recorded = {str(r["provider_id"]) for r in rows if r.get("provider_id") and r["status"] != "terminated"}
        labels = Counter(m["label"] for m in machines_now)
        result: dict[str, Any] = {
            "mode": "autoscale",
            "server_kills_mid_rental": len(kills),
            "server_starts": server.starts,
            "rental_calls": rents(),
            "machines_alive": len(machines_now),
            "max_workers": machines,
            "leaked": sorted(m["id"] for m in machines_now if m["id"] not in recorded),
            "doubled": sorted(label for label, count in labels.items() if count > 1),
            "over_max": max(0, len(machines_now) - machines),
        }
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
        with contextlib.suppress(TimeoutError):
            _wait(lambda: not live(), 90, "the teardown")
        result["left_after_teardown"] = len(live())
        result["ok"] = not (
            result["leaked"] or result["doubled"] or result["over_max"] or result["left_after_teardown"]
        )
        return result
    finally:
        for stop in (server.stop, sim.stop, valkey.stop):
            with contextlib.suppress(Exception):
                stop()
