"""GPU rentals: RunPod pods (REST `/v2/pods` and the older GraphQL `/graphql`) and Vast.ai (`/api/v0/...`), in
their wire formats (provider-apis.md B5, B6), over one store of simulated machines.

A machine's life is fixed by timestamps and the config, like a simulated job: created -> running after
`boot_seconds`; on a `broken_hosts` machine the container never starts (RunPod: stuck STARTING; Vast: `loading`,
then `exited` with a Docker error in `status_msg`); with `preempt_after` a running machine vanishes. Out of
stock (RunPod), offers taken between search and rent (Vast `no_such_ask`), failing destroys, 429s and 5xx
outages (the common fault layer, families `pods` and `vastai`) are all configurable. Only test routes
(`/_sim/machines`) see every machine; provider routes see what the provider would show.

Interruptible machines: RunPod's GraphQL `podRentInterruptable` (a `bidPerGpu` at or above the GPU's minimum
bid, which `gpuTypes { lowestPrice { minimumBidPrice uninterruptablePrice stockStatus } }` reports) and Vast.ai
bids (`"type": "bid"` offers carry `min_bid`; the rent body's `price` is the bid). With `spot_preempt_after`
they are pre-empted: a RunPod pod goes EXITED, an outbid Vast.ai instance `stopped` (both still exist and
bill for disk until destroyed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from offload.testing.sim.engine import Call, Dialect, Reply, Sim
from offload.testing.sim.faults import ConnectionReset

OUT_OF_STOCK = (
    "There are no longer any instances available with the requested specifications. Please refresh and try again."
)


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


class PodsDialect(Dialect):
    family = "pods"
    query_key_ok = True
    required = ("id",)

    def error(self, status: int, message: str, *, code: str | None = None) -> Reply:
        return Reply(
            {"title": message.split(":")[0][:60], "status": status, "detail": message},
            status,
            media_type="application/problem+json",
        )


class GraphQLDialect(PodsDialect):
    def error(self, status: int, message: str, *, code: str | None = None) -> Reply:
        return Reply({"errors": [{"message": message}]}, status)


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


# -- RunPod ----------------------------------------------------------------------------------------

RP_STATUS = {"starting": "STARTING", "broken": "STARTING", "running": "RUNNING", "preempted": "EXITED"}


def _pod(sim: Sim, m: SimMachine, now: float) -> dict[str, Any]:
    status = RP_STATUS.get(m.phase(sim, now), "TERMINATED")
    return {
        "id": m.id,
        "name": m.label,
        "image": m.image,
        "status": status,
        "desiredStatus": "EXITED" if status == "EXITED" else "RUNNING",
        "interruptible": m.spot,
        "cost": m.price,
        "costPerHr": m.price,
        "machineId": m.host,
        "gpu": {"id": m.gpu, "count": 1},
        "env": m.env,
        "lastStatusChange": f"{status.lower()} since {m.created:.0f}",
        "runtime": {"uptimeInSeconds": int(now - m.created)} if status == "RUNNING" else None,
    }


def _min_bid(call: Call, gpu: str) -> float:
    cfg = call.sim.config.machines
    return cfg.runpod_spot_gpus.get(gpu, round(cfg.runpod_gpus.get(gpu, 0.0) / 2, 4))


def _runpod_create(
    call: Call,
    store: Machines,
    name: str,
    image: str,
    gpu: str,
    env: dict[str, Any],
    *,
    bid: float | None = None,
    start_cmd: list[str] | str | None = None,
) -> SimMachine:
    cfg = call.sim.config.machines
    if gpu not in cfg.runpod_gpus:
        call.reject(400, f"Invalid GPU type id: {gpu}")
    if gpu in cfg.out_of_stock:
        call.reject(400, OUT_OF_STOCK)
    if bid is not None and bid < _min_bid(call, gpu):
        call.reject(400, f"Your bid of {bid} is below the current minimum bid price of {_min_bid(call, gpu)}.")
    host = f"rp-host-{len(store.all) % 7}"
    price = cfg.runpod_gpus[gpu] if bid is None else bid
    return store.add("runpod", name, image, gpu, price, host, call.now, env, spot=bid is not None, start_cmd=start_cmd)


def runpod_routes(sim: Sim, store: Machines) -> list[Route]:
    d = PodsDialect()

    def rest_gate(call: Call) -> None:
        if call.sim.config.machines.rest_disabled:
            call.reject(404, "Not Found")

    async def create(call: Call) -> Reply | Response:
        rest_gate(call)
        body = await call.json_object()
        if store.create_fails():
            call.reject(503, "Service Unavailable: please retry")
        gpu = (body.get("gpu") or {}).get("id") or ""
        m = _runpod_create(
            call,
            store,
            str(body.get("name") or "my pod"),
            str(body.get("image") or ""),
            gpu,
            body.get("env") or {},
            start_cmd=body.get("dockerStartCmd"),
        )
        if store.create_lost():
            return ConnectionReset()
        return Reply(_pod(sim, m, call.now), 201)

    async def list_pods(call: Call) -> Reply:
        rest_gate(call)
        return Reply({"pods": [_pod(sim, m, call.now) for m in store.visible("runpod", call.now)]})

    async def get_pod(call: Call) -> Reply:
        rest_gate(call)
        m = store.get("runpod", call.request.path_params["pod_id"], call.now)
        if m is None:
            call.reject(404, "pod not found")
        return Reply(_pod(sim, m, call.now))

    async def delete_pod(call: Call) -> Reply:
        rest_gate(call)
        m = store.get("runpod", call.request.path_params["pod_id"], call.now)
        if m is None:
            call.reject(404, "pod not found")
        if store.destroy_fails():
            call.reject(500, "Internal Server Error: terminate failed")
        m.deleted = call.now
        return Reply(None, 204, raw=b"")

    async def graphql(call: Call) -> Reply | Response:
        body = await call.json_object()
        query = str(body.get("query") or "")
        dg = GraphQLDialect()
        if "podFindAndDeployOnDemand" in query or "podRentInterruptable" in query:
            mutation = "podRentInterruptable" if "podRentInterruptable" in query else "podFindAndDeployOnDemand"
            if store.create_fails():
                return dg.error(503, "Service Unavailable: please retry")

            def field_(name: str) -> str:
                found = re.search(name + r':\s*"((?:[^"\\]|\\.)*)"', query)
                return found.group(1) if found else ""

            gpu = field_("gpuTypeId")
            if gpu in call.sim.config.machines.out_of_stock:
                return dg.error(200, OUT_OF_STOCK)
            if gpu not in call.sim.config.machines.runpod_gpus:
                return dg.error(200, f"Invalid GPU type id: {gpu}")
            bid = None
            if mutation == "podRentInterruptable":
                found = re.search(r"bidPerGpu:\s*([0-9.]+)", query)
                bid = float(found.group(1)) if found else 0.0
                if bid < _min_bid(call, gpu):
                    return dg.error(
                        200, f"Your bid of {bid} is below the current minimum bid price of {_min_bid(call, gpu)}."
                    )
            env = dict(re.findall(r'\{key:\s*"([^"]*)",\s*value:\s*"([^"]*)"\}', query))
            m = _runpod_create(
                call,
                store,
                field_("name"),
                field_("imageName"),
                gpu,
                env,
                bid=bid,
                start_cmd=field_("dockerArgs") or None,
            )
            if store.create_lost():
                return ConnectionReset()
            return Reply({"data": {mutation: _pod(sim, m, call.now)}})
        if "gpuTypes" in query:
            cfg = call.sim.config.machines
            wanted = re.search(r'id:\s*"([^"]*)"', query)
            rows = []
            for gpu, price in cfg.runpod_gpus.items():
                if wanted and wanted.group(1) != gpu:
                    continue
                stock = None if gpu in cfg.out_of_stock else "High"
                rows.append(
                    {
                        "id": gpu,
                        "displayName": gpu.replace("NVIDIA ", ""),
                        "lowestPrice": {
                            "minimumBidPrice": _min_bid(call, gpu),
                            "uninterruptablePrice": price,
                            "stockStatus": stock,
                        },
                    }
                )
            return Reply({"data": {"gpuTypes": rows}})
        if "podTerminate" in query:
            pod_id = re.search(r'podId:\s*"([^"]*)"', query)
            gone = store.get("runpod", pod_id.group(1) if pod_id else "", call.now)
            if gone is not None:
                if store.destroy_fails():
                    return dg.error(500, "Something went wrong. Please try again later")
                gone.deleted = call.now
            return Reply({"data": {"podTerminate": None}})
        if "myself" in query:
            return Reply(
                {"data": {"myself": {"pods": [_pod(sim, m, call.now) for m in store.visible("runpod", call.now)]}}}
            )
        if "pod(" in query:
            pod_id = re.search(r'podId:\s*"([^"]*)"', query)
            one = store.get("runpod", pod_id.group(1) if pod_id else "", call.now)
            return Reply({"data": {"pod": _pod(sim, one, call.now) if one else None}})
        return dg.error(400, "unsupported query")

    return [
        Route("/v2/pods", sim.endpoint(d, "pods.create", "submit", create), methods=["POST"]),
        Route("/v2/pods", sim.endpoint(d, "pods.list", "status", list_pods), methods=["GET"]),
        Route("/v2/pods/{pod_id}", sim.endpoint(d, "pods.get", "status", get_pod), methods=["GET"]),
        Route("/v2/pods/{pod_id}", sim.endpoint(d, "pods.delete", "cancel", delete_pod), methods=["DELETE"]),
        Route("/graphql", sim.endpoint(GraphQLDialect(), "pods.graphql", "status", graphql), methods=["POST"]),
    ]


# -- Vast.ai ---------------------------------------------------------------------------------------

VAST_STATUS = {"starting": "loading", "running": "running", "broken": "exited", "preempted": "stopped"}


def _instance(sim: Sim, m: SimMachine, now: float) -> dict[str, Any]:
    phase = m.phase(sim, now)
    status = VAST_STATUS.get(phase)
    msg = (
        "Error response from daemon: failed to create task for container: nvidia-container-cli: initialization error"
        if phase == "broken"
        else ""
    )
    return {
        "id": int(m.id),
        "label": m.label,
        "actual_status": status,
        "is_bid": m.spot,
        "intended_status": "stopped" if phase == "preempted" else "running",
        "cur_state": "running",
        "status_msg": msg,
        "machine_id": int(m.host),
        "gpu_name": m.gpu,
        "num_gpus": 1,
        "dph_total": m.price,
        "image_uuid": m.image,
        "start_date": m.created,
        "extra_env": [[k, v] for k, v in m.env.items()],
    }


def _matches(offer: dict[str, Any], query: dict[str, Any]) -> bool:
    ops: dict[str, Any] = {
        "eq": lambda a, b: a == b,
        "neq": lambda a, b: a != b,
        "gt": lambda a, b: a > b,
        "lt": lambda a, b: a < b,
        "gte": lambda a, b: a >= b,
        "lte": lambda a, b: a <= b,
        "in": lambda a, b: a in b,
        "notin": lambda a, b: a not in b,
    }
    for key, cond in query.items():
        if not isinstance(cond, dict) or key not in offer:
            continue  # like the real API: unknown fields are ignored
        for op, value in cond.items():
            if op in ops and not ops[op](offer[key], value):
                return False
    return True


def vast_routes(sim: Sim, store: Machines) -> list[Route]:
    d = VastDialect()

    def offers(now: float) -> list[dict[str, Any]]:
        out = []
        for o in sim.config.machines.offers:
            row = o.model_dump()
            row.update(
                rentable=True,
                rented=o.id in store.rented_offers,
                verification="verified" if o.verified else "unverified",
                ask_contract_id=o.id,
                host_id=o.machine_id,
                reliability=o.reliability2,
                min_bid=o.min_bid if o.min_bid is not None else round(o.dph_total / 2, 4),
            )
            if not row["rented"]:
                out.append(row)
        return out

    async def search(call: Call) -> Reply:
        query = await call.json_object()
        found = [o for o in offers(call.now) if _matches(o, query)]
        for key, direction in query.get("order") or []:

            def by(o: dict[str, Any], k: str = str(key)) -> float:
                return float(o.get(k, 0) or 0)

            found.sort(key=by, reverse=direction == "desc")
        return Reply({"offers": found[: int(query.get("limit") or 64)]})

    async def rent(call: Call) -> Reply | Response:
        offer_id = int(call.request.path_params["offer_id"])
        body = await call.json_object()
        if store.create_fails():
            return d.error(503, "Service Unavailable", code="server_error")
        offer = next((o for o in sim.config.machines.offers if o.id == offer_id), None)
        if offer is None or offer_id in store.rented_offers or offer_id in sim.config.machines.offer_taken:
            return Reply(
                {
                    "success": False,
                    "error": "no_such_ask",
                    "msg": f"Instance type {offer_id} is no longer available.",
                    "ask_id": offer_id,
                },
                404,
            )
        if not body.get("image"):
            return d.error(400, "image is required", code="invalid_args")
        env = body.get("env") or {}
        bid = body.get("price")
        min_bid = offer.min_bid if offer.min_bid is not None else round(offer.dph_total / 2, 4)
        if bid is not None and float(bid) < min_bid:
            return d.error(400, f"bid price {bid} is below the minimum bid {min_bid}", code="invalid_args")
        m = store.add(
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
        store.rented_offers.add(offer_id)
        m.env["_offer"] = offer_id
        if store.create_lost():
            return ConnectionReset()
        return Reply({"success": True, "new_contract": int(m.id)})

    async def list_instances(call: Call) -> Reply:
        return Reply({"instances": [_instance(sim, m, call.now) for m in store.visible("vastai", call.now)]})

    async def show(call: Call) -> Reply:
        m = store.get("vastai", call.request.path_params["instance_id"], call.now)
        return Reply({"instances": _instance(sim, m, call.now) if m else None})

    async def destroy(call: Call) -> Reply:
        m = store.get("vastai", call.request.path_params["instance_id"], call.now)
        if m is None:
            return d.error(404, "no such instance", code="no_such_instance")
        if store.destroy_fails():
            return d.error(500, "destroy failed, try again", code="server_error")
        m.deleted = call.now
        store.rented_offers.discard(int(m.env.get("_offer", -1)))
        return Reply({"success": True})

    base = "/api/v0"
    return [
        Route(f"{base}/bundles/", sim.endpoint(d, "vastai.search", "status", search), methods=["POST"]),
        Route(f"{base}/asks/{{offer_id}}/", sim.endpoint(d, "vastai.rent", "submit", rent), methods=["PUT"]),
        Route(f"{base}/instances/", sim.endpoint(d, "vastai.list", "status", list_instances), methods=["GET"]),
        Route(f"{base}/instances/{{instance_id}}/", sim.endpoint(d, "vastai.show", "status", show), methods=["GET"]),
        Route(
            f"{base}/instances/{{instance_id}}/",
            sim.endpoint(d, "vastai.destroy", "cancel", destroy),
            methods=["DELETE"],
        ),
    ]


def control_routes(sim: Sim, store: Machines) -> list[Route]:
    """`GET /_sim/machines` (every machine, deleted ones too) and `POST /_sim/machines/{id}/vanish`."""
    import orjson

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


def routes(sim: Sim) -> list[Route]:
    store = Machines(sim)
    return [*control_routes(sim, store), *runpod_routes(sim, store), *vast_routes(sim, store)]
