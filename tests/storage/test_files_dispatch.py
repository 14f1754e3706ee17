"""Files by reference through a dispatch worker: real Valkey, real S3 (rclone), the simulator over HTTP. The provider
gets a presigned URL, downloads it, and its checksum is the producer's; the job record keeps the reference."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.eventually import eventually
from support.s3server import RcloneS3
from support.servers import closed_port

from bench import web
from offload import AsyncClient, File
from offload.config import Settings
from offload.connection import connect
from offload.eventloop import within
from offload.files import REF_KEY, references_in
from offload.queue.store import QueueStore
from offload.storage.base import PART_BYTES
from offload.testing.sim.config import SimConfig
from offload.testing.sim.server import running_sim
from offload.worker.run import run_worker

BUCKET = "files-dispatch"
MiB = 1024 * 1024
BACKENDS: dict[str, dict[str, Any]] = {
    "http-job": {"kind": "http-job"},
    "runpod": {"kind": "runpod", "endpoint_id": "sdxl"},
    "replicate": {"kind": "replicate", "model": "acme/sdxl"},
    "fal": {"kind": "fal", "app": "fal-ai/flux/dev"},
    "openai": {"kind": "openai", "model": "gpt-sim"},
}


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    with running_sim(SimConfig.model_validate({"default": {"latency": 0.2}})) as url:
        yield str(url)


@pytest.fixture(autouse=True)
def _reset_sim(sim: str) -> None:
    web.post(f"{sim}/_sim/reset").raise_for_status()


@pytest.fixture
async def store(valkey_url: str) -> AsyncIterator[QueueStore]:
    redis = await connect(valkey_url)
    yield QueueStore(redis)
    await redis.aclose()


def settings_for(valkey_url: str, s3: RcloneS3, sim: str, kind: str) -> Settings:
    base = f"{sim}/v1" if kind == "openai" else sim
    return Settings.model_validate(
        {
            "redis_url": valkey_url,
            "storage": s3.settings(BUCKET),
            "backends": {"gpu": {**BACKENDS[kind], "base_url": base, "api_key": "sim-key"}},
            "queues": {"q": {"backend": "gpu", "poll_interval": 0.2, "poll_timeout": 60}},
        }
    )


async def sim_inputs(sim: str, input_id: str, count: int, timeout: float = 60) -> list[dict[str, Any]]:
    """What the simulator downloaded for the remote job of `input_id`, once all `count` URLs are fetched."""
    async with web.async_client() as http:

        async def fetched() -> list[dict[str, Any]] | None:
            jobs = (await http.get(f"{sim}/_sim/jobs", params={"input_id": input_id})).json()["jobs"]
            if not jobs:
                return None
            reply = await http.get(f"{sim}/_sim/jobs/{jobs[0]['id']}/inputs")
            view = reply.json() if reply.status_code == 200 else None
            if view is None or view["pending"] or len(view["files"]) < count:
                return None
            files: list[dict[str, Any]] = view["files"]
            return files

        result: list[dict[str, Any]] = await eventually(fetched, timeout, f"the simulator to fetch {input_id}'s files")
        return result


async def run_until_done(settings: Settings, store: QueueStore, job_id: str, timeout: float = 60) -> Any:
    stop = asyncio.Event()
    task = asyncio.create_task(run_worker(settings, "q", stop=stop, install_signals=False, grace_s=5))
    try:

        async def finished() -> Any:
            job = await store.get(job_id)
            return job if job.state.terminal else None

        return await eventually(finished, timeout, f"job {job_id} to finish")
    finally:
        stop.set()
        await task


@pytest.mark.parametrize("kind", list(BACKENDS))
async def test_every_backend_gets_a_url_it_can_download(
    kind: str, valkey_url: str, s3: RcloneS3, sim: str, store: QueueStore
) -> None:
    settings = settings_for(valkey_url, s3, sim, kind)
    image = os.urandom(300_000)
    job_input = {
        "id": f"in-{kind}",
        "prompt": "upscale",
        "messages": [{"role": "user", "content": "hi"}],
        "image": File(image, name="cat.png"),
        "more": [File(b"second file", name="b.txt")],
    }
    async with AsyncClient(valkey_url, storage=s3.settings(BUCKET)) as client:
        job_id = await client.enqueue("q", job_input)
    job = await run_until_done(settings, store, job_id)
    assert job.state.value == "succeeded", job.error
    refs = dict(references_in(job.input))  # the stored input keeps the references
    assert set(refs) == {("image",), ("more", 0)}
    fetched = {f["url"].rsplit("/", 1)[-1]: f for f in await sim_inputs(sim, f"in-{kind}", 2)}
    assert fetched["0-cat.png"]["sha256"] == hashlib.sha256(image).hexdigest() == refs[("image",)]["sha256"]
    assert fetched["1-b.txt"]["sha256"] == refs[("more", 0)]["sha256"]
    assert all(f["status"] == 200 for f in fetched.values())
    async with web.async_client() as http:
        listing = (await http.get(f"{sim}/_sim/jobs", params={"input_id": f"in-{kind}"})).json()
    sent = listing["jobs"][0]["input"]
    body = json.dumps(sent)
    assert REF_KEY not in body and "X-Amz-Signature" in body  # a presigned URL, not our reference
    assert s3.secret_key not in body


async def test_a_missing_input_object_dead_letters_before_any_submit(
    valkey_url: str, s3: RcloneS3, sim: str, store: QueueStore
) -> None:
    settings = settings_for(valkey_url, s3, sim, "http-job")
    async with AsyncClient(valkey_url, storage=s3.settings(BUCKET)) as client:
        job_id = await client.enqueue("q", {"id": "gone", "audio": File(b"short-lived")})
    key = (await store.get(job_id)).input["audio"][REF_KEY]
    s3.client().delete_object(Bucket=BUCKET, Key=key)  # expired or purged while the job waited
    job = await run_until_done(settings, store, job_id)
    assert job.state.value == "dead"
    assert job.error is not None and "input.audio" in job.error and "no longer exists" in job.error
    async with web.async_client() as http:
        assert (await http.get(f"{sim}/_sim/jobs", params={"input_id": "gone"})).json()["count"] == 0


UPLOADER = textwrap.dedent(
    """
    import json, sys
    from offload import Client, File

    def status(name):
        return int(next(line for line in open("/proc/self/status") if line.startswith(name)).split()[1])

    settings = json.loads(sys.argv[3])
    with Client(sys.argv[1], storage=settings) as client:
        client.enqueue("q", {"id": "small", "video": File(b"warm-up")})  # imports, connections, threads: warm
        base = status("VmRSS:")
        job_id = client.enqueue("q", {"id": "big", "video": File(sys.argv[2])})
    print(json.dumps({"id": job_id, "base_kib": base, "peak_kib": status("VmHWM:")}))
    """
)


@pytest.mark.heavy
@pytest.mark.xdist_group("files-heavy")
async def test_200_mib_input_reaches_the_provider_as_a_url_with_bounded_client_memory(
    valkey_url: str, s3: RcloneS3, sim: str, store: QueueStore, tmp_path: Path
) -> None:
    size = 200 * MiB
    path = tmp_path / "video.bin"
    digest = hashlib.sha256()
    with path.open("wb") as f:
        block = os.urandom(MiB)
        for i in range(200):  # distinct blocks, so a reordered or repeated part changes the checksum
            chunk = hashlib.sha256(i.to_bytes(4, "big")).digest() + block[32:]
            digest.update(chunk)
            f.write(chunk)
    assert path.stat().st_size == size
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", UPLOADER, valkey_url, str(path), json.dumps(s3.settings(BUCKET)),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await within(proc.communicate(), 300)
    assert proc.returncode == 0, err.decode()
    report = json.loads(out)
    # What the upload adds to a warm client is bounded by a few parts whatever the file's size; the growth, not
    # the absolute RSS (mostly imports and pools), so that load does not fail it (performance.md, *Test deadlines*).
    grew = report["peak_kib"] - report["base_kib"]
    assert grew < 3 * PART_BYTES // 1024, f"client RSS grew {grew} KiB while uploading 200 MiB ({report})"
    ref = (await store.get(report["id"])).input["video"]
    assert ref["size"] == size and ref["sha256"] == digest.hexdigest()
    job = await run_until_done(settings_for(valkey_url, s3, sim, "http-job"), store, report["id"], timeout=120)
    assert job.state.value == "succeeded", job.error
    (fetched,) = await sim_inputs(sim, "big", 1, timeout=120)
    assert fetched["status"] == 200 and fetched["size"] == size and fetched["sha256"] == digest.hexdigest()


async def test_files_on_local_storage_dead_letter_with_the_reason(
    valkey_url: str, s3: RcloneS3, sim: str, store: QueueStore, tmp_path: Path
) -> None:
    """A provider cannot fetch a file:// URL: the job says why instead of sending a link nobody can open."""
    local = {"kind": "local", "path": str(tmp_path / "results")}
    settings = settings_for(valkey_url, s3, sim, "http-job").model_copy(
        update={"storage": Settings.model_validate({"storage": local}).storage}
    )
    async with AsyncClient(valkey_url, storage=local) as client:
        job_id = await client.enqueue("q", {"id": "local", "f": File(b"on disk")})
    job = await run_until_done(settings, store, job_id)
    assert job.state.value == "dead" and job.error is not None and "need S3 storage" in job.error
    async with web.async_client() as http:
        assert (await http.get(f"{sim}/_sim/jobs", params={"input_id": "local"})).json()["count"] == 0


async def test_storage_outage_at_submit_is_retried_not_dead(
    valkey_url: str, s3: RcloneS3, sim: str, store: QueueStore
) -> None:
    """The worker cannot reach storage to check and sign a file: a transient failure (tried again later, with
    its reason on record), never a submission with a missing link and never an immediate dead letter."""
    async with AsyncClient(valkey_url, storage=s3.settings(BUCKET)) as client:
        job_id = await client.enqueue("q", {"id": "outage", "f": File(b"unreachable for now")}, max_attempts=5)
    settings = settings_for(valkey_url, s3, sim, "http-job")
    down = {**s3.settings(BUCKET), "endpoint_url": f"http://127.0.0.1:{closed_port()}"}
    broken = settings.model_copy(update={"storage": Settings.model_validate({"storage": down}).storage})
    stop = asyncio.Event()
    task = asyncio.create_task(run_worker(broken, "q", stop=stop, install_signals=False, grace_s=5))
    try:

        async def retried() -> Any:
            job = await store.get(job_id)
            return job if job.error and job.state.value in ("retrying", "queued") else None

        job = await eventually(retried, 30, "a retry after the storage outage")
    finally:
        stop.set()
        await task
    assert "signing input file URLs failed" in (job.error or "") and job.state.value != "dead"
    async with web.async_client() as http:
        assert (await http.get(f"{sim}/_sim/jobs", params={"input_id": "outage"})).json()["count"] == 0
    job = await run_until_done(settings, store, job_id)  # storage back: the same job goes through
    assert job.state.value == "succeeded", job.error
