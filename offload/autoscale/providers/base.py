"""What the autoscaler needs from a machine provider, and the errors every adapter maps its API onto.

The contract is deliberately small (create, list, get, destroy, drain) because each extra verb is one more
way to leak a paid machine. Two rules hold for every adapter:
- it only ever lists, touches or destroys machines whose name/label starts with `offload-` (an account may run
  hand-made production machines next to ours), and
- `destroy` of a machine that is already gone succeeds, so a teardown can be retried until confirmed.
"""

from __future__ import annotations

import asyncio
import builtins
import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import httpx
from pydantic import Field

from offload import redact
from offload.backoff import compute_backoff
from offload.errors import ProviderError as ProviderError  # the branch root, drawn in offload.errors
from offload.http_client import make_client
from offload.schema import Strict

LABEL_PREFIX = "offload-"
WORKER_KEY_HELP = (
    "the worker key its machines get (a worker key of the queues it serves); required for a provider made "
    "over the HTTP API, which never receives the server's"
)
RETRY_BASE, RETRY_CAP = 0.1, 2.0  # seconds between the retries of one provider call, doubling


class MachineState(enum.StrEnum):
    PENDING = "pending"  # accepted, not yet placed/pulling
    STARTING = "starting"  # placed, container starting
    RUNNING = "running"  # container up (the worker may still be installing)
    STOPPED = "stopped"  # exists, not running (still billed for disk)
    FAILED = "failed"  # the provider says it will never run (host error, bad image pull)
    TERMINATED = "terminated"  # gone or going


@dataclass
class Machine:
    provider_id: str
    label: str
    state: MachineState
    price_per_hour: float | None = None
    host_id: str | None = None
    message: str = ""
    raw: dict[str, Any] = field(default_factory=dict)


@dataclass
class LaunchSpec:
    """One rental. `label` is `offload-<instance id>`; `env` carries the server URL, worker key and ids."""

    label: str
    queue: str
    image: str | None
    gpu: str | None
    gpu_count: int
    disk_gb: int | None
    max_price_per_hour: float | None
    env: dict[str, str]
    handler: str | None = None  # module:function the worker runs (the command is built from it)
    command: list[str] | None = None  # the container's start command (RunPod dockerStartCmd, Vast.ai args)
    avoid_hosts: set[str] = field(default_factory=set)
    spot: bool = False  # interruptible / bid rental, at most spot_max_price per hour
    spot_max_price: float | None = None
    script: str | None = None  # the deployment script (offload.autoscale.deploy): local runs it in a work dir


class OutOfCapacity(ProviderError):
    """No offer / out of stock for what was asked: back off and try again later."""


class Unauthorized(ProviderError):
    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


class NotOurs(ProviderError):
    """Refused: the machine's name/label does not start with `offload-`."""

    def __init__(self, provider_id: str, label: str) -> None:
        super().__init__(
            f"refusing to touch machine {provider_id}: its label {label!r} does not start with {LABEL_PREFIX!r}",
            retryable=False,
        )


def is_ours(label: str | None) -> bool:
    return bool(label) and str(label).startswith(LABEL_PREFIX)


class ProviderConfig(Strict):
    """Settings common to every provider type; each type's `Config` adds its own (one model per type)."""

    allow_worker_protect: bool = Field(
        False,
        description="honour a worker's own OFFLOAD_PROTECTED flag (the "
        "machine could otherwise keep itself rented forever); operators can always "
        "protect an instance",
    )


class Provider(ABC):
    type: ClassVar[str]
    real: ClassVar[bool] = True  # real providers need a public server URL and a worker key
    Config: ClassVar[builtins.type[ProviderConfig]]
    secret_fields: ClassVar[tuple[str, ...]] = ()
    # settings that run commands on the machine (they may hold tokens): shown to admin keys only
    command_fields: ClassVar[tuple[str, ...]] = ()
    # where the secrets are sent: an update that changes one of these must give the secrets again
    endpoint_fields: ClassVar[tuple[str, ...]] = ("base_url",)

    def __init__(self, name: str) -> None:
        self.name = name

    @abstractmethod
    async def create(self, spec: LaunchSpec) -> Machine: ...

    @abstractmethod
    async def list(self) -> builtins.list[Machine]:
        """Every machine of ours (label `offload-…`) the provider knows, in any state."""

    async def quote(self, spec: LaunchSpec) -> float | None:
        """The provider's current price per hour for this rental (the cheapest acceptable offer), for
        `choose: cheapest`; None when it cannot tell (or has no offer). Never rents anything."""
        return None

    def price_cap(self, spec: LaunchSpec) -> float | None:
        """The most this rental may cost per hour (None: no cap): the queue's `spot_max_price` for spot, else
        its `max_price_per_hour`. A provider whose own cap wins over the queue's overrides this."""
        return spec.spot_max_price if spec.spot else spec.max_price_per_hour

    async def get(self, provider_id: str) -> Machine | None:
        """None: gone. Adapters with a cheaper single-machine call override this."""
        return next((m for m in await self.list() if m.provider_id == provider_id), None)

    @abstractmethod
    async def destroy(self, provider_id: str) -> None:
        """Destroy one of our machines; gone already is success; NotOurs for a foreign label."""

    async def drain(self, machine: Machine) -> None:
        """Ask the machine's worker to stop claiming and finish in-flight work (default: nothing to do here;
        the server stops handing the worker jobs once its instance is draining)."""
        return None

    async def aclose(self) -> None:
        return None


class Http:
    """httpx with the retry policy adapters share: 429 waits for Retry-After (capped), 5xx and transport
    errors retry a few times, except for calls that would rent twice if repeated (`idempotent=False`), which
    raise ProviderError(ambiguous=True) instead so the scaler reconciles by label."""

    def __init__(
        self,
        base_url: str,
        headers: dict[str, str],
        *,
        timeout: float = 30.0,
        attempts: int = 4,
        max_wait: float = 10.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        # the credentials this client sends are what an echoing provider would show back: never in an excerpt
        self.secrets = {v for h in headers.values() for v in (h, h.partition(" ")[2])}
        self.client = client or make_client(
            "provider_api", timeout=timeout, base_url=base_url.rstrip("/"), headers=headers
        )
        self.attempts = attempts
        self.max_wait = max_wait
        self.calls = 0

    async def request(self, method: str, path: str, *, idempotent: bool = True, **kwargs: Any) -> httpx.Response:
        last = ""
        for attempt in range(self.attempts):
            delay = compute_backoff(attempt + 1, base=RETRY_BASE, cap=RETRY_CAP)
            self.calls += 1
            try:
                response = await self.client.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                if not idempotent:
                    raise ProviderError(
                        f"{method} {path}: {type(exc).__name__} (the request may have gone through)", ambiguous=True
                    ) from None
                last = type(exc).__name__
            else:
                if response.status_code == 429:
                    last = "HTTP 429"
                    wait = _retry_after(response) or delay
                    if attempt + 1 < self.attempts:
                        await asyncio.sleep(min(wait, self.max_wait))
                        continue
                    raise ProviderError(f"{method} {path}: rate limited (429)")
                if response.status_code >= 500:
                    if not idempotent:
                        raise ProviderError(
                            f"{method} {path}: HTTP {response.status_code} {self.excerpt(response)}", ambiguous=True
                        )
                    last = f"HTTP {response.status_code}"
                else:
                    return response
            if attempt + 1 < self.attempts:
                await asyncio.sleep(delay)
        raise ProviderError(f"{method} {path}: {last} after {self.attempts} attempts")

    def excerpt(self, response: httpx.Response) -> str:
        """A short piece of the answer for an error message, redacted (offload/redact.py)."""
        return self.redact(response.text)

    def redact(self, text: str) -> str:
        return redact.excerpt(text, self.secrets)

    async def aclose(self) -> None:
        await self.client.aclose()


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return float(value) if value else None
    except ValueError:
        return None
