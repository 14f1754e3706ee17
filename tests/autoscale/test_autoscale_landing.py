"""What a RunPod create cannot be told, checked once it returns: on a simulated clock over a real Valkey, the real
autoscaler against the simulator's pods.

- a pod placed on an avoided host is released at once (journaled teardown) and the same evaluation rents again,
  elsewhere; after two such landings in a row the third is kept, not an endless create/destroy;
- a pod whose reported costPerHr is over the queue's cap is released and alerted, and the provider backs off:
  one create per evaluation, not a loop;
- a server killed between the create and the release leaves a journaled teardown the next leader carries out;
- a Vast.ai provider's own max_price_per_hour wins over the queue's here too, as in its offer search.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from support.autoscale_helpers import Clock, make_scaler, queue_block, sim_call, worker_token

from offload.autoscale import keyspace
from offload.autoscale.providers.runpod import RunPodConfig, RunPodProvider
from offload.autoscale.providers.vastai import VastConfig, VastProvider
from offload.autoscale.scaler import Autoscaler
from offload.connection import connect
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.testing.sim.config import SimConfig
from offload.testing.sim.server import running_sim

A5000 = "NVIDIA RTX A5000"  # listed at $0.36/h in the simulator
BAD = "rp-host-bad"


@pytest.fixture
async def r(fast_valkey_url: str) -> AsyncIterator[Any]:
    client = await connect(fast_valkey_url)
    yield client
    await client.aclose()


class Crash(BaseException):
    """The server process dies (not an Exception: nothing may catch it on the way out)."""


class CrashingRunPod(RunPodProvider):
    """The process dies in its first destroy call: after the teardown was journaled, before the pod went."""

    crashed = False

    async def destroy(self, provider_id: str) -> None:
        if not self.crashed:
            self.crashed = True
            raise Crash
        await super().destroy(provider_id)


async def runpod_scaler(
    r: Any, clock: Clock, url: str, *, owner: str = "s1", provider: type[RunPodProvider] = RunPodProvider, **block: Any
) -> tuple[Autoscaler, RunPodProvider]:
    rp = provider("rp", RunPodConfig(api_key="k", base_url=url, gpu_type_id=A5000))
    s, _ = make_scaler(
        r,
        clock,
        queue_block(provider="rp", **block),
        owner=owner,
        server={"public_url": "https://cp.example.com", "worker_key": await worker_token(r)},
    )
    s.override = {"rp": rp}
    return s, rp


async def avoid(r: Any, clock: Clock, host: str) -> None:
    """The host failed to boot earlier: avoided for a day (what reconcile.boot_failed writes)."""
    await r.zadd(keyspace.avoid("rp"), {host: clock() + 86_400})


async def enqueue(r: Any, clock: Clock, n: int) -> None:
    await QueueStore(r, clock_ms=lambda: int(clock() * 1000)).enqueue_many("gpu", [JobSpec(input=i) for i in range(n)])


def pods(url: str) -> list[dict[str, Any]]:
    return list(sim_call("GET", f"{url}/_sim/machines")["machines"])


async def events(r: Any, kind: str) -> list[str]:
    return [e["message"] for _, e in await r.xrange(keyspace.EVENTS) if e.get("kind") == kind]


async def test_a_pod_on_an_avoided_host_is_released_and_the_next_lands_elsewhere(r: Any) -> None:
    """Before the fix the pod on the avoided host was kept (and booted there, or failed there again)."""
    clock = Clock()
    cfg = SimConfig.model_validate({"api_key": "k", "machines": {"boot_seconds": 60, "runpod_place_on": [BAD]}})
    with running_sim(cfg, clock=clock) as url:
        s, rp = await runpod_scaler(r, clock, url, max_workers=1)
        await avoid(r, clock, BAD)
        await enqueue(r, clock, 1)
        await s.tick()
        released, kept = pods(url)  # renting again in the same evaluation
        assert released["host"] == BAD and released["phase"] == "deleted"
        assert kept["host"] != BAD and kept["phase"] == "starting"
        (live,) = await s.instances.live()
        assert live.provider_id == kept["id"] and live.host == kept["host"]
        (gone,) = [i for i in await s.instances.recent() if i.id != live.id]
        assert gone.provider_id == released["id"] and gone.teardown == "done" and gone.destroyed_at
        assert f"{gone.id}: landed on avoided host {BAD}; released, renting again" in await events(r, "failed")
        assert (await s.instances.get(gone.id)).cost == 0  # type: ignore[union-attr]
        clock.advance(30)
        await s.tick()
        assert len(pods(url)) == 2  # the count is met: nothing more rented
        await rp.aclose()


async def test_a_provider_that_keeps_placing_on_an_avoided_host_is_not_looped(r: Any) -> None:
    """Two landings in a row are released; the third machine is kept (an event says so) rather than paying for
    endless create/destroy. Before the fix the first was kept silently."""
    clock = Clock()
    cfg = SimConfig.model_validate({"api_key": "k", "machines": {"boot_seconds": 60, "runpod_place_on": [BAD] * 6}})
    with running_sim(cfg, clock=clock) as url:
        s, rp = await runpod_scaler(r, clock, url, max_workers=1)
        await avoid(r, clock, BAD)
        await enqueue(r, clock, 1)
        await s.tick()
        phases = [(p["host"], p["phase"]) for p in pods(url)]
        assert phases == [(BAD, "deleted"), (BAD, "deleted"), (BAD, "starting")]
        (kept,) = await s.instances.live()
        assert kept.host == BAD and kept.status == "provisioning"
        (said,) = await events(r, "landed")
        assert said.startswith(f"{kept.id}: landed on avoided host {BAD} again") and "kept" in said
        await rp.aclose()


async def test_a_pod_reporting_a_price_over_the_cap_is_released_and_not_rented_in_a_loop(r: Any) -> None:
    """The A5000 is listed at $0.36/h (under the $0.40 cap) but its pods cost $0.45/h. Before the fix the pod was
    kept, billing over the cap."""
    clock = Clock()
    cfg = SimConfig.model_validate({"api_key": "k", "machines": {"runpod_billed": {A5000: 0.45}}})
    with running_sim(cfg, clock=clock) as url:
        cap = {"gpu": "RTX 4090", "image": "img", "max_price_per_hour": 0.4}
        s, rp = await runpod_scaler(r, clock, url, min_workers=2, max_workers=2, instance=cap)
        await s.tick()
        (pod,) = pods(url)  # two wanted, one create: the provider is over the cap for this evaluation
        assert pod["phase"] == "deleted" and await s.instances.live() == []
        (said,) = [a["message"] for a in s.alerter.sent if "$0.450/h" in a["message"]]
        assert "over max_price_per_hour $0.400/h" in said and "released" in said
        assert any("$0.450/h" in m for m in await events(r, "failed"))
        for _ in range(3):  # the provider backs off (60 s, then 120 s): not a create every evaluation
            clock.advance(30)
            await s.tick()
        assert len(pods(url)) == 2 and all(p["phase"] == "deleted" for p in pods(url))
        await rp.aclose()


async def test_a_vast_providers_own_price_cap_wins_over_the_queues(r: Any) -> None:
    """The provider allows $0.50/h, the queue $0.30/h: the $0.35/h offer is rented and kept (the cap the offer
    search used), not released as over the queue's cap."""
    clock = Clock()
    with running_sim(SimConfig.model_validate({"api_key": "k"}), clock=clock) as url:
        vast = VastProvider("v", VastConfig(api_key="k", base_url=url, gpu_name="RTX 4090", max_price_per_hour=0.5))
        cap = {"gpu": "RTX 4090", "image": "img", "max_price_per_hour": 0.3}
        s, _ = make_scaler(
            r,
            clock,
            queue_block(provider="v", max_workers=1, instance=cap),
            server={"public_url": "https://cp.example.com", "worker_key": await worker_token(r)},
        )
        s.override = {"v": vast}
        await enqueue(r, clock, 1)
        await s.tick()
        (kept,) = await s.instances.live()
        assert kept.price == pytest.approx(0.35) and kept.status == "provisioning"
        assert [p["phase"] for p in pods(url)] == ["starting"]
        await vast.aclose()


async def test_a_server_killed_between_create_and_release_leaks_nothing(r: Any) -> None:
    """The release is journaled (teardown pending, with the pod's id) in the write that records the pod, before
    the destroy call; the next leader carries it out."""
    clock = Clock()
    cfg = SimConfig.model_validate({"api_key": "k", "machines": {"boot_seconds": 60, "runpod_place_on": [BAD]}})
    with running_sim(cfg, clock=clock) as url:
        s, rp = await runpod_scaler(r, clock, url, provider=CrashingRunPod, max_workers=1)
        await avoid(r, clock, BAD)
        await enqueue(r, clock, 1)
        with pytest.raises(Crash):
            await s.tick()
        (pod,) = pods(url)
        assert pod["host"] == BAD and pod["phase"] == "starting"
        (journaled,) = await s.instances.live()
        assert journaled.provider_id == pod["id"] and journaled.teardown == "pending"
        await s.alerter.aclose()
        clock.advance(90)  # the dead server's lock runs out; another takes over
        s2, rp2 = await runpod_scaler(r, clock, url, owner="s2", max_workers=1)
        await s2.tick()
        released, rented = pods(url)
        assert released["id"] == pod["id"] and released["phase"] == "deleted"
        assert rented["host"] != BAD and [i.provider_id for i in await s2.instances.live()] == [rented["id"]]
        await rp.aclose()
        await rp2.aclose()
        await s2.aclose()
