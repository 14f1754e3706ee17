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

The same processes also collect the youngest generation less often. With CPython's default threshold (700 more
container objects allocated than freed), a dispatch worker ran a young collection every ~55 jobs, each one
stopping the loop: measured in bench/worker_throughput.py's worker, 40,000 no-op jobs paid ~720 collections
and 130-160 ms (~5 % of the run), 10,000 jobs of 50 ms ~110 collections and 55-70 ms (pauses up to 5 ms, while
100 jobs wait for their next step). Nearly everything a job allocates is freed by reference counting as soon as
the job is done, so at `GEN0_THRESHOLD` the same runs needed no collection at all: garbage in cycles (a
traceback holding its frames) is still collected, after a few thousand objects instead of hundreds.
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
