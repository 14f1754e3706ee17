"""RunPod pods, in RunPod's wire formats: REST (`/v2/pods`) and the older GraphQL (`/graphql`), over the shared
machine store (`machines`).

Out of stock answers like RunPod does (REST 400, GraphQL an `errors` body with a 200). A RunPod pod on a
`broken_hosts` machine is stuck STARTING. As on RunPod, a create names no host and no price: `runpod_place_on`
puts the next pods on given hosts, and `runpod_billed` makes a GPU's new pods report a costPerHr other than the
listed price. Interruptible pods come from GraphQL's `podRentInterruptable`: a
`bidPerGpu` at or above the GPU's minimum bid, which `gpuTypes { lowestPrice { minimumBidPrice
uninterruptablePrice stockStatus } }` reports; a pre-empted one goes EXITED (it still exists, and bills for
disk, until terminated).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from starlette.responses import Response
from starlette.routing import Route

from offload.testing.sim.engine import Call, Dialect, Reply, Sim
from offload.testing.sim.faults import ConnectionReset
from offload.testing.sim.machines import Machines, SimMachine

OUT_OF_STOCK = (
    "There are no longer any instances available with the requested specifications. Please refresh and try again."
)
STATUS = {"starting": "STARTING", "broken": "STARTING", "running": "RUNNING", "preempted": "EXITED"}
ON_DEMAND = "podFindAndDeployOnDemand"
SPOT = "podRentInterruptable"
POD_ID = re.compile(r'podId:\s*"([^"]*)"')


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


GRAPHQL = GraphQLDialect()


def pod_view(sim: Sim, m: SimMachine, now: float) -> dict[str, Any]:
    status = STATUS.get(m.phase(sim, now), "TERMINATED")
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


def _low_bid(call: Call, gpu: str, bid: float) -> str:
    return f"Your bid of {bid} is below the current minimum bid price of {_min_bid(call, gpu)}."


def _create(
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
        call.reject(400, _low_bid(call, gpu, bid))
    host = store.placement() or f"rp-host-{len(store.all) % 7}"
    price = cfg.runpod_billed.get(gpu, cfg.runpod_gpus[gpu]) if bid is None else bid
    return store.add("runpod", name, image, gpu, price, host, call.now, env, spot=bid is not None, start_cmd=start_cmd)


def _field(query: str, name: str) -> str:
    """A string argument of a GraphQL mutation (`name: "value"`), or ""."""
    found = re.search(name + r':\s*"((?:[^"\\]|\\.)*)"', query)
    return found.group(1) if found else ""


def _pod_id(query: str) -> str:
    found = POD_ID.search(query)
    return found.group(1) if found else ""


class PodsApi:
    """The REST routes and the GraphQL operations, one method each."""

    def __init__(self, sim: Sim, store: Machines) -> None:
        self.sim = sim
        self.store = store
        # GraphQL operations by the first name the query mentions, in this order
        self.operations: tuple[tuple[str, Callable[[Call, str], Reply | Response]], ...] = (
            (SPOT, self.gql_rent_spot),
            (ON_DEMAND, self.gql_rent_on_demand),
            ("gpuTypes", self.gql_gpu_types),
            ("podTerminate", self.gql_terminate),
            ("myself", self.gql_myself),
            ("pod(", self.gql_pod),
        )

    def _pod(self, m: SimMachine, call: Call) -> dict[str, Any]:
        return pod_view(self.sim, m, call.now)

    def _rest_gate(self, call: Call) -> None:
        if call.sim.config.machines.rest_disabled:
            call.reject(404, "Not Found")

    def _found(self, call: Call) -> SimMachine:
        m = self.store.get("runpod", call.request.path_params["pod_id"], call.now)
        if m is None:
            call.reject(404, "pod not found")
        return m

    async def create(self, call: Call) -> Reply | Response:
        self._rest_gate(call)
        body = await call.json_object()
        if self.store.create_fails():
            call.reject(503, "Service Unavailable: please retry")
        gpu = (body.get("gpu") or {}).get("id") or ""
        m = _create(
            call,
            self.store,
            str(body.get("name") or "my pod"),
            str(body.get("image") or ""),
            gpu,
            body.get("env") or {},
            start_cmd=body.get("dockerStartCmd"),
        )
        if self.store.create_lost():
            return ConnectionReset()
        return Reply(self._pod(m, call), 201)

    async def list_pods(self, call: Call) -> Reply:
        self._rest_gate(call)
        return Reply({"pods": [self._pod(m, call) for m in self.store.visible("runpod", call.now)]})

    async def get_pod(self, call: Call) -> Reply:
        self._rest_gate(call)
        return Reply(self._pod(self._found(call), call))

    async def delete_pod(self, call: Call) -> Reply:
        self._rest_gate(call)
        m = self._found(call)
        if self.store.destroy_fails():
            call.reject(500, "Internal Server Error: terminate failed")
        m.deleted = call.now
        return Reply(None, 204, raw=b"")

    async def graphql(self, call: Call) -> Reply | Response:
        body = await call.json_object()
        query = str(body.get("query") or "")
        for name, operation in self.operations:
            if name in query:
                return operation(call, query)
        return GRAPHQL.error(400, "unsupported query")

    def gql_rent_on_demand(self, call: Call, query: str) -> Reply | Response:
        return self._gql_rent(call, query, ON_DEMAND)

    def gql_rent_spot(self, call: Call, query: str) -> Reply | Response:
        return self._gql_rent(call, query, SPOT)

    def _gql_rent(self, call: Call, query: str, mutation: str) -> Reply | Response:
        if self.store.create_fails():
            return GRAPHQL.error(503, "Service Unavailable: please retry")
        gpu = _field(query, "gpuTypeId")
        if gpu in call.sim.config.machines.out_of_stock:
            return GRAPHQL.error(200, OUT_OF_STOCK)
        if gpu not in call.sim.config.machines.runpod_gpus:
            return GRAPHQL.error(200, f"Invalid GPU type id: {gpu}")
        bid = None
        if mutation == SPOT:
            found = re.search(r"bidPerGpu:\s*([0-9.]+)", query)
            bid = float(found.group(1)) if found else 0.0
            if bid < _min_bid(call, gpu):
                return GRAPHQL.error(200, _low_bid(call, gpu, bid))
        env = dict(re.findall(r'\{key:\s*"([^"]*)",\s*value:\s*"([^"]*)"\}', query))
        m = _create(
            call,
            self.store,
            _field(query, "name"),
            _field(query, "imageName"),
            gpu,
            env,
            bid=bid,
            start_cmd=_field(query, "dockerArgs") or None,
        )
        if self.store.create_lost():
            return ConnectionReset()
        return Reply({"data": {mutation: self._pod(m, call)}})

    def gql_gpu_types(self, call: Call, query: str) -> Reply:
        cfg = call.sim.config.machines
        wanted = re.search(r'id:\s*"([^"]*)"', query)
        rows = [
            {
                "id": gpu,
                "displayName": gpu.replace("NVIDIA ", ""),
                "lowestPrice": {
                    "minimumBidPrice": _min_bid(call, gpu),
                    "uninterruptablePrice": price,
                    "stockStatus": None if gpu in cfg.out_of_stock else "High",
                },
            }
            for gpu, price in cfg.runpod_gpus.items()
            if not wanted or wanted.group(1) == gpu
        ]
        return Reply({"data": {"gpuTypes": rows}})

    def gql_terminate(self, call: Call, query: str) -> Reply:
        gone = self.store.get("runpod", _pod_id(query), call.now)
        if gone is not None:
            if self.store.destroy_fails():
                return GRAPHQL.error(500, "Something went wrong. Please try again later")
            gone.deleted = call.now
        return Reply({"data": {"podTerminate": None}})

    def gql_myself(self, call: Call, query: str) -> Reply:
        pods = [self._pod(m, call) for m in self.store.visible("runpod", call.now)]
        return Reply({"data": {"myself": {"pods": pods}}})

    def gql_pod(self, call: Call, query: str) -> Reply:
        one = self.store.get("runpod", _pod_id(query), call.now)
        return Reply({"data": {"pod": self._pod(one, call) if one else None}})


def routes(sim: Sim, store: Machines) -> list[Route]:
    api = PodsApi(sim, store)
    d = PodsDialect()
    return [
        Route("/v2/pods", sim.endpoint(d, "pods.create", "submit", api.create), methods=["POST"]),
        Route("/v2/pods", sim.endpoint(d, "pods.list", "status", api.list_pods), methods=["GET"]),
        Route("/v2/pods/{pod_id}", sim.endpoint(d, "pods.get", "status", api.get_pod), methods=["GET"]),
        Route("/v2/pods/{pod_id}", sim.endpoint(d, "pods.delete", "cancel", api.delete_pod), methods=["DELETE"]),
        Route("/graphql", sim.endpoint(GRAPHQL, "pods.graphql", "status", api.graphql), methods=["POST"]),
    ]
