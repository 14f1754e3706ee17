"""A server's first requests after a start cost what later ones do (the webhook tail).

The first webhooks after `offload server` started used to pay for the server's lazy set-up with the event loop
blocked: importing the backends (aiohttp and all) and building an HTTP client on the first delivery, and
FastAPI building its routers' state on the first request; the deliveries of a burst behind them waited a few
hundred ms. Measured in a fresh interpreter (the test process has long imported everything) with the real app
and a real Valkey: the first delivery imports nothing, and makes about as many Python calls as a later one
(call counts, unlike timings, do not depend on the machine's load).
Measured before the fix: 107 modules imported and ~177,000 calls on the first delivery, ~5,000 on later ones.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path

from offload.heap import GEN0_THRESHOLD
from offload.queue.replies import Verdict

HERE = Path(__file__).resolve().parent
DELIVERIES = 3


async def probe(redis_url: str, results: str) -> dict[str, object]:
    """Start the app (lifespan, as uvicorn does), then deliver one RunPod webhook (its URL secret is its whole
    proof) for each of DELIVERIES jobs: the modules the first one imported, and each one's Python call count."""
    import cProfile
    import pstats

    import httpx

    from offload.config import Settings
    from offload.connection import connect
    from offload.queue.keyspace import hook_digest
    from offload.queue.specs import JobSpec
    from offload.queue.store import QueueStore
    from offload.server.app import create_app
    from offload.server.state import ServerOptions

    settings = Settings.model_validate(
        {
            "redis_url": redis_url,
            "storage": {"kind": "local", "path": results},
            "server": {"public_url": "http://127.0.0.1:9"},
            "backends": {"rp": {"kind": "runpod", "endpoint_id": "ep1", "api_key": "k"}},
            "queues": {"q": {"backend": "rp"}},
        }
    )
    redis = await connect(redis_url)
    store = QueueStore(redis)
    ids = await store.enqueue_many("q", [JobSpec(input={"n": i}) for i in range(DELIVERIES)])
    claimed = await store.claim("q", "w1", DELIVERIES)
    begun = await store.begin_many("q", [(c.id, c.token, 0.0, hook_digest("rp", f"s-{c.id}")) for c in claimed])
    assert all(v.verdict is Verdict.OK for v in begun), begun
    app = create_app(
        ServerOptions(redis_url=redis_url, settings=settings, admin_key="warm-admin-" + secrets.token_hex(16))
    )
    calls: list[int] = []
    statuses: list[int] = []
    async with app.router.lifespan_context(app):
        before = set(sys.modules)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://server.test") as client:
            await client.get("/healthz")  # the client's own first request is not the server's cost
            first_imports: list[str] = []
            for job_id in ids:
                body = {"id": f"remote-{job_id}", "status": "COMPLETED", "output": {"ok": True}}
                profile = cProfile.Profile()
                profile.enable()
                answer = await client.post(f"/v1/hooks/rp/{job_id}/1/s-{job_id}", json=body)
                profile.disable()
                if not first_imports:
                    first_imports = sorted(set(sys.modules) - before) or ["(none)"]
                statuses.append(answer.status_code)
                calls.append(pstats.Stats(profile).total_calls)  # type: ignore[attr-defined]
    await redis.aclose()
    return {"imports": [m for m in first_imports if m != "(none)"], "calls": calls, "statuses": statuses}


async def frozen_after_start(redis_url: str, results: str, freeze: bool) -> dict[str, int]:
    """Objects frozen, and objects the cyclic GC still tracks, once the app has started (offload/heap.py)."""
    import gc

    from offload.config import Settings
    from offload.server.app import create_app
    from offload.server.state import ServerOptions

    settings = Settings.model_validate({"redis_url": redis_url, "storage": {"kind": "local", "path": results}})
    app = create_app(ServerOptions(redis_url=redis_url, settings=settings, freeze_heap=freeze))
    async with app.router.lifespan_context(app):
        return {"frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects()), "young": gc.get_threshold()[0]}


def test_offload_server_freezes_its_start_up_heap_and_tests_do_not(valkey_url: str, tmp_path: Path) -> None:
    """`offload server` (freeze_heap) leaves the GC's full collections a fraction of the objects to walk: a full
    collection of the start-up heap took 60-130 ms with the event loop stopped; and it collects the youngest
    generation less often (GEN0_THRESHOLD). Off by default (tests, embedding)."""
    code = (
        "import asyncio, json, sys; import test_server_warm as t; "
        "print(json.dumps(asyncio.run(t.frozen_after_start(sys.argv[1], sys.argv[2], sys.argv[3] == '1'))))"
    )
    seen = {}
    for freeze in ("1", "0"):
        proc = subprocess.run(
            [sys.executable, "-c", code, valkey_url, str(tmp_path / "results"), freeze],
            cwd=HERE,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        seen[freeze] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["0"]["frozen"] == 0 and seen["0"]["tracked"] > 50_000, seen
    assert seen["1"]["frozen"] > 50_000 and seen["1"]["tracked"] < seen["1"]["frozen"] / 10, seen
    assert (seen["0"]["young"], seen["1"]["young"]) == (700, GEN0_THRESHOLD), seen  # CPython's default, ours


def test_the_first_webhook_after_a_start_costs_what_later_ones_do(valkey_url: str, tmp_path: Path) -> None:
    code = (
        "import asyncio, json, sys; import test_server_warm as t; "
        "print(json.dumps(asyncio.run(t.probe(sys.argv[1], sys.argv[2]))))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, valkey_url, str(tmp_path / "results")],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["statuses"] == [200] * DELIVERIES, report
    assert report["imports"] == [], report  # nothing left to import on the first delivery
    first, *later = report["calls"]
    # What is left after start-up is not the delivery's own: the maintenance loop's and the autoscaler's first
    # passes run beside it in the same thread, and the pool opens its first connections. The bound leaves room for
    # those, not for set-up (the figures: docs/explanation/performance.md, *Webhook deliveries*).
    assert first <= 10 * max(later), report
