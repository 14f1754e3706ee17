"""The simulated GPU machines behind both rental APIs (RunPod pods in `pods_api`, Vast.ai in `vastai_api`): one
store, and the test routes (`/_sim/machines`) that see every machine; provider routes see what the provider would
show.

A machine's life is fixed by timestamps and the config, like a simulated job: created -> running after
`boot_seconds`; on a `broken_hosts` machine the container never starts; with `preempt_after` a running machine
vanishes, and with `spot_preempt_after` an interruptible one is pre-empted. Failing creates, lost create answers,
failing destroys and forced RunPod placements (`runpod_place_on`) are counted here, so both providers draw from
the same budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from offload.testing.sim.engine import Sim


@dataclass
class SimMachine:
    id: str
    provider: str  # runpod | vastai
    label: str
    image: str
    gpu: str
    price: float
    host: str
    created: float
    env: dict[str, Any] = field(default_factory=dict)
    deleted: float | None = None
    spot: bool = False
    start_cmd: list[str] | str | None = None

    def phase(self, sim: Sim, now: float) -> str:
        cfg = sim.config.machines
        if self.deleted is not None:
            return "deleted"
        up = self.created + cfg.boot_seconds
        if self.host in cfg.broken_hosts:
            return "broken" if now >= up else "starting"
        if now < up:
            return "starting"
        if cfg.preempt_after is not None and now >= up + cfg.preempt_after:
            return "vanished"
        if self.spot and cfg.spot_preempt_after is not None and now >= up + cfg.spot_preempt_after:
            return "preempted"
        return "running"


class Machines:
    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.all: dict[str, SimMachine] = {}
        self.rented_offers: set[int] = set()
        self.destroy_failures_used = 0
        self.create_errors_used = 0
        self.create_lost_used = 0
        self.placed_used = 0
        self.seq = 0

    def visible(self, provider: str, now: float) -> list[SimMachine]:
        return [
            m
            for m in self.all.values()
            if m.provider == provider and m.phase(self.sim, now) not in ("deleted", "vanished")
        ]

    def get(self, provider: str, machine_id: str, now: float) -> SimMachine | None:
        m = self.all.get(machine_id)
        if m is None or m.provider != provider or m.phase(self.sim, now) in ("deleted", "vanished"):
            return None
        return m

    def add(
        self,
        provider: str,
        label: str,
        image: str,
        gpu: str,
        price: float,
        host: str,
        now: float,
        env: dict[str, Any],
        *,
        spot: bool = False,
        start_cmd: list[str] | str | None = None,
    ) -> SimMachine:
        self.seq += 1
        mid = f"{self.sim.token(14)}" if provider == "runpod" else str(7_000_000 + self.seq)
        m = SimMachine(mid, provider, label, image, gpu, price, host, now, env, spot=spot, start_cmd=start_cmd)
        self.all[mid] = m
        return m

    def placement(self) -> str | None:
        """The host `runpod_place_on` names for the next pod (None: the usual spread)."""
        hosts = self.sim.config.machines.runpod_place_on
        if self.placed_used < len(hosts):
            self.placed_used += 1
            return hosts[self.placed_used - 1]
        return None

    def destroy_fails(self) -> bool:
        if self.destroy_failures_used < self.sim.config.machines.destroy_failures:
            self.destroy_failures_used += 1
            return True
        return False

    def create_fails(self) -> bool:
        """A create answered 503 with nothing rented (`create_errors`)."""
        if self.create_errors_used < self.sim.config.machines.create_errors:
            self.create_errors_used += 1
            return True
        return False

    def create_lost(self) -> bool:
        """A create that rents the machine, then loses its answer (`create_lost`)."""
        if self.create_lost_used < self.sim.config.machines.create_lost:
            self.create_lost_used += 1
            return True
        return False


def control_routes(sim: Sim, store: Machines) -> list[Route]:
    """`GET /_sim/machines` (every machine, deleted ones too) and `POST /_sim/machines/{id}/vanish`."""

    async def listing(request: Request) -> Response:
        now = sim.clock()
        rows = [
            {
                "id": m.id,
                "provider": m.provider,
                "label": m.label,
                "phase": m.phase(sim, now),
                "host": m.host,
                "price": m.price,
                "env": m.env,
                "spot": m.spot,
                "start_cmd": m.start_cmd,
                "gpu": m.gpu,
            }
            for m in store.all.values()
        ]
        return Response(orjson.dumps({"machines": rows}), media_type="application/json")

    async def vanish(request: Request) -> Response:
        m = store.all.get(request.path_params["machine_id"])
        if m is None:
            return Response(b'{"error": "not found"}', 404, media_type="application/json")
        m.deleted = sim.clock()
        return Response(b'{"ok": true}', media_type="application/json")

    return [
        Route("/_sim/machines", listing, methods=["GET"]),
        Route("/_sim/machines/{machine_id}/vanish", vanish, methods=["POST"]),
    ]
