"""Long-running processes freeze what they built at start, so the cyclic GC's full collections skip it.

A full (generation 2) collection walks every object the collector tracks, with the event loop stopped. A
started `offload server` holds ~100k of them from imports and set-up alone (modules, classes, functions,
pydantic and FastAPI state), a dispatch worker ~80k, the simulator as many: one collection took 60-130 ms in
each of them under `bench/webhooks.py`, and every webhook, poll answer and ack in flight waits that long (at
100 results a second, a pause of 100 ms delays the 1% that make the p99; issue 15). Those objects live as long
as the process, so scanning them finds nothing: `gc.freeze()` moves them to the permanent generation, and full
collections walk only what the work itself allocates. Done once start-up is over (after a collection, so no
start-up garbage is kept for good), and only by the command-line entry points: a test or an embedding process
keeps its usual GC.
"""

from __future__ import annotations

import gc


def freeze_startup() -> None:
    """Collect, then freeze every object alive now (`gc.get_freeze_count()` says how many)."""
    gc.collect()
    gc.freeze()
