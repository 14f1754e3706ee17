"""Fidelity: the official SDKs (runpod, replicate, fal-client, openai) run against the simulator through their
base-URL settings: submit, poll to completion, read output, cancel. If an SDK accepts the simulator, adapters
tested against the simulator are tested against the wire format the SDK was built for.

Each SDK is imported with `pytest.importorskip` only as a guard; the dev extras install them. RunPod and fal read
their base URL/host at import time, so they run in a fresh interpreter (`sim_sdk_check.py`). fal's SDK only
speaks https, so its simulator serves TLS with a throwaway self-signed certificate trusted via SSL_CERT_FILE.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import sim_sdk_check

from bench import web
from offload.testing.sim import SimConfig, running_sim

CHECK = Path(__file__).parents[1] / "support" / "sim_sdk_check.py"
CONFIG = SimConfig.model_validate({"seed": 11, "default": {"latency": 0.3, "queue_delay": 0.1}})


def _run_check(name: str, env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(CHECK), name], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _submissions(base: str, cafile: str | None = None) -> dict[str, int]:
    verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=cafile) if cafile else True
    counts: dict[str, int] = web.get(f"{base}/_sim/stats", verify=verify).json()["submissions_by_input_id"]
    return counts


@pytest.fixture(scope="module")
def tls_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 (CA and leaf in one, so it can be its own trust root)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "2",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,digitalSignature,keyCertSign",
            "-addext",
            "extendedKeyUsage=serverAuth",
        ],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)


def test_runpod_sdk() -> None:
    pytest.importorskip("runpod")
    with running_sim(CONFIG) as base:
        out = _run_check("runpod", {"RUNPOD_ENDPOINT_BASE_URL": f"{base}/v2"})
        assert out["status"] == "COMPLETED"
        assert out["output"]["echo"] == {"id": "rp-1", "prompt": "a haiku"}
        assert out["sync_output"]["echo"] == {"id": "rp-2"}
        assert out["cancelled"]["status"] == "CANCELLED" and out["cancel_status"] == "CANCELLED"
        assert out["health"]["jobs"]["completed"] == 2
        assert _submissions(base) == {"rp-1": 1, "rp-2": 1, "rp-3": 1}


def test_replicate_sdk() -> None:
    pytest.importorskip("replicate")
    with running_sim(CONFIG) as base:
        out = sim_sdk_check.check_replicate(base)
        assert out["status"] == "succeeded" and out["output"]["echo"] == {"id": "rep-1", "prompt": "a cat"}
        assert out["metrics"]["predict_time"] == pytest.approx(0.3)
        assert out["urls"]["get"].startswith(base)
        assert out["run_output"]["echo"] == {"id": "rep-2"}  # replicate.run: Prefer: wait, then the output
        assert out["cancel_status"] == "canceled"
        assert len(out["listed"]) == 3
        assert out["missing"] == {
            "status": 404,
            "title": "Not found",
            "detail": "The requested resource could not be found.",
        }
        assert _submissions(base) == {"rep-1": 1, "rep-2": 1, "rep-3": 1}


def test_fal_sdk(tls_cert: tuple[str, str]) -> None:
    pytest.importorskip("fal_client")
    cert, key = tls_cert
    with running_sim(CONFIG, ssl_certfile=cert, ssl_keyfile=key) as base:
        assert base.startswith("https://")
        out = _run_check(
            "fal", {"FAL_QUEUE_RUN_HOST": base.removeprefix("https://"), "SSL_CERT_FILE": cert, "FAL_KEY": "sim-key"}
        )
        assert out["status_url"] == f"{base}/fal-ai/flux/requests/{out['request_id']}/status"
        assert out["events"][0] == "Queued" and out["events"][-1] == "Completed" and "InProgress" in out["events"]
        assert out["result"]["echo"] == {"id": "fal-1", "prompt": "a lighthouse"}
        assert out["rebuilt_status"] == "Completed" and out["rebuilt_result"] == out["result"]
        assert out["cancel_status"] == "Completed" and out["cancel_error"] == "Request was cancelled"
        assert _submissions(base, cert) == {"fal-1": 1, "fal-2": 1}


def test_openai_sdk() -> None:
    pytest.importorskip("openai")
    with running_sim(CONFIG) as base:
        out = sim_sdk_check.check_openai(base)
        assert out["object"] == "chat.completion" and out["finish_reason"] == "stop"
        assert out["content"]["echo"]["messages"] == [{"role": "user", "content": "hello"}]
        assert out["usage"]["total_tokens"] > 0
        web.post(f"{base}/_sim/config?merge=true", json={"default": {"rate_429": 1.0}}).raise_for_status()
        throttled = sim_sdk_check.check_openai_throttled(base)
        assert throttled == {"status": 429, "code": "rate_limit_exceeded", "type": "requests", "retry_after": "1"}
        assert _submissions(base) == {"oai-1": 1}
