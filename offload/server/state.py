"""What one server process holds: its options and the long-lived clients every request shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from offload.config import (
    SERVER_BODY_MIN_RATE,
    SERVER_BODY_TIMEOUT_S,
    SERVER_HEADER_TIMEOUT_S,
    SERVER_MAX_BATCH,
    SERVER_MAX_BODY,
    SERVER_MAX_CONNECTIONS,
    SERVER_MAX_REQUESTS_PER_ADDRESS,
    SERVER_MAX_REQUESTS_PER_KEY,
    SERVER_MAX_STREAMS_PER_KEY,
    SERVER_WORKER_LEASE_MS,
    Settings,
)
from offload.queue.keyspace import QUEUES_KEY
from offload.queue.store import QueueStore
from offload.redis_client import RedisClient
from offload.server.limits import Limits
from offload.storage import Storage

if TYPE_CHECKING:
    from offload.access.api_keys import KeyStore
    from offload.server.events import EventHub
    from offload.server.metrics import RateTracker
    from offload.server.registry import WorkerRegistry
    from offload.server.store_watch import StoreWatch


@dataclass
class ServerOptions:
    """Limits and timings. Defaults suit a server on the internet talking to rented GPU machines."""

    redis_url: str | None = None
    settings: Settings = field(default_factory=Settings)
    # the limits' defaults, and what each bounds, are offload/config.py's SERVER_* (`offload server` shares them)
    max_batch: int = SERVER_MAX_BATCH
    max_body: int = SERVER_MAX_BODY
    max_wait_s: float = 60.0  # longest long-poll (wait, claim)
    worker_lease_ms: int = SERVER_WORKER_LEASE_MS
    maintenance_interval_s: float = 1.0  # promote delayed jobs, reap dead workers, sample rates
    history_sample_s: float = 60.0  # the history's gauges: at each minute of the store's clock, and at least this often
    presign_expires_s: int = 3600
    sse_keepalive_s: float = 15.0
    admin_key: str | None = None  # bootstrap admin token; default: OFFLOAD_ADMIN_KEY
    # invalid keys per client address, and per existing key id, per window; past it, invalid keys from that
    # address or for that key id get 429 until the window ends (a valid key is always served)
    auth_fail_limit: int = 20
    auth_fail_window_s: float = 60.0
    max_stream_queues: int = 1000  # queues one event stream may follow
    key_recheck_s: float = 1.0  # open streams and long-polls re-check their key this often (ended when revoked)
    max_connections: int = SERVER_MAX_CONNECTIONS
    header_timeout_s: float = SERVER_HEADER_TIMEOUT_S
    body_timeout_s: float = SERVER_BODY_TIMEOUT_S
    body_min_rate: int = SERVER_BODY_MIN_RATE
    max_requests_per_key: int = SERVER_MAX_REQUESTS_PER_KEY
    max_streams_per_key: int = SERVER_MAX_STREAMS_PER_KEY
    max_requests_per_address: int = SERVER_MAX_REQUESTS_PER_ADDRESS
    freeze_heap: bool = False  # after start-up (offload/heap.py); `offload server` sets it, tests do not


@dataclass
class ServerState:
    options: ServerOptions
    redis: RedisClient
    store: QueueStore
    keys: KeyStore
    storage: Storage
    hub: EventHub
    registry: WorkerRegistry
    rates: RateTracker
    store_watch: StoreWatch  # the store's memory and eviction policy: gates enqueues and claims, alerts
    extra: dict[str, Any] = field(default_factory=dict)
    limits: Limits = field(init=False)

    def __post_init__(self) -> None:
        self.limits = Limits(self.options)

    async def known_queue(self, queue: str) -> bool:
        """A queue exists once anything was enqueued to it, it was paused, or offload.yaml declares it."""
        if queue in self.options.settings.queues:
            return True
        return bool(await self.redis.sismember(QUEUES_KEY, queue))


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.offload
    return state
