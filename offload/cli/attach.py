"""`offload enqueue --attach NAME=PATH`: files uploaded to storage and enqueued by reference (offload.files)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path
from typing import Any

from offload.cli.errors import errors, fail
from offload.cli.session import redis_url, settings
from offload.client import AsyncClient
from offload.files import File
from offload.queue.keyspace import validate_queue


def _attachments(value: Any, attach: list[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        fail("--attach needs --input to be a JSON object (the files go in under their names)")
    merged = dict(value)
    for item in attach:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            fail(f"--attach {item!r}: expected NAME=PATH")
        if name in merged:
            fail(f"--attach {name}: the input already has a field {name!r}")
        if not Path(path).is_file():
            fail(f"--attach {name}: {path}: not a readable file (missing, or a directory)")
        merged[name] = File(path)
    return merged


def enqueue_attached(
    url: str | None, config: Path | None, queue: str, value: Any, attach: list[str], defaults: dict[str, Any]
) -> str:
    """Upload the attached files (streamed, checked) and enqueue with references; a failure leaves neither."""
    job_input = _attachments(value, attach)
    conf = settings(config)
    target = redis_url(url, config)

    async def go() -> str:
        from offload.storage import create_storage

        storage = create_storage(conf.storage)  # the typed block as is
        try:
            limit = conf.storage.max_input_file_bytes
            async with AsyncClient(target, storage=storage, max_file_bytes=limit) as client:
                options = {k: v for k, v in defaults.items() if v is not None}
                if (within := options.pop("deadline_in", None)) is not None:  # the client's one `deadline`
                    options["deadline"] = timedelta(seconds=within)
                return await client.enqueue(queue, job_input, **options)
        finally:
            await storage.aclose()

    with errors():
        validate_queue(queue)
        return asyncio.run(go())
    raise AssertionError("unreachable")
