"""Rows of the autoscaling guide table (docs/reference/autoscaling-guide.md) that no other test showed on its own:
each scale-up trigger as a pure function of the load, the provider settings that shape a rental, the order idle
machines go in, and the CLI's protect/unprotect on a rented machine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from support.admin_redis import AdminRedis, redis_admin
from support.autoscale_helpers import Clock, make_scaler, put_worker, queue_block
from typer.testing import CliRunner

from offload.autoscale.instances import Instance, claim_problem
from offload.autoscale.providers import LaunchSpec
from offload.autoscale.providers.runpod import CUDA_VERSIONS, RunPodConfig, RunPodProvider
from offload.autoscale.providers.vastai import VastConfig, VastProvider
from offload.autoscale.settings import AutoscaleSettings, validate_autoscale
from offload.autoscale.triggers import QueueLoad, scale_up
from offload.cli.app import app
from offload.connection import connect
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore

DAY = 1_800_000_000 - 1_800_000_000 % 86400  # a midnight, UTC


def settings(**overrides: Any) -> AutoscaleSettings:
    return validate_autoscale(queue_block(**overrides), "q")


def running(n: int, status: str = "running") -> list[Instance]:
    return [Instance(id=f"as-{i}", queue="gpu", provider="m", status=status, created_at=float(i)) for i in range(n)]


def test_no_workers_fires_only_when_nobody_serves_the_queue() -> None:
    cfg = settings(scale_up=[{"trigger": "no_workers"}])
    assert scale_up(cfg, QueueLoad(pending=3, oldest_age=10, live_workers=0), [], DAY).target == 1
    # a worker started by hand serves the queue: no rental
    assert scale_up(cfg, QueueLoad(pending=3, oldest_age=10, live_workers=1), [], DAY).target == 0
    assert scale_up(cfg, QueueLoad(pending=0, oldest_age=None, live_workers=0), [], DAY).target == 0


def test_queue_depth_adds_one_instance_over_the_threshold() -> None:
    cfg = settings(scale_up=[{"trigger": "queue_depth", "threshold": 50}])
    assert scale_up(cfg, QueueLoad(pending=50, oldest_age=1, live_workers=1), running(1), DAY).target == 1
    over = scale_up(cfg, QueueLoad(pending=51, oldest_age=1, live_workers=1), running(1), DAY)
    assert over.target == 2 and over.reasons[0].startswith("queue_depth")
    assert scale_up(cfg, QueueLoad(pending=500, oldest_age=1, live_workers=2), running(2), DAY).target == 3
    assert scale_up(cfg, QueueLoad(pending=500, oldest_age=1, live_workers=3), running(3), DAY).target == 3  # max


def test_latency_adds_one_instance_when_the_oldest_job_waited_too_long() -> None:
    cfg = settings(scale_up=[{"trigger": "latency", "max_latency": "5m"}])
    assert scale_up(cfg, QueueLoad(pending=2, oldest_age=300, live_workers=1), running(1), DAY).target == 1
    late = scale_up(cfg, QueueLoad(pending=2, oldest_age=301, live_workers=1), running(1), DAY)
    assert late.target == 2 and late.reasons[0].startswith("latency")


def test_an_up_schedule_holds_its_workers_for_its_duration() -> None:
    cron = {"trigger": "schedule", "cron": "0 8 * * *", "workers": 2}
    cfg = settings(scale_up=[{**cron, "duration": "10h"}])
    idle = QueueLoad(pending=0, oldest_age=None, live_workers=0)
    assert scale_up(cfg, idle, [], DAY + 8 * 3600 - 60).target == 0  # before the fire
    assert scale_up(cfg, idle, [], DAY + 8 * 3600 + 60).target == 2
    assert scale_up(cfg, idle, running(2), DAY + 17 * 3600).floor == 2  # held: scale-down may not go below
    assert scale_up(cfg, idle, [], DAY + 18 * 3600 + 60).target == 0  # 10 h later
    short = settings(scale_up=[cron])  # no duration: one poll interval (30 s)
    assert scale_up(short, idle, [], DAY + 8 * 3600 + 20).target == 2
    assert scale_up(short, idle, [], DAY + 8 * 3600 + 40).target == 0


def spec(**kw: Any) -> LaunchSpec:
    base: dict[str, Any] = dict(
        label="offload-as-1", queue="gpu", image="img", gpu="RTX 4090", gpu_count=1, disk_gb=None,
        max_price_per_hour=0.5, env={},
    )  # fmt: skip
    base.update(kw)
    return LaunchSpec(**base)


def test_runpod_settings_shape_the_pod() -> None:
    plain = RunPodProvider("rp", RunPodConfig(api_key="k"))._gql_fields(spec(), "NVIDIA RTX A5000")
    assert str(plain["cloudType"]) == "SECURE" and plain["containerDiskInGb"] == 50
    assert plain["volumeInGb"] == 0 and "volumeMountPath" not in plain  # no billed volume by default
    assert "allowedCudaVersions" not in plain  # no CUDA restriction by default
    cfg = RunPodConfig(
        api_key="k",
        cloud_type="COMMUNITY",
        container_disk_gb=80,
        volume_in_gb=30,
        volume_mount_path="/data",
        min_cuda_version="12.8",
    )
    fields = RunPodProvider("rp", cfg)._gql_fields(spec(), "NVIDIA RTX A5000")
    assert str(fields["cloudType"]) == "COMMUNITY" and fields["containerDiskInGb"] == 80
    assert fields["volumeInGb"] == 30 and fields["volumeMountPath"] == "/data"
    assert fields["allowedCudaVersions"] == ["12.8", "12.9", "13.0"] and CUDA_VERSIONS[-1] == "13.0"
    assert RunPodProvider("rp", cfg)._gql_fields(spec(disk_gb=40), "x")["containerDiskInGb"] == 40  # the queue's
    assert RunPodProvider("rp", RunPodConfig(api_key="k", gpu_type_id="A"))._gpus(spec()) == ["A"]  # provider wins
    assert RunPodProvider("rp", RunPodConfig(api_key="k"))._gpus(spec()) == ["RTX 4090"]  # else instance.gpu


def offer(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(
        gpu_name="RTX 4090", num_gpus=1, dph_total=0.4, disk_space=100, verified=True, reliability2=0.99,
        inet_down=500, cuda_max_good=12.8, geolocation="Oregon, US", machine_id=1,
    )  # fmt: skip
    base.update(kw)
    return base


def test_vast_settings_filter_the_offers() -> None:
    vast = VastProvider("v", VastConfig(api_key="k", gpu_name="RTX_4090", max_price_per_hour=0.45, disk_gb=60))
    gpu, price, disk = vast._wanted(spec(gpu="A100", max_price_per_hour=0.9))
    assert (gpu, price, disk) == ("RTX 4090", 0.45, 60)  # the provider's settings win over the queue's
    assert vast._wanted(spec(disk_gb=30))[2] == 30  # the queue's disk_gb wins over the provider's

    def ok(o: dict[str, Any], v: VastProvider = vast) -> bool:
        return v._acceptable(o, spec(), gpu, price, disk)

    assert ok(offer())
    assert not ok(offer(dph_total=0.5))  # over the price cap
    assert not ok(offer(verified=False))  # verified_only defaults to true
    assert not ok(offer(inet_down=99))  # min_download_mbps defaults to 100
    assert not ok(offer(cuda_max_good=12.4))  # min_cuda_version defaults to "12.8"
    assert not ok(offer(geolocation="Shanghai, CN"))  # exclude_countries defaults to ["CN"]
    any_cuda = VastProvider("v", VastConfig(api_key="k", gpu_name="RTX 4090", min_cuda_version="none"))
    assert ok(offer(cuda_max_good=11.0), any_cuda)


@pytest.fixture
async def r(fast_valkey_url: str) -> AsyncIterator[AdminRedis]:
    client = redis_admin(await connect(fast_valkey_url))
    yield client
    await client.aclose()


def qstore(r: AdminRedis, clock: Clock) -> QueueStore:
    return QueueStore(r, clock_ms=lambda: int(clock() * 1000))


async def test_idle_machines_go_oldest_first(r: AdminRedis) -> None:
    """Two machines idle since the same moment, above min_workers: 1: the one rented first is drained."""
    clock = Clock()
    block = queue_block(
        min_workers=1,
        max_workers=2,
        scale_up=[{"trigger": "queue_depth", "threshold": 0}],
        scale_down=[{"trigger": "idle", "timeout": "5m"}],
    )
    s, _ = make_scaler(r, clock, block)
    await qstore(r, clock).enqueue_many("gpu", [JobSpec(input=i) for i in range(5)])
    await s.tick()
    (old,) = await s.instances.live()
    await put_worker(r, "w-old", "gpu", old.id, clock())
    clock.advance(30)
    await s.tick()  # the first machine serves; the backlog still asks for one more
    (new,) = [i for i in await s.instances.live() if i.id != old.id]
    assert new.created_at > old.created_at
    await qstore(r, clock).purge("gpu", "queued")
    clock.advance(30)
    for worker, inst in (("w-old", old), ("w-new", new)):  # both work one job in the same evaluation
        await put_worker(r, worker, "gpu", inst.id, clock(), in_flight=1)
    await s.tick()  # so both have been idle since the same moment: only their age tells them apart
    for _ in range(20):  # 10 minutes, both heart-beating and idle: well past the idle timeout for both
        clock.advance(30)
        await put_worker(r, "w-old", "gpu", old.id, clock())
        await put_worker(r, "w-new", "gpu", new.id, clock())
        await s.tick()
    got = {i.id: i.status for i in await s.instances.recent()}
    assert got[new.id] == "running" and got[old.id] in ("draining", "terminated"), got


async def test_the_cli_protects_and_unprotects_a_rented_machine(r: AdminRedis, fast_valkey_url: str) -> None:
    clock = Clock()
    s, _ = make_scaler(r, clock)
    await qstore(r, clock).enqueue("gpu", JobSpec(input=1))
    await s.tick()
    (inst,) = await s.instances.live()
    runner = CliRunner()
    for command, flag in (("protect", True), ("unprotect", False)):
        res = await asyncio.to_thread(runner.invoke, app, ["autoscale", command, inst.id, "--url", fast_valkey_url])
        assert res.exit_code == 0 and f"{inst.id} {command}ed" in res.output, res.output
        got = await s.instances.get(inst.id)
        assert got is not None and got.protect is flag
    await s.aclose()


async def test_a_worker_started_by_hand_may_play_a_mock_machine(r: AdminRedis) -> None:
    """The dry-run rehearsal: the mock rents nothing and gives no instance token, so a worker started by hand with
    OFFLOAD_INSTANCE_ID=as-… may register as that machine (for its queue only) and makes it running."""
    clock = Clock()
    s, _ = make_scaler(r, clock)
    await qstore(r, clock).enqueue("gpu", JobSpec(input=1))
    await s.tick()
    (inst,) = await s.instances.live()
    assert inst.status in ("provisioning", "booting") and inst.token_hash == ""
    assert await claim_problem(r, inst.id, None, ["gpu"]) is None
    assert "another queue" in str(await claim_problem(r, inst.id, None, ["cpu"]))
    await put_worker(r, "by-hand", "gpu", inst.id, clock())  # the registry record its registration writes
    clock.advance(30)
    await s.tick()
    got = await s.instances.get(inst.id)
    assert got is not None and got.status == "running" and got.worker_id == "by-hand"
    await s.aclose()
