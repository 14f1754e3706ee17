"""The RunPod and Vast.ai adapters against the simulator's rental routes (a real HTTP server speaking their wire
formats): preference lists, out of stock, offers taken, broken hosts, pre-emption, 429s, 5xx, the GraphQL
fallback, and the `offload-` label guard."""

from __future__ import annotations

import pytest
from support.autoscale_helpers import sim_call

from bench import web
from offload.autoscale.providers import LaunchSpec, MachineState, NotOurs, OutOfCapacity, ProviderError
from offload.autoscale.providers.runpod import RunPodConfig, RunPodProvider
from offload.autoscale.providers.vastai import VastConfig, VastProvider
from offload.testing.sim.config import SimConfig
from offload.testing.sim.server import running_sim


def spec(label: str = "offload-as-1", gpu: str | None = None, **kw: object) -> LaunchSpec:
    base: dict[str, object] = dict(
        label=label,
        queue="gpu",
        image="ghcr.io/me/worker:1",
        gpu=gpu,
        gpu_count=1,
        disk_gb=40,
        max_price_per_hour=0.5,
        env={"OFFLOAD_INSTANCE_ID": "as-1"},
    )
    base.update(kw)
    return LaunchSpec(**base)  # type: ignore[arg-type]


def sim_config(**machines: object) -> SimConfig:
    return SimConfig.model_validate({"seed": 7, "api_key": "k", "machines": {"boot_seconds": 0, **machines}})


async def test_runpod_rest_preference_list_out_of_stock_and_label_guard() -> None:
    cfg = sim_config(out_of_stock=["NVIDIA GeForce RTX 4090"])
    with running_sim(cfg) as url:
        rp = RunPodProvider(
            "rp",
            RunPodConfig(
                api_key="k",
                base_url=url,
                min_cuda_version="12.4",
                gpu_type_ids=["NVIDIA GeForce RTX 4090", "NVIDIA RTX A5000"],
            ),
        )
        m = await rp.create(spec())
        assert m.raw["gpu"]["id"] == "NVIDIA RTX A5000"  # the first choice was out of stock
        assert m.price_per_hour == pytest.approx(0.36) and m.state == MachineState.RUNNING
        # a hand-made pod in the same account: never listed, never destroyed
        async with web.async_client(base_url=url, headers={"Authorization": "Bearer k"}) as c:
            foreign = (
                await c.post("/v2/pods", json={"name": "prod-db", "image": "x", "gpu": {"id": "NVIDIA RTX A5000"}})
            ).json()["id"]
        assert [x.provider_id for x in await rp.list()] == [m.provider_id]
        with pytest.raises(NotOurs):
            await rp.destroy(foreign)
        await rp.destroy(m.provider_id)
        await rp.destroy(m.provider_id)  # already gone: still success
        assert await rp.get(m.provider_id) is None
        with pytest.raises(OutOfCapacity):
            await RunPodProvider(
                "rp", RunPodConfig(api_key="k", base_url=url, gpu_type_id="NVIDIA GeForce RTX 4090")
            ).create(spec())
        with pytest.raises(ProviderError, match="rejected"):
            await RunPodProvider("rp", RunPodConfig(api_key="bad", base_url=url)).list()
        await rp.aclose()


async def test_runpod_graphql_fallback_and_failing_terminate() -> None:
    with running_sim(sim_config(rest_disabled=True, destroy_failures=5)) as url:
        rp = RunPodProvider(
            "rp",
            RunPodConfig(api_key="k", base_url=url),
        )
        m = await rp.create(spec(gpu="NVIDIA GeForce RTX 3090"))
        assert rp.use_graphql and m.label == "offload-as-1" and m.price_per_hour == pytest.approx(0.43)
        assert [x.provider_id for x in await rp.list()] == [m.provider_id]
        with pytest.raises(ProviderError):
            await rp.destroy(m.provider_id)  # 4 attempts, all answered 500
        await rp.destroy(m.provider_id)
        assert await rp.get(m.provider_id) is None
        stats = sim_call("GET", f"{url}/_sim/stats")["requests"]
        assert stats["pods.graphql"] >= 5 and stats["pods.create"] == 1  # REST tried once, then GraphQL
        await rp.aclose()


async def test_runpod_429_and_ambiguous_5xx_create() -> None:
    cfg = SimConfig.model_validate(
        {"seed": 3, "machines": {"boot_seconds": 0}, "families": {"pods": {"rate_429": 0.5, "retry_after_seconds": 0}}}
    )
    with running_sim(cfg) as url:
        rp = RunPodProvider("rp", RunPodConfig(api_key="k", base_url=url, gpu_type_id="NVIDIA RTX A5000"))
        rp.http.attempts = 8
        machines = [await rp.create(spec(label=f"offload-as-{i}")) for i in range(3)]
        assert len({m.provider_id for m in await rp.list()}) == 3 == len(machines)
        assert sim_call("GET", f"{url}/_sim/stats")["faults"]  # 429s did happen and were ridden out
        sim_call("POST", f"{url}/_sim/outage", json={"family": "pods", "mode": "503"})
        with pytest.raises(ProviderError) as err:  # no price cap: no price check before the create
            await rp.create(spec(label="offload-as-9", max_price_per_hour=None))
        assert err.value.ambiguous  # a 5xx on create: may have rented, so it is not blindly repeated
        await rp.aclose()


async def test_vast_filters_cheapest_offer_taken_and_avoided_hosts() -> None:
    with running_sim(sim_config(offer_taken=[5000])) as url:
        vast = VastProvider("v", VastConfig(api_key="k", base_url=url, gpu_name="RTX_4090", min_reliability=0.9))
        offers = await vast.search(spec())
        # CN (cheaper) excluded by default, unverified excluded, over-price excluded, sorted by price
        assert [o["id"] for o in offers] == [5000, 5003, 5002]
        m = await vast.create(spec())
        assert m.host_id == "1004" and m.price_per_hour == pytest.approx(0.38)  # 5000 was taken: the next one
        shown = await vast.get(m.provider_id)
        assert shown is not None and shown.state == MachineState.RUNNING and shown.label == "offload-as-1"
        with pytest.raises(OutOfCapacity):  # 1004 rented, 1003 avoided, 5000 taken: nothing left
            await vast.create(spec(label="offload-as-2", avoid_hosts={"1003"}))
        m2 = await vast.create(spec(label="offload-as-2"))
        assert m2.host_id == "1003"
        ours = {x.provider_id for x in await vast.list()}
        assert ours == {m.provider_id, m2.provider_id}
        await vast.destroy(m.provider_id)
        assert await vast.get(m.provider_id) is None
        only_us = VastProvider("v", VastConfig(api_key="k", base_url=url, gpu_name="RTX 4090", countries=["US"]))
        assert [o["id"] for o in await only_us.search(spec(max_price_per_hour=1.0))] == [5004]  # 5002 is rented
        await vast.aclose()


async def test_vast_broken_host_preemption_and_429_without_retry_after() -> None:
    cfg = SimConfig.model_validate(
        {
            "seed": 1,
            "api_key": "k",
            "machines": {"boot_seconds": 0, "broken_hosts": ["1001"]},
            "families": {"vastai": {"rate_429": 0.4}},
        }
    )
    with running_sim(cfg) as url:
        vast = VastProvider("v", VastConfig(api_key="k", base_url=url, gpu_name="RTX 4090"))
        vast.http.attempts = 10
        broken = await vast.create(spec())
        assert broken.host_id == "1001"
        seen = await vast.get(broken.provider_id)
        assert seen is not None and seen.state == MachineState.FAILED and "daemon" in seen.message
        ok = await vast.create(spec(label="offload-as-2", avoid_hosts={"1001"}))
        sim_call("POST", f"{url}/_sim/machines/{ok.provider_id}/vanish")  # pre-empted
        assert await vast.get(ok.provider_id) is None
        assert ok.provider_id not in {x.provider_id for x in await vast.list()}
        await vast.destroy(ok.provider_id)  # gone already: success
        with pytest.raises(ProviderError, match="rejected"):
            await VastProvider("v", VastConfig(api_key="nope", base_url=url, gpu_name="RTX 4090")).list()
        await vast.aclose()


async def test_vast_country_filters_reach_past_the_first_page_of_offers() -> None:
    """70 cheaper offers elsewhere fill the search's 64-offer page: the country filters must be in the query."""
    cheap = [
        {"id": 6000 + i, "dph_total": 0.10 + i / 1000, "machine_id": 2000 + i, "geolocation": g}
        for i, g in enumerate(["Shanghai, CN"] * 35 + ["Bavaria, DE"] * 35)
    ]
    us = {"id": 7000, "dph_total": 0.45, "machine_id": 3000, "geolocation": "Oregon, US"}
    de = {"id": 7001, "dph_total": 0.44, "machine_id": 3001, "geolocation": "Bavaria, DE"}
    with running_sim(sim_config(offers=[*cheap, us, de])) as url:
        only_us = VastProvider("v", VastConfig(api_key="k", base_url=url, gpu_name="RTX 4090", countries=["us"]))
        assert [o["id"] for o in await only_us.search(spec())] == [7000]
        not_de = VastProvider(
            "v", VastConfig(api_key="k", base_url=url, gpu_name="RTX 4090", exclude_countries=["CN", "DE"])
        )
        assert [o["id"] for o in await not_de.search(spec())] == [7000]
        await only_us.aclose()
        await not_de.aclose()


def test_vast_min_cuda_version_is_checked_at_config_load() -> None:
    from pydantic import ValidationError

    for good in ("12.8", "12", "none", None):
        VastConfig(api_key="k", min_cuda_version=good)
    with pytest.raises(ValidationError, match="min_cuda_version"):
        VastConfig(api_key="k", min_cuda_version="12.8.1")


async def test_vast_search_never_crashes_on_a_stored_three_part_cuda_version() -> None:
    """A config stored before the check (model_construct skips validation): still searched, as 12.8."""
    with running_sim(sim_config()) as url:
        cfg = VastConfig(api_key="k", base_url=url, gpu_name="RTX 4090")
        vast = VastProvider("v", cfg.model_copy(update={"min_cuda_version": "12.8.1"}))
        assert [o["id"] for o in await vast.search(spec())] == [5000, 5003, 5002]
        await vast.aclose()
