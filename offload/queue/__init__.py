"""The durable job store on Redis/Valkey: key layout, Lua scripts and the async store over them."""

from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore, retry_delay_ms

__all__ = ["JobSpec", "QueueStore", "retry_delay_ms"]
