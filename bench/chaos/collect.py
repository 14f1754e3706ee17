"""What the fault harness reads after quiescence for its checker: every job's hash, and the bucket's stored outputs
with the files they link."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson


async def records(direct: Any, queues: Iterable[str]) -> dict[str, dict[str, str]]:
    """Every job's hash of `queues`, read in pipelines of 1,000."""
    records: dict[str, dict[str, str]] = {}
    for q in queues:
        keys = [k async for k in direct.scan_iter(match=f"offload:{{{q}}}:job:*", count=2000)]
        for i in range(0, len(keys), 1000):
            pipe = direct.pipeline(transaction=False)
            for k in keys[i : i + 1000]:
                pipe.hgetall(k)
            for k, h in zip(keys[i : i + 1000], await pipe.execute(), strict=True):
                records[k.split(":job:", 1)[1]] = h
    return records


def bucket(
    s3: Any, bucket: str, records: dict[str, dict[str, str]]
) -> tuple[dict[str, bytes | None], dict[str, bytes | None]]:
    """Every stored output JSON, and every copied file a succeeded job's output points at."""
    keys: set[str] = set()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="results/"):
        keys |= {o["Key"] for o in page.get("Contents", [])}

    def fetch(key: str) -> bytes | None:
        if key not in keys:
            return None
        for _ in range(3):
            with contextlib.suppress(Exception):
                return bytes(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        return None

    wanted = {h.get("output_key") or f"results/{j}.json" for j, h in records.items()}
    with ThreadPoolExecutor(16) as pool:
        outputs = dict(zip(wanted, pool.map(fetch, wanted), strict=True))
        linked: set[str] = set()
        for blob in outputs.values():
            with contextlib.suppress(orjson.JSONDecodeError, AttributeError, TypeError):
                for location in (orjson.loads(blob or b"{}").get("_offload_files") or {}).values():
                    linked.add(str(location).removeprefix(f"s3://{bucket}/"))
        files = dict(zip(linked, pool.map(fetch, linked), strict=True))
    return outputs, files
