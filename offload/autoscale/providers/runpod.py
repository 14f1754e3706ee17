"""`runpod`: RunPod GPU pods. REST (`/v2/pods`, problem+json errors) is the current API; the older GraphQL API
(`podFindAndDeployOnDemand`, `myself { pods }`, `podTerminate`) is the fallback, used when the REST routes
answer 404/410/501 (not offered for the account or region) or when `api: graphql` is set.

Rentals go through the GPU preference list in order, since the cheap types are often out of stock. Out of
stock is recognised by its message ("no longer any instances available"), which RunPod uses in both APIs; the
exact REST status for it is UNVERIFIED (see provider-apis.md), so any non-2xx carrying that text counts.
A create that fails with a 5xx or a dropped connection may still have rented a pod: it is reported as
ambiguous and the scaler looks the pod up by its `offload-…` name instead of renting again.

Prices come from GraphQL `gpuTypes { lowestPrice { uninterruptablePrice minimumBidPrice stockStatus } }` (as
runpod-python's `get_gpu` asks; a null stockStatus is read as none in stock, which is UNVERIFIED). Spot
(`instance.spot`) pods are rented with GraphQL `podRentInterruptable` (REST v2 documents no bid field), bidding
10 % over the current minimum bid, never above the queue's `spot_max_price`.
"""

from __future__ import annotations

import builtins
import shlex
from typing import Any, Literal

import orjson
from pydantic import Field

from offload.autoscale.providers.base import (
    WORKER_KEY_HELP,
    Http,
    LaunchSpec,
    Machine,
    MachineState,
    NotOurs,
    OutOfCapacity,
    Provider,
    ProviderConfig,
    ProviderError,
    Unauthorized,
    is_ours,
)

CUDA_VERSIONS = ("11.8", "12.0", "12.1", "12.2", "12.3", "12.4", "12.5", "12.6", "12.7", "12.8", "12.9", "13.0")
OUT_OF_STOCK = (
    "no longer any instances available",
    "out of stock",
    "no available",
    "not enough capacity",
    "minimum bid",
)
SPOT_MARGIN = 1.1  # bid this much over the current minimum bid: less likely to be outbid at once
REST_STATES = {
    "PROVISIONING": MachineState.PENDING,
    "STARTING": MachineState.STARTING,
    "RUNNING": MachineState.RUNNING,
    "EXITED": MachineState.STOPPED,
    "ERROR": MachineState.FAILED,
    "TERMINATED": MachineState.TERMINATED,
}
POD_FIELDS = "id name desiredStatus costPerHr machineId lastStatusChange runtime { uptimeInSeconds }"


class RunPodConfig(ProviderConfig):
    api_key: str = Field(..., description="RunPod API key")
    base_url: str = Field("https://api.runpod.io", description="the API's address (the simulator's, to rehearse)")
    api: Literal["auto", "rest", "graphql"] = Field("auto", description="REST /v2/pods, falling back to GraphQL")
    gpu_type_id: str | None = Field(None, description="exact GPU id, e.g. NVIDIA GeForce RTX 4090")
    gpu_type_ids: list[str] = Field(default_factory=list, description="GPU ids in order of preference (JSON list)")
    cloud_type: Literal["SECURE", "COMMUNITY", "ALL"] = Field("SECURE", description="RunPod cloud")
    container_disk_gb: int | None = Field(None, ge=1, description="container disk when the queue sets none")
    volume_in_gb: int | None = Field(None, ge=10, description="optional persistent volume (none by default)")
    volume_mount_path: str = Field("/workspace", description="where the volume is mounted")
    min_cuda_version: str | None = Field(None, description="only hosts with this CUDA version or newer")
    ports: list[str] = Field(default_factory=list, description='ports to expose, e.g. ["8888/http"] (JSON list)')
    data_center_ids: list[str] = Field(default_factory=list, description="allowed data centers (JSON list)")
    worker_key: str | None = Field(None, description=WORKER_KEY_HELP)


def _out_of_stock(text: str) -> bool:
    low = text.lower()
    return any(marker in low for marker in OUT_OF_STOCK)


class RunPodProvider(Provider):
    type = "runpod"
    Config = RunPodConfig
    secret_fields = ("api_key", "worker_key")

    def __init__(self, name: str, config: RunPodConfig, http: Http | None = None) -> None:
        super().__init__(name)
        self.config = config
        self.http = http or Http(config.base_url, {"Authorization": f"Bearer {config.api_key}"})
        self.use_graphql = config.api == "graphql"

    # -- shared ----------------------------------------------------------------------------------

    def _cuda(self) -> list[str] | None:
        if not self.config.min_cuda_version:
            return None
        if self.config.min_cuda_version not in CUDA_VERSIONS:
            raise ProviderError(f"runpod: unknown min_cuda_version {self.config.min_cuda_version!r}", retryable=False)
        return list(CUDA_VERSIONS[CUDA_VERSIONS.index(self.config.min_cuda_version) :])

    def _gpus(self, spec: LaunchSpec) -> list[str]:
        gpus = self.config.gpu_type_ids or ([self.config.gpu_type_id] if self.config.gpu_type_id else [])
        if not gpus and spec.gpu:
            gpus = [spec.gpu]
        if not gpus:
            raise ProviderError(
                "runpod: no GPU type (set gpu_type_ids / gpu_type_id, or the queue's instance.gpu)", retryable=False
            )
        return gpus

    def _check(self, response: Any, what: str) -> None:
        if response.status_code == 401 or response.status_code == 403:
            raise Unauthorized(f"runpod: {what}: the API key was rejected (HTTP {response.status_code})")

    async def _prices(self, gpu: str, count: int) -> dict[str, Any]:
        query = (
            "query { gpuTypes(input: {id: " + orjson.dumps(gpu).decode() + "}) { id lowestPrice(input: "
            "{gpuCount: " + str(count) + "}) { minimumBidPrice uninterruptablePrice stockStatus } } }"
        )
        data = await self._gql(query, "prices")
        for row in data.get("gpuTypes") or []:
            if row.get("id") == gpu and row.get("lowestPrice") and row["lowestPrice"].get("stockStatus"):
                found: dict[str, Any] = row["lowestPrice"]
                return found
        return {}

    def _offer(self, prices: dict[str, Any], spec: LaunchSpec) -> float | None:
        """The hourly price of this rental from a GPU's lowest prices (None: no stock, or over the cap)."""
        key = "minimumBidPrice" if spec.spot else "uninterruptablePrice"
        per_gpu = _float(prices.get(key))
        if not per_gpu:
            return None
        cap = spec.spot_max_price if spec.spot else spec.max_price_per_hour
        if cap is not None and per_gpu * spec.gpu_count > cap:
            return None
        return per_gpu * spec.gpu_count

    async def _over_cap(self, spec: LaunchSpec, gpu: str) -> None:
        """An on-demand create cannot name a price: a GPU type listed over max_price_per_hour is not rented."""
        cap = spec.max_price_per_hour
        if cap is None:
            return
        listed = _float((await self._prices(gpu, spec.gpu_count)).get("uninterruptablePrice"))
        if listed and listed * spec.gpu_count > cap:
            raise OutOfCapacity(
                f"runpod: {gpu}: listed at ${listed * spec.gpu_count:.3f}/h, over max_price_per_hour ${cap:.3f}"
            )

    async def quote(self, spec: LaunchSpec) -> float | None:
        """The price of the first GPU type in preference order that is in stock (the one a create would get)."""
        for gpu in self._gpus(spec):
            price = self._offer(await self._prices(gpu, spec.gpu_count), spec)
            if price is not None:
                return price
        return None

    async def create(self, spec: LaunchSpec) -> Machine:
        if not spec.image:
            raise ProviderError("runpod: no image (set the queue's instance.image)", retryable=False)
        tried: list[str] = []
        over: list[str] = []
        last = ""
        for gpu in self._gpus(spec):
            try:
                if spec.spot:
                    return await self._spot_create(spec, gpu)
                await self._over_cap(spec, gpu)
                if not self.use_graphql:
                    try:
                        return await self._rest_create(spec, gpu)
                    except _RestUnavailable:
                        self.use_graphql = True
                return await self._gql_create(spec, gpu)
            except OutOfCapacity as exc:
                last = str(exc)
                (over if "max_price_per_hour" in last else tried).append(gpu)
        if spec.spot:
            raise OutOfCapacity(last)
        if over and not tried:
            raise OutOfCapacity(last if len(over) == 1 else f"runpod: {', '.join(over)}: over max_price_per_hour")
        raise OutOfCapacity(f"runpod: out of stock for {', '.join(tried)} ({self.config.cloud_type} cloud)")

    async def list(self) -> builtins.list[Machine]:
        if not self.use_graphql:
            try:
                return await self._rest_list()
            except _RestUnavailable:
                self.use_graphql = True
        return await self._gql_list()

    async def get(self, provider_id: str) -> Machine | None:
        if not self.use_graphql:
            try:
                return await self._rest_get(provider_id)
            except _RestUnavailable:
                self.use_graphql = True
        return await self._gql_get(provider_id)

    async def destroy(self, provider_id: str) -> None:
        machine = await self.get(provider_id)
        if machine is None:
            return
        if not is_ours(machine.label):
            raise NotOurs(provider_id, machine.label)
        if self.use_graphql:
            pod_id = orjson.dumps(provider_id).decode()
            await self._gql("mutation { podTerminate(input: {podId: " + pod_id + "}) }", "terminate")
            return
        r = await self.http.request("DELETE", f"/v2/pods/{provider_id}")
        self._check(r, "terminate")
        if r.status_code not in (200, 202, 204, 404):
            raise ProviderError(f"runpod: terminate {provider_id}: HTTP {r.status_code} {self.http.excerpt(r)}")

    async def aclose(self) -> None:
        await self.http.aclose()

    # -- REST ------------------------------------------------------------------------------------

    @staticmethod
    def _rest_machine(pod: dict[str, Any]) -> Machine:
        return Machine(
            provider_id=str(pod["id"]),
            label=str(pod.get("name") or ""),
            state=REST_STATES.get(str(pod.get("status") or "").upper(), MachineState.PENDING),
            price_per_hour=_float(pod.get("cost")),
            host_id=pod.get("machineId"),
            message=str(pod.get("lastStatusChange") or ""),
            raw=pod,
        )

    def _rest_gone(self, r: Any) -> None:
        """A 404/410/501 with no problem body naming a pod means the route itself is missing."""
        if r.status_code in (410, 501) or (r.status_code == 404 and "pod" not in r.text.lower()):
            raise _RestUnavailable(f"RunPod REST pods route answered {r.status_code}: switching to GraphQL")

    async def _rest_create(self, spec: LaunchSpec, gpu: str) -> Machine:
        body: dict[str, Any] = {
            "name": spec.label,
            "image": spec.image,
            "cloud": self.config.cloud_type,
            "gpu": {"id": gpu, "count": spec.gpu_count},
            "env": spec.env,
            "ports": self.config.ports,
            "disk": spec.disk_gb or self.config.container_disk_gb or 50,
        }
        if cuda := self._cuda():
            body["gpu"]["allowedCudaVersions"] = cuda
        if self.config.volume_in_gb:
            body["mounts"] = {"persistent": {"size": self.config.volume_in_gb, "path": self.config.volume_mount_path}}
        if self.config.data_center_ids:
            body["dataCenterIds"] = self.config.data_center_ids
        if spec.command:
            body["dockerStartCmd"] = spec.command
        r = await self.http.request("POST", "/v2/pods", json=body, idempotent=False)
        self._check(r, "create")
        self._rest_gone(r)
        if r.status_code in (200, 201):
            return self._rest_machine(r.json())
        if _out_of_stock(r.text):
            raise OutOfCapacity(f"runpod: {gpu}: {self.http.excerpt(r)}")
        raise ProviderError(
            f"runpod: create: HTTP {r.status_code} {self.http.excerpt(r)}", retryable=r.status_code != 400
        )

    async def _rest_list(self) -> builtins.list[Machine]:
        r = await self.http.request("GET", "/v2/pods")
        self._check(r, "list")
        self._rest_gone(r)
        if r.status_code != 200:
            raise ProviderError(f"runpod: list: HTTP {r.status_code} {self.http.excerpt(r)}")
        data = r.json()
        pods = data.get("pods", []) if isinstance(data, dict) else data
        return [m for m in (self._rest_machine(p) for p in pods) if is_ours(m.label)]

    async def _rest_get(self, provider_id: str) -> Machine | None:
        r = await self.http.request("GET", f"/v2/pods/{provider_id}")
        self._check(r, "get")
        if r.status_code == 404 and "pod" in r.text.lower():
            return None
        self._rest_gone(r)
        if r.status_code != 200:
            raise ProviderError(f"runpod: get {provider_id}: HTTP {r.status_code} {self.http.excerpt(r)}")
        return self._rest_machine(r.json())

    # -- GraphQL ---------------------------------------------------------------------------------

    async def _gql(self, query: str, what: str, *, idempotent: bool = True) -> dict[str, Any]:
        r = await self.http.request("POST", "/graphql", json={"query": query}, idempotent=idempotent)
        self._check(r, what)
        try:
            data = r.json()
        except ValueError:
            raise ProviderError(f"runpod: {what}: HTTP {r.status_code}, not JSON", ambiguous=not idempotent) from None
        errors = data.get("errors") if isinstance(data, dict) else None
        if errors:
            message = self.http.redact("; ".join(str(e.get("message", e)) for e in errors))
            if _out_of_stock(message):
                raise OutOfCapacity(f"runpod: {message}")
            if "unauthori" in message.lower() or "api key" in message.lower():
                raise Unauthorized(f"runpod: {what}: {message}")
            raise ProviderError(f"runpod: {what}: {message}")
        if r.status_code != 200:
            raise ProviderError(f"runpod: {what}: HTTP {r.status_code} {self.http.excerpt(r)}")
        result: dict[str, Any] = data.get("data") or {}
        return result

    @staticmethod
    def _gql_machine(pod: dict[str, Any]) -> Machine:
        desired = str(pod.get("desiredStatus") or "").upper()
        if desired == "TERMINATED":
            state = MachineState.TERMINATED
        elif desired == "EXITED":
            state = MachineState.STOPPED
        else:
            state = MachineState.RUNNING if pod.get("runtime") else MachineState.STARTING
        return Machine(
            provider_id=str(pod["id"]),
            label=str(pod.get("name") or ""),
            state=state,
            price_per_hour=_float(pod.get("costPerHr")),
            host_id=pod.get("machineId"),
            message=str(pod.get("lastStatusChange") or ""),
            raw=pod,
        )

    def _gql_fields(self, spec: LaunchSpec, gpu: str) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "name": spec.label,
            "imageName": spec.image,
            "gpuTypeId": gpu,
            "cloudType": _Enum(self.config.cloud_type),
            "gpuCount": spec.gpu_count,
            "containerDiskInGb": spec.disk_gb or self.config.container_disk_gb or 50,
            "volumeInGb": self.config.volume_in_gb or 0,
            "ports": ",".join(self.config.ports),
            "env": [{"key": k, "value": v} for k, v in spec.env.items()],
        }
        if self.config.volume_in_gb:
            fields["volumeMountPath"] = self.config.volume_mount_path
        if cuda := self._cuda():
            fields["allowedCudaVersions"] = cuda
        if spec.command:
            fields["dockerArgs"] = shlex.join(spec.command)
        return fields

    async def _gql_create(self, spec: LaunchSpec, gpu: str) -> Machine:
        fields = self._gql_fields(spec, gpu)
        query = (
            "mutation { podFindAndDeployOnDemand(input: "
            + _gql_literal(fields)
            + ") { id name machineId costPerHr desiredStatus } }"
        )
        data = await self._gql(query, "create", idempotent=False)
        pod = data.get("podFindAndDeployOnDemand")
        if not pod:
            raise ProviderError("runpod: create returned no pod", ambiguous=True)
        return self._gql_machine(pod)

    async def _spot_create(self, spec: LaunchSpec, gpu: str) -> Machine:
        minimum = _float((await self._prices(gpu, spec.gpu_count)).get("minimumBidPrice"))
        cap = (spec.spot_max_price or 0.0) / spec.gpu_count
        if not minimum or minimum > cap:
            raise OutOfCapacity(
                f"runpod: {gpu}: no interruptible capacity at <= ${cap:.3f}/GPU/h"
                + (f" (minimum bid ${minimum:.3f})" if minimum else "")
            )
        fields = self._gql_fields(spec, gpu)
        fields["bidPerGpu"] = round(min(cap, minimum * SPOT_MARGIN), 4)
        query = (
            "mutation { podRentInterruptable(input: "
            + _gql_literal(fields)
            + ") { id name machineId costPerHr desiredStatus } }"
        )
        data = await self._gql(query, "rent interruptible", idempotent=False)
        pod = data.get("podRentInterruptable")
        if not pod:
            raise ProviderError("runpod: interruptible create returned no pod", ambiguous=True)
        machine = self._gql_machine(pod)
        machine.price_per_hour = machine.price_per_hour or fields["bidPerGpu"] * spec.gpu_count
        return machine

    async def _gql_list(self) -> builtins.list[Machine]:
        data = await self._gql("query { myself { pods { " + POD_FIELDS + " } } }", "list")
        pods = (data.get("myself") or {}).get("pods") or []
        return [m for m in (self._gql_machine(p) for p in pods) if is_ours(m.label)]

    async def _gql_get(self, provider_id: str) -> Machine | None:
        pod_id = orjson.dumps(provider_id).decode()
        data = await self._gql("query { pod(input: {podId: " + pod_id + "}) { " + POD_FIELDS + " } }", "get")
        pod = data.get("pod")
        return self._gql_machine(pod) if pod else None


class _RestUnavailable(ProviderError):
    """The REST pods routes are not there: switch this provider to GraphQL."""


def _float(value: Any) -> float | None:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


class _Enum(str):
    """A GraphQL enum value: written bare (`cloudType: SECURE`), as the SDK's own mutations do."""


def _gql_literal(value: Any) -> str:
    """A GraphQL input literal: like JSON, but object keys unquoted and enum values bare."""
    if isinstance(value, _Enum):
        return str(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_gql_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_gql_literal(v) for v in value) + "]"
    return orjson.dumps(value).decode()
