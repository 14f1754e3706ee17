"""The durable job store on Redis/Valkey: key layout, Lua scripts and the async store over them."""

from offload.queue.store import JobSpec, QueueStore, retry_delay_ms

__all__ = ["JobSpec", "QueueStore", "retry_delay_ms"]
