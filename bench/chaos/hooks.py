"""`python -m bench.chaos --webhooks`: the run with provider webhooks on, as a deployment with `server.public_url`.

An `offload server` process (a free port) receives the simulator's callbacks; every worker's config names it as
`server.public_url`, so every submission carries its own webhook URL. The server reaches Valkey through the
fault proxy like every other client: its hook writes then live through the same dropped replies, resets and
black-holes as the workers' (a delivery that fails is retried by the simulator, and hook.lua is idempotent), so
the run shows what a real network costs webhooks, not what a privileged path would. The simulator signs as each
provider does (Replicate: a Standard Webhooks secret made for the run; fal: its own JWKS; RunPod: nothing) and
injects small webhook faults (drops, duplicates, delays, reorders: `Profile.hook_*`). The fallback poll comes a
third of the profile's `result_ttl` apart, so a job whose completion webhook was lost still finds its result
before the provider forgets it.

The `deploy` fault (`Deploys`, every `server_restart_every` s) restarts the server as a deploy does: SIGTERM, which
must end it cleanly (exit 0, or uvicorn's SIGTERM raised again) within `STOP_BOUND_S`, then the same command on the
same port. The deliveries sent meanwhile find nothing listening (the simulator's retries may miss the gap): their
jobs learn their end from the fallback poll. One server fault at a time (`Server.quiet`): a hostile burst or a
trickled body cut by a restart would prove nothing about the limits it tests.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import secrets
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench import web
from bench.chaos.faults import Profile, Schedule
from bench.chaos.loops import FaultLoop
from bench.chaos.procs import (
    CLEAN_STOP,
    HOST,
    OFFLOAD,
    STOP_BOUND_S,
    free_port,
    graceful_stop,
    reap,
    signal_group,
    spawn,
)

WEBHOOK_BACKENDS = ("fal", "replicate", "runpod")  # the kinds offload has webhooks for (config.WEBHOOK_KINDS)


def check_backend(backend: str) -> None:
    """`--webhooks` needs a backend whose provider calls back; anything else is a usage error, said at once."""
    if backend not in WEBHOOK_BACKENDS:
        raise SystemExit(
            f"error: --webhooks needs a backend with webhooks ({', '.join(WEBHOOK_BACKENDS)}), not {backend!r}: "
            "add e.g. --backend replicate"
        )


class Server:
    """`offload server` on a free port, with the run's config; started once, stopped at the end."""

    def __init__(self, out: Path, env: dict[str, str]) -> None:
        self.out, self.env = out, env
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
        self.quiet = asyncio.Lock()  # one server fault at a time (a restart, a hostile action)
        self._cmd: list[str] = []

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self, config: Path, *extra: str) -> Server:
        cmd = [OFFLOAD, "server", "--config", str(config), "--host", HOST, "--port", str(self.port), *extra]
        self._cmd = [*cmd, "--no-access-log", "--log-level", "warning"]
        return self._launch()

    def restart(self) -> tuple[int | None, float]:
        """A deploy: SIGTERM (its exit code and seconds, SIGKILLed past `STOP_BOUND_S`), then the same command."""
        assert self.proc is not None
        stopped = graceful_stop(self.proc, STOP_BOUND_S)
        self._launch()
        return stopped

    def _launch(self) -> Server:
        self.proc = spawn(self._cmd, self.out / "server.log", self.env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(httpx.TransportError):
                if web.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            time.sleep(0.1)
        raise RuntimeError(f"offload server did not start; see {self.out / 'server.log'}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            signal_group(self.proc, signal.SIGTERM)
            reap(self.proc)

    def backend(self, kind: str, sim_url: str, p: Profile) -> dict[str, Any]:
        """The webhook fields of the workers' (and the server's) backend settings."""
        fields: dict[str, Any] = {
            "webhook_poll_interval_s": round(p.result_ttl / 3, 2),
            "webhook_grace_s": p.hook_grace_s,
        }
        if kind == "replicate":
            fields["webhook_secret"] = self.secret
        elif kind == "fal":
            fields["webhook_jwks_url"] = f"{sim_url}/_sim/fal/jwks.json"
        return fields

    def sim_faults(self, p: Profile) -> dict[str, Any]:
        """`POST /_sim/webhooks`: the run's signing secret and the profile's webhook faults."""
        return {
            "replicate_secret": self.secret,
            "drop_rate": p.hook_drop_rate,
            "duplicate_rate": p.hook_duplicate_rate,
            "reorder_rate": p.hook_reorder_rate,
            "delay_s": p.hook_delay_s,
            "delay_rate": p.hook_delay_rate,
        }


class Deploys(FaultLoop):
    """The `deploy` fault: `server` restarted every `every` s (mean), each noted as `server_restart` with its
    exit code and seconds (a server that did not start again: code "did not start")."""

    def __init__(self, schedule: Schedule, server: Server) -> None:
        super().__init__(schedule)
        self.server = server

    async def act(self) -> None:
        async with self.server.quiet:
            try:
                code, took = await asyncio.to_thread(self.server.restart)
            except RuntimeError as exc:  # (its log names the cause; the run fails on it)
                self.schedule.note("server_restart", "server", code="did not start", seconds=0.0, error=str(exc))
                return
        self.schedule.note("server_restart", "server", code=code, seconds=took)


def summary(deliveries: list[dict[str, Any]], server: Server, timeline: list[dict[str, Any]]) -> dict[str, Any]:
    """What the webhooks did in the run, from the simulator's delivery log: per event, how many went out and
    which faults hit them, and how many were answered 200 by the server; and the server's restarts (`deploy`):
    how many, the longest stop, and the stops that did not end cleanly (`bad`: not `CLEAN_STOP`, or none)."""
    out: dict[str, Any] = {}
    for event in sorted({str(d.get("event", "completed")) for d in deliveries}):
        mine = [d for d in deliveries if d.get("event", "completed") == event]
        faults: Counter[str] = Counter()
        for d in mine:
            faults.update(f for f in ("dropped", "delayed", "reordered") if d.get(f))
            faults["duplicated"] += d.get("copies", 1) > 1
        answered = sum(1 for d in mine if 200 in d.get("statuses", []))
        out[event] = {"sent": len(mine), "answered_200": answered, **dict(faults)}
    out["server_alive_at_end"] = server.alive()
    restarts = [e for e in timeline if e["kind"] == "server_restart"]
    out["server_restarts"] = {
        "n": len(restarts),
        "longest_s": max((e["seconds"] for e in restarts), default=0.0),
        "bad": sum(1 for e in restarts if e["code"] not in CLEAN_STOP),
    }
    return out
