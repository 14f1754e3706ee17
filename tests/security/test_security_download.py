"""`offload result ID --download DIR/` takes only the job's own objects, on real servers:
Valkey, an S3 server (rclone), the simulator echoing its input through a dispatch worker, and the real CLI. A
producer whose output echoes the locations of another queue's objects (and of another job of its own queue) must
not get them saved by whoever downloads its result: each is skipped with a one-line warning naming it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.s3server import RcloneS3

from offload import AsyncClient, File
from offload.config import Settings
from offload.connection import connect
from offload.queue.store import QueueStore
from offload.testing.sim.config import SimConfig
from offload.testing.sim.server import running_sim
from offload.worker.run import run_workers

BUCKET = "egress-download"
VICTIM_BYTES = b"the victim's input " + os.urandom(16).hex().encode()
NEIGHBOUR_BYTES = b"a neighbour job's input " + os.urandom(16).hex().encode()


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    with running_sim(SimConfig.model_validate({"default": {"latency": 0.05}})) as url:
        yield str(url)


def settings_for(valkey_url: str, s3: RcloneS3, sim: str) -> dict[str, Any]:
    queue = {"backend": "gpu", "poll_interval": 0.2, "poll_timeout": 30}
    return {
        "redis_url": valkey_url,
        "storage": s3.settings(BUCKET),
        "backends": {"gpu": {"kind": "http-job", "base_url": sim, "api_key": "k"}},
        "queues": {"victim": queue, "mine": queue},
    }


async def run_to_success(config: dict[str, Any], valkey_url: str, jobs: list[tuple[str, Any]]) -> list[Any]:
    """Enqueue (queue, input) pairs with the Python client (its File uploads), serve both queues until all succeed."""
    async with AsyncClient(valkey_url, storage=config["storage"]) as client:
        ids = [await client.enqueue(queue, job_input) for queue, job_input in jobs]
    redis = await connect(valkey_url)
    store = QueueStore(redis)
    stop = asyncio.Event()
    task = asyncio.create_task(
        run_workers(Settings.model_validate(config), ["victim", "mine"], stop=stop, install_signals=False, grace_s=5)
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            done = [await store.get(i) for i in ids]
            if all(j.state.terminal for j in done):
                break
            assert time.monotonic() < deadline, [(j.id, j.state.value, j.error) for j in done]
            await asyncio.sleep(0.1)
        assert [j.state.value for j in done] == ["succeeded"] * len(ids), [j.error for j in done]
        return done
    finally:
        stop.set()
        await task
        await redis.aclose()


async def test_download_saves_only_the_jobs_own_objects(
    valkey_url: str, s3: RcloneS3, sim: str, tmp_path: Path
) -> None:
    config = settings_for(valkey_url, s3, sim)
    victim, neighbour = await run_to_success(
        config,
        valkey_url,
        [
            ("victim", {"prompt": "private", "doc": File(VICTIM_BYTES, name="secret.bin")}),
            ("mine", {"prompt": "a neighbour", "doc": File(NEIGHBOUR_BYTES, name="other.bin")}),
        ],
    )
    reader = s3.client()
    victim_doc = json.loads(reader.get_object(Bucket=BUCKET, Key=victim.output_key)["Body"].read())
    victim_input, neighbour_input = victim.input["doc"]["$file"], neighbour.input["doc"]["$file"]
    foreign = [
        *victim_doc["_offload_files"].values(),  # the victim's copied files (its input, echoed, among them)
        f"s3://{BUCKET}/{victim_input}",
        f"s3://{BUCKET}/{victim.output_key}",
        f"s3://{BUCKET}/{neighbour_input}",  # same queue, another job
    ]
    (attacker,) = await run_to_success(
        config, valkey_url, [("mine", {"prompt": "echo these", "steal": foreign, "own": File(b"mine", name="m.txt")})]
    )

    (tmp_path / "offload.yaml").write_text(json.dumps({"redis_url": valkey_url, "storage": config["storage"]}))
    into = tmp_path / "result"
    into.mkdir()
    got = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "offload", "result", attacker.id, "--download", f"{into}/", "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OFFLOAD_CONFIG": str(tmp_path / "offload.yaml")},
    )
    assert got.returncode == 0, got.stderr
    saved = {p.name: p.read_bytes() for p in into.iterdir()}
    assert not [name for name, body in saved.items() if VICTIM_BYTES in body or NEIGHBOUR_BYTES in body]
    assert not [name for name in saved if name.endswith(".json") and name != "output.json"]  # no one's output JSON
    output = json.loads(saved["output.json"])
    own = list(output["_offload_files"].values())  # the simulator's file and the copy of its own input
    assert len(own) == 2 and all(f"/results/mine:_files/{attacker.id.split(':')[1]}~" in loc for loc in own)
    assert sorted(saved) == sorted(["output.json", *(loc.rsplit("/", 1)[1] for loc in own)])
    assert b"mine" in saved.values()
    warnings = [line for line in got.stderr.splitlines() if line.startswith("warning: skipped")]
    skipped = [loc.removeprefix(f"s3://{BUCKET}/") for loc in foreign]
    assert len(warnings) == len(skipped) and all(key in line for key, line in zip(skipped, warnings, strict=True))
    assert len(json.loads(got.stdout)["saved"]) == 3
