"""Vast.ai (`/api/v0/...`), in its wire format, over the shared machine store (`machines`): search offers, rent
one, list, show and destroy instances.

An offer taken between search and rent answers `no_such_ask`. On a `broken_hosts` machine the container never
starts: `loading`, then `exited` with a Docker error in `status_msg`. Bids: `"type": "bid"` offers carry
`min_bid`, and the rent body's `price` is the bid; an outbid (pre-empted) instance is `stopped`, and still exists
and bills for disk until destroyed.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from starlette.responses import Response
from starlette.routing import Route

from offload.testing.sim.config import Offer
from offload.testing.sim.engine import Call, Dialect, Reply, Sim
from offload.testing.sim.faults import ConnectionReset
from offload.testing.sim.machines import Machines, SimMachine

STATUS = {"starting": "loading", "running": "running", "broken": "exited", "preempted": "stopped"}
BROKEN_MSG = (
    "Error response from daemon: failed to create task for container: nvidia-container-cli: initialization error"
)
OPERATORS: dict[str, Callable[[Any, Any], Any]] = {  # the search query's operators
    "eq": operator.eq,
    "neq": operator.ne,
    "gt": operator.gt,
    "lt": operator.lt,
    "gte": operator.ge,
    "lte": operator.le,
    "in": lambda a, b: a in b,
    "notin": lambda a, b: a not in b,
}


class VastDialect(Dialect):
    family = "vastai"
    query_key_ok = True
    required = ("offers", "instances", "success")

    def error(self, status: int, message: str, *, code: str | None = None) -> Reply:
        return Reply({"success": False, "error": code or "error", "msg": message}, status)

    def unauthorized(self) -> Reply:
        return self.error(401, "Invalid user key", code="auth_error")

    def throttled(self, behaviour: Any, headers: dict[str, str]) -> Reply:
        return Reply({"detail": "API requests too frequent endpoint threshold=4.5"}, 429)  # no Retry-After


def instance_view(sim: Sim, m: SimMachine, now: float) -> dict[str, Any]:
    phase = m.phase(sim, now)
    return {
        "id": int(m.id),
        "label": m.label,
        "actual_status": STATUS.get(phase),
        "is_bid": m.spot,
        "intended_status": "stopped" if phase == "preempted" else "running",
        "cur_state": "running",
        "status_msg": BROKEN_MSG if phase == "broken" else "",
        "machine_id": int(m.host),
        "gpu_name": m.gpu,
        "num_gpus": 1,
        "dph_total": m.price,
        "image_uuid": m.image,
        "start_date": m.created,
        "extra_env": [[k, v] for k, v in m.env.items()],
    }


def _matches(offer: dict[str, Any], query: dict[str, Any]) -> bool:
    for key, cond in query.items():
        if not isinstance(cond, dict) or key not in offer:
            continue  # like the real API: unknown fields are ignored
        field = offer[key]
        if key == "geolocation":  # the real API filters it by the two-letter country code ("Oregon, US": US)
            field = str(field).rsplit(",", 1)[-1].strip().upper()
        for op, value in cond.items():
            if op in OPERATORS and not OPERATORS[op](field, value):
                return False
    return True


def _min_bid(offer: Offer) -> float:
    return offer.min_bid if offer.min_bid is not None else round(offer.dph_total / 2, 4)


def _no_such_ask(offer_id: int) -> Reply:
    body = {
        "success": False,
        "error": "no_such_ask",
        "msg": f"Instance type {offer_id} is no longer available.",
        "ask_id": offer_id,
    }
    return Reply(body, 404)


class VastApi:
    """The routes' handlers, one method each."""

    def __init__(self, sim: Sim, store: Machines) -> None:
        self.sim = sim
        self.store = store
        self.dialect = VastDialect()

    def _offers(self) -> list[dict[str, Any]]:
        """The offers not rented now, as the search answers them."""
        out = []
        for o in self.sim.config.machines.offers:
            row = o.model_dump()
            row.update(
                rentable=True,
                rented=o.id in self.store.rented_offers,
                verification="verified" if o.verified else "unverified",
                ask_contract_id=o.id,
                host_id=o.machine_id,
                reliability=o.reliability2,
                min_bid=_min_bid(o),
            )
            if not row["rented"]:
                out.append(row)
        return out

    async def search(self, call: Call) -> Reply:
        query = await call.json_object()
        found = [o for o in self._offers() if _matches(o, query)]
        for key, direction in query.get("order") or []:

            def by(o: dict[str, Any], k: str = str(key)) -> float:
                return float(o.get(k, 0) or 0)

            found.sort(key=by, reverse=direction == "desc")
        return Reply({"offers": found[: int(query.get("limit") or 64)]})

    async def rent(self, call: Call) -> Reply | Response:
        offer_id = int(call.request.path_params["offer_id"])
        body = await call.json_object()
        if self.store.create_fails():
            return self.dialect.error(503, "Service Unavailable", code="server_error")
        cfg = self.sim.config.machines
        offer = next((o for o in cfg.offers if o.id == offer_id), None)
        if offer is None or offer_id in self.store.rented_offers or offer_id in cfg.offer_taken:
            return _no_such_ask(offer_id)
        if not body.get("image"):
            return self.dialect.error(400, "image is required", code="invalid_args")
        env = body.get("env") or {}
        bid = body.get("price")
        if bid is not None and float(bid) < _min_bid(offer):
            return self.dialect.error(
                400, f"bid price {bid} is below the minimum bid {_min_bid(offer)}", code="invalid_args"
            )
        m = self.store.add(
            "vastai",
            str(body.get("label") or ""),
            str(body["image"]),
            offer.gpu_name,
            offer.dph_total if bid is None else float(bid),
            str(offer.machine_id),
            call.now,
            env if isinstance(env, dict) else {},
            spot=bid is not None,
            start_cmd=body.get("args"),
        )
        self.store.rented_offers.add(offer_id)
        m.env["_offer"] = offer_id
        if self.store.create_lost():
            return ConnectionReset()
        return Reply({"success": True, "new_contract": int(m.id)})

    async def list_instances(self, call: Call) -> Reply:
        rows = [instance_view(self.sim, m, call.now) for m in self.store.visible("vastai", call.now)]
        return Reply({"instances": rows})

    async def show(self, call: Call) -> Reply:
        m = self.store.get("vastai", call.request.path_params["instance_id"], call.now)
        return Reply({"instances": instance_view(self.sim, m, call.now) if m else None})

    async def destroy(self, call: Call) -> Reply:
        m = self.store.get("vastai", call.request.path_params["instance_id"], call.now)
        if m is None:
            return self.dialect.error(404, "no such instance", code="no_such_instance")
        if self.store.destroy_fails():
            return self.dialect.error(500, "destroy failed, try again", code="server_error")
        m.deleted = call.now
        self.store.rented_offers.discard(int(m.env.get("_offer", -1)))
        return Reply({"success": True})


def routes(sim: Sim, store: Machines) -> list[Route]:
    api = VastApi(sim, store)
    d = api.dialect
    base = "/api/v0"
    instance = f"{base}/instances/{{instance_id}}/"
    return [
        Route(f"{base}/bundles/", sim.endpoint(d, "vastai.search", "status", api.search), methods=["POST"]),
        Route(f"{base}/asks/{{offer_id}}/", sim.endpoint(d, "vastai.rent", "submit", api.rent), methods=["PUT"]),
        Route(f"{base}/instances/", sim.endpoint(d, "vastai.list", "status", api.list_instances), methods=["GET"]),
        Route(instance, sim.endpoint(d, "vastai.show", "status", api.show), methods=["GET"]),
        Route(instance, sim.endpoint(d, "vastai.destroy", "cancel", api.destroy), methods=["DELETE"]),
    ]
