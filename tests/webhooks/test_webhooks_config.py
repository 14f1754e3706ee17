"""Webhook settings: validated at start naming the field, the URL each backend is told to call, the grace's
defaults, and the secret never leaving the job record, the access log or an error excerpt."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from offload.config import load_settings
from offload.errors import ConfigError
from offload.redact import redact
from offload.server.runner import _HookPathFilter

BASE = """
backends:
  rep: {kind: replicate, version: v, webhook_secret: whsec_c2VjcmV0c2VjcmV0}
  rp: {kind: runpod, endpoint_id: e}
  job: {kind: http-job, base_url: http://x}
queues:
  a: {backend: rep}
"""


def load(tmp_path: Path, text: str, **env: str) -> object:
    path = tmp_path / "offload.yaml"
    path.write_text(text)
    return load_settings(path, env=env)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("server: {public_url: ftp://x}\n", "server.public_url"),
        ("server: {public_url: 'http://x/a?b=1'}\n", "server.public_url"),
        ("backends: {rep: {kind: replicate, version: v, webhook_secret: nope}}\n", "backends.rep.webhook_secret"),
        ("backends: {f: {kind: fal, app: a/b, webhook_jwks_url: jwks.json}}\n", "backends.f.webhook_jwks_url"),
        ("backends: {f: {kind: fal, app: a/b, webhook_grace_s: -1}}\n", "backends.f.webhook_grace_s"),
        ("backends: {f: {kind: fal, app: a/b, webhook_poll_interval_s: 0}}\n", "backends.f.webhook_poll_interval_s"),
        ("server: {public_url: 'https://q.example'}\nbackends: {r: {kind: replicate, version: v}}\n",
         "backends.r.webhook_secret"),
    ],
)  # fmt: skip
def test_bad_webhook_settings_fail_at_start_naming_the_field(tmp_path: Path, text: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load(tmp_path, text)


def test_hook_urls_and_grace_follow_the_public_url(tmp_path: Path) -> None:
    off = load(tmp_path, BASE)
    assert off.hook_base("rep") is None and off.hook_grace_s("rep") == 0.0  # type: ignore[attr-defined]
    on = load(tmp_path, BASE, OFFLOAD_SERVER_PUBLIC_URL="https://q.example/")
    assert on.hook_base("rep") == "https://q.example/v1/hooks/rep"  # type: ignore[attr-defined]
    assert on.hook_grace_s("rep") == 10.0 and on.hook_grace_s("rp") == 10.0  # type: ignore[attr-defined]
    assert on.hook_base("job") is None and on.hook_grace_s("job") == 0.0  # type: ignore[attr-defined]
    # the autoscaler's OFFLOAD_PUBLIC_URL (for rented machines) does not turn webhooks on by itself
    assert load(tmp_path, BASE, OFFLOAD_PUBLIC_URL="https://q.example").hook_base("rep") is None  # type: ignore[attr-defined]
    # webhook settings never reach the provider (only the HTTP options and the kind's own do)
    assert "webhook_secret" not in on.backends["rep"].http()  # type: ignore[attr-defined]


def test_the_url_secret_is_redacted_from_logs_and_excerpts() -> None:
    path = "/v1/hooks/rep/q%3A0192ab/1/Zm9vYmFyYmF6cXV4X3NlY3JldA"
    assert "Zm9vYmFy" not in redact(f"POST https://q.example{path} failed")
    record = logging.LogRecord(
        "uvicorn.access", logging.INFO, "", 0, '%s - "%s %s" %d', ("1.2.3.4", "POST", path, 200), None
    )
    assert _HookPathFilter().filter(record)
    assert "Zm9vYmFy" not in record.getMessage() and "/v1/hooks/rep/q%3A0192ab/1/" in record.getMessage()
