"""Long-running processes freeze what they built at start, so the cyclic GC's full collections skip it.

A full (generation 2) collection walks every object the collector tracks, with the event loop stopped. A
started `offload server` or dispatch worker holds tens of thousands of them from imports and set-up alone
(modules, classes, functions, pydantic and FastAPI state), and every webhook, poll answer and ack in flight
waits for the collection (docs/explanation/performance.md, *Garbage collection*). Those objects live as long
as the process, so scanning them finds nothing: `gc.freeze()` moves them to the permanent generation, and full
collections walk only what the work itself allocates. Done once start-up is over (after a collection, so no
start-up garbage is kept for good), and only by the command-line entry points: a test or an embedding process
keeps its usual GC.

The same processes also collect the youngest generation less often. At the interpreter's default threshold a
dispatch worker ran a young collection every few dozen jobs, each one stopping the loop (same section). Nearly
everything a job allocates is freed by reference counting as soon as the job is done, so at `GEN0_THRESHOLD` the
benchmark runs needed no young collection at all: garbage in cycles (a traceback holding its frames) is still
collected, after a few thousand objects instead of hundreds.
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 10_000  # young collections after this many more container allocations than frees (default 700)


def freeze_startup() -> None:
    """Collect, then freeze every object alive now (`gc.get_freeze_count()` says how many), and raise the
    youngest generation's threshold to `GEN0_THRESHOLD` (never lowering one set higher)."""
    gc.collect()
    gc.freeze()
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, GEN0_THRESHOLD), middle, old)
