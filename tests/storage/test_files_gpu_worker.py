"""Files by reference over HTTP and on GPU workers: a real server (uvicorn), real Valkey, real S3 (rclone), and
`offload worker --handler` as a real subprocess that holds only the server URL and a worker key.

The producer uploads through a presigned PUT (the bytes never pass through the server), the handler reads the
input through a URL the server signs for its job and returns two files, which land under the job's own prefix;
`offload result --download DIR` brings them back byte-identical.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml
from support.eventually import eventually_sync
from support.handlers import BLOB_MIB, blob_bytes, tiny_png
from support.s3server import RcloneS3
from support.server_helpers import BUCKET, client, make_key, new_queue, server
from support.servers import ValkeyServer
from test_gpu_worker import _reap, spawn_worker, wait_state

from bench import web
from offload.storage.inputs import outputs_prefix

__all__ = ["_reap"]  # the GPU-worker tests' fixture that kills every spawned worker after each test
OFFLOAD = str(Path(sys.executable).with_name("offload"))
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def api(valkey: ValkeyServer, s3: RcloneS3) -> Iterator[tuple[str, str]]:
    limits = {"max_input_file_bytes": 64 * MiB}
    with server(valkey.url, s3.settings(BUCKET, **limits), worker_lease_ms=3000, max_wait_s=2) as srv:
        yield srv


def upload(url: str, token: str, queue: str, name: str, data: bytes, **extra: Any) -> dict[str, Any]:
    """The HTTP form: ask for a target, PUT the bytes straight to storage, keep the reply (job id, reference)."""
    with client(url, token) as c:
        r = c.post(f"/v1/queues/{queue}/uploads", json={"name": name, "size": len(data), **extra})
        assert r.status_code == 201, r.text
        target: dict[str, Any] = r.json()
    put = web.put(target["url"], content=data, headers=target["headers"])
    assert put.status_code == 200, put.text
    return target


def objects(s3: RcloneS3, prefix: str = "") -> dict[str, int]:
    listing = s3.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"]: o["Size"] for o in listing.get("Contents", [])}


@pytest.mark.heavy
@pytest.mark.xdist_group("files-heavy")
def test_gpu_worker_reads_an_input_and_returns_two_files(
    api: tuple[str, str], s3: RcloneS3, valkey: ValkeyServer, tmp_path: Path
) -> None:
    url, boot = api
    q = new_queue("gpu")
    producer = make_key(url, boot, "producer", [q])
    audio = os.urandom(3 * MiB + 17)
    target = upload(url, producer, q, "talk.wav", audio, content_type="audio/wav")
    with client(url, producer) as c:
        r = c.post(f"/v1/queues/{q}/jobs", json={"input": {"audio": target["reference"], "lang": "en"}})
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
    assert job_id == target["job_id"]  # the job takes the id its uploads were made for: its files die with it
    spawn_worker(url, make_key(url, boot, "worker", [q]), q, "files", tmp_path)
    done = wait_state(url, producer, job_id, "succeeded", timeout=120)

    # both files under the job's own prefix, with the sizes the handler wrote
    stored = objects(s3, outputs_prefix(job_id))
    (run,) = [k for k in stored if k.rsplit("/", 1)[-1].startswith("run-")]  # the output JSON the record names
    assert done["result"] == f"s3://{BUCKET}/{run}"
    del stored[run]
    assert sorted(k.rsplit("-", 1)[-1] for k in stored) == ["render.png", "weights.bin"]
    assert sorted(stored.values()) == sorted([len(tiny_png(hashlib.sha256(audio).hexdigest())), BLOB_MIB * MiB])
    assert set(done["file_urls"]) == {target["reference"]["$file"], *stored}  # presigned GETs for each one
    assert all("X-Amz-Signature" in u for u in done["file_urls"].values())

    # offload result --download DIR: the output JSON and every file it refers to, byte-identical
    config = tmp_path / "offload.yaml"
    config.write_text(yaml.safe_dump({"redis_url": valkey.url, "storage": s3.settings(BUCKET)}))
    into = tmp_path / "result"
    into.mkdir()
    got = subprocess.run(
        [OFFLOAD, "result", job_id, "--download", str(into), "--config", str(config), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert got.returncode == 0, got.stderr
    output = orjson.loads((into / "output.json").read_bytes())
    seed = hashlib.sha256(audio).hexdigest()
    assert output["input_sha256"] == seed
    image = into / output["image"]["$file"].rsplit("/", 1)[-1]
    assert image.read_bytes() == tiny_png(seed)
    blob = into / output["extra"]["blob"]["$file"].rsplit("/", 1)[-1]
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == hashlib.sha256(b"".join(blob_bytes(seed))).hexdigest()
    assert (into / output["source"]["$file"].rsplit("/", 1)[-1]).read_bytes() == audio
    assert len(orjson.loads(got.stdout)["saved"]) == 4


def test_enqueue_refuses_bad_references(api: tuple[str, str], s3: RcloneS3) -> None:
    url, boot = api
    q, other = new_queue("mine"), new_queue("theirs")
    mine, theirs = make_key(url, boot, "producer", [q]), make_key(url, boot, "producer", [other])
    foreign = upload(url, theirs, other, "secret.bin", b"another queue's data")
    own = upload(url, mine, q, "a.bin", b"abc")

    def enqueue(job_input: Any) -> httpx.Response:
        with client(url, mine) as c:
            return c.post(f"/v1/queues/{q}/jobs", json={"input": job_input})

    r = enqueue({"x": [foreign["reference"]]})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "input", "x", 0]
    assert "is not an upload of queue" in r.json()["detail"][0]["msg"]
    missing = {**own["reference"], "$file": own["reference"]["$file"].replace("a.bin", "b.bin")}
    r = enqueue({"audio": missing})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "input", "audio"]
    assert "does not exist" in r.json()["detail"][0]["msg"]
    r = enqueue({"audio": {**own["reference"], "size": 999}})
    assert r.status_code == 422 and "the reference says 999" in r.json()["detail"][0]["msg"]
    r = enqueue({"audio": {**own["reference"], "sha256": "xyz"}})
    assert r.status_code == 422 and "sha256" in r.json()["detail"][0]["msg"]
    with client(url, mine) as c:
        r = c.post(f"/v1/queues/{q}/jobs/batch", json={"jobs": [{"input": 1}, {"input": {"f": foreign["reference"]}}]})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "jobs", 1, "input", "f"]
    with client(url, mine) as c:  # the good one goes in once; a resent request (reply lost) gets the same job,
        first = c.post(f"/v1/queues/{q}/jobs", json={"input": {"a": own["reference"]}})  # reusing the files for
        assert first.status_code == 201  # another input is refused
        resent = c.post(f"/v1/queues/{q}/jobs", json={"input": {"a": own["reference"]}})
        reply = {"id": first.json()["id"], "duplicate": True, "record_gone": False}
        assert resent.status_code == 200 and resent.json() == reply
        again = c.post(f"/v1/queues/{q}/jobs", json={"input": {"a": own["reference"], "b": 2}})
        assert again.status_code == 422 and "belong to job" in again.json()["detail"][0]["msg"]
        stats = c.get(f"/v1/queues/{q}").json()
    assert sum(stats["counts"].values()) == 1


def test_uploads_are_limited_and_scoped(api: tuple[str, str], s3: RcloneS3) -> None:
    url, boot = api
    q, other = new_queue("up"), new_queue("up")
    producer = make_key(url, boot, "producer", [q])
    with client(url, producer) as c:
        too_big = c.post(f"/v1/queues/{q}/uploads", json={"name": "x", "size": 64 * MiB + 1})
        assert too_big.status_code == 413 and "max_input_file_bytes" in too_big.json()["detail"]
        assert c.post(f"/v1/queues/{other}/uploads", json={"name": "x", "size": 1}).status_code == 403
        r = c.post(f"/v1/queues/{q}/uploads", json={"name": "../../etc/passwd", "size": 4})
        assert r.status_code == 201
        target = r.json()
    assert target["reference"]["$file"].rsplit("/", 1)[-1].endswith("-passwd")  # the name is made safe
    # the signed PUT takes exactly the declared length: more bytes are refused by storage itself
    over = web.put(target["url"], content=b"12345678", headers={**target["headers"], "Content-Length": "8"})
    assert over.status_code == 403
    assert objects(s3, target["reference"]["$file"]) == {}


def test_worker_cannot_reach_outside_its_job(api: tuple[str, str], s3: RcloneS3) -> None:
    """A worker key's holder, talking the protocol directly: another job's input, a key outside the job's prefix."""
    url, boot = api
    q = new_queue("w")
    producer, worker = make_key(url, boot, "producer", [q]), make_key(url, boot, "worker", [q])
    first = upload(url, producer, q, "one.bin", b"one")
    second = upload(url, producer, q, "two.bin", b"two")
    with client(url, producer) as c:
        job_a = c.post(f"/v1/queues/{q}/jobs", json={"input": {"f": first["reference"]}}).json()["id"]
        job_b = c.post(f"/v1/queues/{q}/jobs", json={"input": {"f": second["reference"]}}).json()["id"]
    with client(url, worker) as c:
        wid = c.post("/v1/workers/register", json={"queues": [q], "host": "t"}).json()["worker_id"]
        claimed = eventually_sync(
            lambda: c.post(f"/v1/workers/{wid}/claim", json={"queue": q, "max": 1, "wait": 1}).json()["jobs"],
            20,
            "a claim",
        )
        held = claimed[0]
        other = job_b if held["id"] == job_a else job_a
        other_key = (second if other == job_b else first)["reference"]["$file"]
        base = f"/v1/workers/{wid}/jobs/{held['id']}"
        r = c.post(f"{base}/files/url", json={"token": held["token"], "key": other_key})
        assert r.status_code == 403 and "not an input file" in r.json()["detail"]
        mine = held["input"]["f"]["$file"]
        ok = c.post(f"{base}/files/url", json={"token": held["token"], "key": mine})
        assert ok.status_code == 200 and web.get(ok.json()["url"]).content in (b"one", b"two")
        stale = c.post(f"{base}/files/url", json={"token": held["token"] + "x", "key": mine})
        assert stale.status_code == 409
        bad = c.post(
            f"{base}/complete",
            json={"token": held["token"], "output": {"stolen": {"$file": other_key, "size": 3}}},
        )
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "output", "stolen"]
        ghost = {"$file": outputs_prefix(held["id"]) + "1/0-ghost.bin", "size": 1}
        r = c.post(f"{base}/complete", json={"token": held["token"], "output": {"g": ghost}})
        assert r.status_code == 422 and "does not exist" in r.json()["detail"][0]["msg"]
    with client(url, producer) as c:
        job = c.get(f"/v1/jobs/{held['id']}").json()
    assert job["state"] == "active"  # nothing was stored: the worker can still complete properly


def test_async_handler_reads_and_returns_files(api: tuple[str, str], s3: RcloneS3, tmp_path: Path) -> None:
    url, boot = api
    q = new_queue("async")
    producer = make_key(url, boot, "producer", [q])
    target = upload(url, producer, q, "words.txt", b"quiet words")
    with client(url, producer) as c:
        job_id = c.post(f"/v1/queues/{q}/jobs", json={"input": {"f": target["reference"]}}).json()["id"]
    spawn_worker(url, make_key(url, boot, "worker", [q]), q, "files_async", tmp_path)
    done = wait_state(url, producer, job_id, "succeeded", timeout=60)
    (upper_key,) = [k for k in done["file_urls"] if k.startswith(outputs_prefix(job_id))]
    assert web.get(done["file_urls"][upper_key]).content == b"QUIET WORDS"
    key = done["result"].split("/", 3)[-1]  # s3://bucket/<key>
    output = orjson.loads(s3.client().get_object(Bucket=BUCKET, Key=key)["Body"].read())
    assert output["same"] is True and "await ctx.aopen" in output["refused"]
    assert output["upper"] == {"$file": upper_key, "size": 11, "content_type": "text/plain",
                               "sha256": hashlib.sha256(b"QUIET WORDS").hexdigest()}  # fmt: skip
