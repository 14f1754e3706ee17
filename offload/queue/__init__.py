"""The durable job store on Redis/Valkey: key layout, Lua scripts and the async store over them."""

from offload.backoff import retry_delay_ms
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore

__all__ = ["JobSpec", "QueueStore", "retry_delay_ms"]
