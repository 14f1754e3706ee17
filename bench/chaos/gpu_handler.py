"""The GPU workers' handler in `python -m bench.chaos --hybrid` (run by `offload worker --handler` on machines the
`local` provider starts): the simulator's output for the same input ({"echo": input}), after OFFLOAD_CHAOS_RUN_S
seconds, and one line per run start in OFFLOAD_CHAOS_RUNLOG (`<job id> <epoch s>`), so the checker sees every run
a machine began, also one killed before its result was stored."""

from __future__ import annotations

import os
import time
from typing import Any

from offload.gpu_worker import JobContext


def run(input: Any, ctx: JobContext) -> dict[str, Any]:
    with open(os.environ["OFFLOAD_CHAOS_RUNLOG"], "a") as log:
        log.write(f"{ctx.id} {time.time():.3f}\n")
    time.sleep(float(os.environ.get("OFFLOAD_CHAOS_RUN_S", "0.5")))
    return {"echo": input}
