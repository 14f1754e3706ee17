"""The simulator's reordered `start` delivery really comes after the final one, even when the receiver is slow
to answer that final delivery (the case a fixed lag missed on a loaded CI machine: the start was sent while the
final delivery's answer was still 0.5 s away)."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import orjson
from aiohttp import web
from support.eventually import eventually

from offload.testing.sim.store import Job
from offload.testing.sim.webhooks import REORDER_LAG_S, HookFaults, HookSender

SLOW_ANSWER_S = REORDER_LAG_S + 0.4  # the receiver holds the final delivery longer than the start's lag


async def test_a_reordered_start_waits_for_a_slow_final_delivery() -> None:
    arrivals: list[tuple[str, str, float]] = []  # (status in the body, "in" or "answered", time)

    async def receive(request: web.Request) -> web.Response:
        status = orjson.loads(await request.read())["status"]
        arrivals.append((status, "in", time.monotonic()))
        if status == "succeeded":
            await asyncio.sleep(SLOW_ANSWER_S)
        arrivals.append((status, "answered", time.monotonic()))
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/hook", receive)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    sender = HookSender(time.time, random.Random(7))
    sender.configure(HookFaults(reorder_rate=1.0))
    now = time.time()
    job = Job("p1", "replicate", "m", {}, "k", created=now, started=now + 0.05, finished=now + 0.1, outcome="succeeded")

    def render(at: float) -> dict[str, Any]:
        return {"id": job.id, "status": job.phase(at)}

    try:
        url = f"http://127.0.0.1:{port}/hook"
        sender.schedule(job, url, render, "start")
        sender.schedule(job, url, render)

        async def both_logged() -> bool:
            return len(sender.sent) >= 2

        await eventually(both_logged, what="both deliveries logged")
    finally:
        await sender.aclose()
        await runner.cleanup()
    start, final = sorted(sender.sent, key=lambda d: d["event"] != "start")
    assert start["reordered"] and final["event"] == "completed" and start["sent_at"] > final["sent_at"], sender.sent
    # On the wire: the start (the prediction as created) reached the receiver only after the final answer left.
    final_answered = next(t for s, edge, t in arrivals if s == "succeeded" and edge == "answered")
    start_in = next(t for s, edge, t in arrivals if s == "queued" and edge == "in")  # the job as created
    assert start_in > final_answered, arrivals
