"""Bringing a job's result home: the output JSON and every file it refers to, checked on arrival.

An output refers to files in two ways: `{"$file": key, ...}` references (files a GPU worker's handler returned)
and location strings of our own storage (`s3://bucket/key`, or a path under the local root: provider files the
dispatch worker copied, `offload.storage.outputs`). `download_result` saves the output as `output.json` in a
directory and each referenced file beside it under its key's last segment, streaming, and checks a reference's
size and SHA-256 (a file that does not match is removed and reported).

Only the job's own objects are taken: its input files, the files a GPU worker returned for it and the provider
files copied from its output (offload.storage.inputs knows whose keys are whose). An output echoes its input, so a
reference to another job's or another queue's object is the producer's text, not the job's file: it is skipped
and reported, never fetched with the credentials of whoever downloads the result.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from offload.files import REF_KEY, references_in
from offload.storage.base import InvalidKey, Storage, StorageError, validate_key
from offload.storage.inputs import job_of_key, run_of
from offload.storage.namespace import space_of
from offload.storage.outputs import files_prefix


@dataclass(frozen=True)
class Downloaded:
    output: Path
    files: list[Path]
    skipped: list[str]  # keys the output refers to that are not the job's own


def owns(job_id: str, output_key: str, key: str) -> bool:
    """Whether `key` is one of job `job_id`'s own files: under its inputs, its GPU worker's outputs or its copied
    provider files (for an output key of its own choosing: the files beside it, `files_prefix`)."""
    try:
        validate_key(key)  # no `..` walking out of the job's prefix
    except InvalidKey:
        return False
    queue = job_id.partition(":")[0]
    if job_of_key(queue, key) == job_id:
        return True
    return space_of(key) in (None, queue) and key.startswith(files_prefix(output_key)) and key != output_key


def result_key(storage: Storage, job_id: str, output_key: str, result: str | None) -> str | None:
    """The key of the object a succeeded job's record points at (its `result` location): the job's output key,
    or the run object a GPU worker's fenced complete stored (`inputs.run_output_key`); None for anything else."""
    if not result:
        return None
    try:
        if result == storage.location(output_key):
            return output_key
        root = storage.location("x")[:-1]  # where every key of this storage starts
        key = result[len(root) :] if result.startswith(root) else ""
        return key if run_of(job_id, key) else None
    except ValueError:  # a key or job id no storage takes: nothing of ours
        return None


def referenced_keys(storage: Storage, output: Any) -> list[tuple[str, dict[str, Any] | None]]:
    """(key, reference or None) for every file the output refers to, in document order, each key once."""
    found: dict[str, dict[str, Any] | None] = {}
    for _, ref in references_in(output):
        found.setdefault(ref[REF_KEY], ref)
    root = storage.location("x")[:-1]  # where every key of this storage starts, e.g. s3://bucket/prefix/
    for text in _strings(output):
        if text.startswith(root) and len(text) > len(root):
            found.setdefault(text[len(root) :], None)
    return list(found.items())


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


async def download_result(
    storage: Storage, job_id: str, output_key: str, directory: Path, stored: str | None = None
) -> Downloaded:
    """`stored`: the key the job's record points at (`result_key`), when it is not the output key."""
    await asyncio.to_thread(directory.mkdir, parents=True, exist_ok=True)
    raw = await storage.get_bytes(stored or output_key)
    output_path = directory / "output.json"
    await asyncio.to_thread(output_path.write_bytes, raw)
    saved: list[Path] = []
    skipped: list[str] = []
    taken: set[str] = {"output.json"}
    for key, ref in referenced_keys(storage, orjson.loads(raw)):
        if not owns(job_id, output_key, key):
            skipped.append(key)
            continue
        name = key.rsplit("/", 1)[-1]
        while name in taken:
            name = "_" + name
        taken.add(name)
        path = directory / name
        size, digest = await storage.download(key, path)
        if ref is not None and (ref.get("size") not in (None, size) or ref.get("sha256") not in (None, digest)):
            await asyncio.to_thread(path.unlink, missing_ok=True)
            raise StorageError(f"{key}: downloaded file does not match its reference (size or SHA-256)", permanent=True)
        saved.append(path)
    return Downloaded(output_path, saved, skipped)
