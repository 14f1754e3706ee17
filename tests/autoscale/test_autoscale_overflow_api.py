"""An autoscale block set over the HTTP API may carry `overflow` only with the backends offload.yaml names for the
queue: the overflow workers read theirs from offload.yaml, so a fleet sized for an overflow nobody serves would
leave the burst waiting. 422 with the field named otherwise."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.autoscale_helpers import VAULT_KEY
from support.server_helpers import server
from support.servers import ValkeyServer

from bench import web
from offload.config import Settings

FLEET = {"enabled": True, "provider": "dry", "max_workers": 2}


def _settings(tmp_path: Path, valkey: ValkeyServer) -> Settings:
    api = {"kind": "runpod", "endpoint_id": "e", "base_url": "http://127.0.0.1:9", "api_key": "k"}
    return Settings.model_validate(
        {
            "redis_url": valkey.url,
            "storage": {"kind": "local", "path": str(tmp_path)},
            "backends": {"api": api, "other": api},
            "queues": {
                "mixed": {"autoscale": {**FLEET, "overflow": {"backends": ["api"]}}},
                "plain": {"autoscale": FLEET},
            },
        }
    )


async def test_an_api_block_names_the_overflow_offload_yaml_names(
    valkey: ValkeyServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OFFLOAD_VAULT_MASTER_KEY", VAULT_KEY)
    monkeypatch.setenv("OFFLOAD_AUTOSCALER", "off")
    admin = "admin-" + secrets.token_hex(16)
    with server(valkey.url, settings=_settings(tmp_path, valkey), admin_key=admin) as (url, _):
        async with web.async_client(base_url=url, headers={"Authorization": f"Bearer {admin}"}) as api:
            made = await api.post("/v1/autoscale/providers", json={"name": "dry", "type": "mock", "config": {}})
            assert made.status_code == 201, made.text

            async def put(queue: str, backends: list[str]) -> httpx.Response:
                block: dict[str, Any] = {**FLEET, "overflow": {"backends": backends, "after": "2m"}}
                return await api.put(f"/v1/autoscale/queues/{queue}", json=block)

            assert (await put("mixed", ["api"])).status_code == 200  # the same backends, `after` tuned
            for queue, backends in (("mixed", ["other"]), ("mixed", ["api", "other"]), ("plain", ["api"])):
                refused = await put(queue, backends)
                assert refused.status_code == 422, refused.text
                (problem,) = refused.json()["detail"]
                assert problem["msg"].startswith(f"queues.{queue}.autoscale.overflow.backends:"), problem
                assert "offload.yaml" in problem["msg"] and "\n" not in problem["msg"]
