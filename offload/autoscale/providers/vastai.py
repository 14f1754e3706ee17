"""`vastai`: the Vast.ai marketplace. Search offers with the configured filters, rent the cheapest, and when an
offer is taken between search and rent (404/410 `no_such_ask`), try the next one.

Filters are sent to the search API and applied again here, because the API's filter support is loose (unknown
fields are ignored) and a rental on the wrong host costs money: GPU name, price cap, disk, verified,
reliability, country allow/deny list (from `geolocation`, "City, CC"), minimum download bandwidth, CUDA,
and the hosts the scaler is avoiding (a host that could not start the container is avoided for 24 h).

Spot (`instance.spot`): interruptible offers (`"type": "bid"`) whose `min_bid` is within the queue's
`spot_max_price`, rented with a bid (`price`) 10 % over the minimum, never above the cap. An outbid instance
goes `stopped` (it keeps billing for disk): the scaler destroys it and returns its jobs uncounted.
"""

from __future__ import annotations

import builtins
import re
from typing import Any

from pydantic import Field, field_validator

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

SPOT_MARGIN = 1.1  # bid this much over an offer's minimum bid: less likely to be outbid at once
STATES = {
    None: MachineState.PENDING,
    "": MachineState.PENDING,
    "created": MachineState.PENDING,
    "loading": MachineState.STARTING,
    "rebooting": MachineState.STARTING,
    "running": MachineState.RUNNING,
    "stopped": MachineState.STOPPED,
    "frozen": MachineState.STOPPED,
    "exited": MachineState.FAILED,
    "unknown": MachineState.FAILED,
    "offline": MachineState.FAILED,
}


class VastConfig(ProviderConfig):
    api_key: str = Field(..., description="Vast.ai API key")
    base_url: str = Field("https://console.vast.ai", description="the API's address (the simulator's, to rehearse)")
    gpu_name: str | None = Field(None, description="Vast GPU name, e.g. RTX 4090")
    max_price_per_hour: float | None = Field(None, gt=0, description="price cap per hour (wins over the queue's)")
    disk_gb: int | None = Field(None, ge=8, description="disk when the queue sets none")
    onstart: str | None = Field(None, description="optional on-start script")
    verified_only: bool = Field(True, description="rent only machines Vast has verified")
    min_reliability: float = Field(0.95, ge=0, le=1, description="minimum host reliability (0-1)")
    exclude_countries: list[str] = Field(default_factory=lambda: ["CN"], description="ISO codes to avoid (JSON list)")
    countries: list[str] | None = Field(None, description="allow-list of ISO codes (JSON list; wins over exclude)")
    min_download_mbps: float = Field(100.0, ge=0, description="minimum host download bandwidth")
    min_cuda_version: str | None = Field("12.8", description='hosts supporting this CUDA version ("none": any)')
    offers_to_try: int = Field(5, ge=1, le=50, description="offers to try when one is taken meanwhile")
    worker_key: str | None = Field(None, description=WORKER_KEY_HELP)

    @field_validator("min_cuda_version")
    @classmethod
    def _cuda_form(cls, value: str | None) -> str | None:
        """Vast compares `cuda_max_good` as a number: "12.8" or "12", not "12.8.1"."""
        if value is not None and value.lower() != "none" and not re.fullmatch(r"\d+(\.\d+)?", value.strip()):
            raise ValueError(f'min_cuda_version must be a CUDA version like "12.8" or "none", not {value!r}')
        return value


def _country(offer: dict[str, Any]) -> str:
    geo = str(offer.get("geolocation") or "")
    return geo.rsplit(",", 1)[-1].strip().upper() if geo else ""


class VastProvider(Provider):
    type = "vastai"
    Config = VastConfig
    secret_fields = ("api_key", "worker_key")
    command_fields = ("onstart",)

    def __init__(self, name: str, config: VastConfig, http: Http | None = None) -> None:
        super().__init__(name)
        self.config = config
        self.http = http or Http(config.base_url, {"Authorization": f"Bearer {config.api_key}"})

    def _check(self, r: Any, what: str) -> None:
        if r.status_code in (401, 403):
            raise Unauthorized(f"vastai: {what}: the API key was rejected (HTTP {r.status_code})")

    def _cuda(self) -> float | None:
        value = self.config.min_cuda_version
        if value is None or str(value).lower() == "none":
            return None
        # a value stored before the config check (e.g. "12.8.1"): its major.minor, never an exception
        found = re.match(r"\s*(\d+(?:\.\d+)?)", str(value))
        return float(found.group(1)) if found else None

    def _wanted(self, spec: LaunchSpec) -> tuple[str, float | None, int]:
        gpu = (self.config.gpu_name or spec.gpu or "").replace("_", " ").strip()
        if not gpu:
            raise ProviderError("vastai: no GPU name (set gpu_name or the queue's instance.gpu)", retryable=False)
        price = self.config.max_price_per_hour or spec.max_price_per_hour
        disk = spec.disk_gb or self.config.disk_gb or 20
        return gpu, price, disk

    def price_cap(self, spec: LaunchSpec) -> float | None:
        """The provider's own max_price_per_hour wins over the queue's, as in the offer search."""
        return spec.spot_max_price if spec.spot else self.config.max_price_per_hour or spec.max_price_per_hour

    @staticmethod
    def _bid(offer: dict[str, Any], spec: LaunchSpec) -> float:
        """What to bid for an interruptible offer: 10 % over its minimum bid, never above the cap."""
        minimum = float(offer.get("min_bid") or 0)
        return round(min(spec.spot_max_price or minimum, minimum * SPOT_MARGIN), 4)

    @staticmethod
    def _cost(offer: dict[str, Any], spec: LaunchSpec) -> float:
        return VastProvider._bid(offer, spec) if spec.spot else float(offer.get("dph_total") or 0)

    def _acceptable(self, offer: dict[str, Any], spec: LaunchSpec, gpu: str, price: float | None, disk: int) -> bool:
        c = self.config
        if str(offer.get("gpu_name", "")).lower() != gpu.lower() or int(offer.get("num_gpus") or 0) != spec.gpu_count:
            return False
        if spec.spot:
            if not offer.get("min_bid") or float(offer["min_bid"]) > (spec.spot_max_price or 0):
                return False
        elif price is not None and float(offer.get("dph_total") or 1e9) > price:
            return False
        if float(offer.get("disk_space") or 0) < disk or offer.get("rentable") is False or offer.get("rented"):
            return False
        if c.verified_only and not (offer.get("verified") is True or offer.get("verification") == "verified"):
            return False
        if float(offer.get("reliability2", offer.get("reliability")) or 0) < c.min_reliability:
            return False
        if float(offer.get("inet_down") or 0) < c.min_download_mbps:
            return False
        cuda = self._cuda()
        if cuda is not None and float(offer.get("cuda_max_good") or 0) < cuda:
            return False
        country = _country(offer)
        if c.countries is not None:
            if country not in {x.upper() for x in c.countries}:
                return False
        elif country in {x.upper() for x in c.exclude_countries}:
            return False
        return str(offer.get("machine_id")) not in spec.avoid_hosts

    async def search(self, spec: LaunchSpec) -> list[dict[str, Any]]:
        gpu, price, disk = self._wanted(spec)
        query: dict[str, Any] = {
            "gpu_name": {"eq": gpu},
            "num_gpus": {"eq": spec.gpu_count},
            "rentable": {"eq": True},
            "rented": {"eq": False},
            "disk_space": {"gte": disk},
            "inet_down": {"gte": self.config.min_download_mbps},
            "reliability2": {"gte": self.config.min_reliability},
            "order": [["min_bid" if spec.spot else "dph_total", "asc"]],
            "type": "bid" if spec.spot else "on-demand",
            "limit": 64,
        }
        if spec.spot and spec.spot_max_price is not None:
            query["min_bid"] = {"lte": spec.spot_max_price}
        elif price is not None:
            query["dph_total"] = {"lte": price}
        if self.config.verified_only:
            query["verified"] = {"eq": True}
        if (cuda := self._cuda()) is not None:
            query["cuda_max_good"] = {"gte": cuda}
        if self.config.countries is not None:  # in the query: the 64 cheapest offers may all be elsewhere
            query["geolocation"] = {"in": sorted({x.upper() for x in self.config.countries})}
        elif self.config.exclude_countries:
            query["geolocation"] = {"notin": sorted({x.upper() for x in self.config.exclude_countries})}
        if spec.avoid_hosts:
            query["machine_id"] = {"notin": sorted(int(h) if h.isdigit() else h for h in spec.avoid_hosts)}
        r = await self.http.request("POST", "/api/v0/bundles/", json=query)
        self._check(r, "search")
        if r.status_code == 404 and "offers" not in r.text:
            raise Unauthorized("vastai: search answered 404 (Vast's answer to a bad API key)")
        if r.status_code != 200:
            raise ProviderError(f"vastai: search: HTTP {r.status_code} {self.http.excerpt(r)}")
        offers = [o for o in r.json().get("offers", []) if self._acceptable(o, spec, gpu, price, disk)]
        return sorted(offers, key=lambda o: self._cost(o, spec))

    async def quote(self, spec: LaunchSpec) -> float | None:
        offers = await self.search(spec)
        return self._cost(offers[0], spec) if offers else None

    async def create(self, spec: LaunchSpec) -> Machine:
        if not spec.image:
            raise ProviderError("vastai: no image (set the queue's instance.image)", retryable=False)
        offers = await self.search(spec)
        if not offers:
            gpu, price, _ = self._wanted(spec)
            if spec.spot:
                price = spec.spot_max_price
            raise OutOfCapacity(
                f"vastai: no {'interruptible ' if spec.spot else ''}offer for {gpu}"
                + (f" at <= ${price}/h" if price else "")
            )
        _, _, disk = self._wanted(spec)
        taken = 0
        for offer in offers[: self.config.offers_to_try]:
            body: dict[str, Any] = {
                "client_id": "me",
                "image": spec.image,
                "env": spec.env,
                "disk": disk,
                "label": spec.label,
                "runtype": "args",
            }
            if spec.command:
                body["args"] = spec.command
            if self.config.onstart:
                body["onstart"] = self.config.onstart
            if spec.spot:
                body["price"] = self._bid(offer, spec)
            r = await self.http.request("PUT", f"/api/v0/asks/{offer['id']}/", json=body, idempotent=False)
            self._check(r, "rent")
            data = _json(r)
            if r.status_code in (404, 410) or data.get("error") == "no_such_ask":
                taken += 1
                continue  # taken between search and rent: the next cheapest
            if r.status_code != 200 or not data.get("success"):
                raise ProviderError(
                    f"vastai: rent offer {offer['id']}: HTTP {r.status_code} {self.http.excerpt(r)}",
                    retryable=r.status_code != 400,
                )
            contract = str(data["new_contract"])
            return Machine(
                provider_id=contract,
                label=spec.label,
                state=MachineState.PENDING,
                price_per_hour=self._cost(offer, spec) or None,
                host_id=str(offer.get("machine_id")) if offer.get("machine_id") is not None else None,
                raw={"offer": offer},
            )
        raise OutOfCapacity(f"vastai: {taken} offer(s) taken before they could be rented")

    @staticmethod
    def _machine(inst: dict[str, Any]) -> Machine:
        status = inst.get("actual_status")
        return Machine(
            provider_id=str(inst["id"]),
            label=str(inst.get("label") or ""),
            state=STATES.get(status, MachineState.STARTING),
            price_per_hour=_float(inst.get("dph_total")),
            host_id=None if inst.get("machine_id") is None else str(inst.get("machine_id")),
            message=str(inst.get("status_msg") or ""),
            raw=inst,
        )

    async def list(self) -> builtins.list[Machine]:
        r = await self.http.request("GET", "/api/v0/instances/", params={"owner": "me"})
        self._check(r, "list")
        if r.status_code != 200:
            raise ProviderError(f"vastai: list: HTTP {r.status_code} {self.http.excerpt(r)}")
        return [m for m in (self._machine(i) for i in r.json().get("instances") or []) if is_ours(m.label)]

    async def get(self, provider_id: str) -> Machine | None:
        r = await self.http.request("GET", f"/api/v0/instances/{provider_id}/", params={"owner": "me"})
        self._check(r, "show")
        if r.status_code == 404:
            return None
        if r.status_code != 200:
            raise ProviderError(f"vastai: show {provider_id}: HTTP {r.status_code} {self.http.excerpt(r)}")
        inst = r.json().get("instances")
        return self._machine(inst) if inst else None

    async def destroy(self, provider_id: str) -> None:
        machine = await self.get(provider_id)
        if machine is None:
            return
        if not is_ours(machine.label):
            raise NotOurs(provider_id, machine.label)
        r = await self.http.request("DELETE", f"/api/v0/instances/{provider_id}/")
        self._check(r, "destroy")
        if r.status_code == 404:
            return
        if r.status_code != 200 or not _json(r).get("success", True):
            raise ProviderError(f"vastai: destroy {provider_id}: HTTP {r.status_code} {self.http.excerpt(r)}")

    async def aclose(self) -> None:
        await self.http.aclose()


def _json(r: Any) -> dict[str, Any]:
    try:
        data = r.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _float(value: Any) -> float | None:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None
