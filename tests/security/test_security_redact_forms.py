"""Issue 35's redaction suspicion: a secret, or an offload webhook URL's secret, escaped redaction once it was
percent-encoded (fal carries the webhook URL in a query string), JSON-escaped (`\\/`, `\\u00xx`) or base64-encoded.
Each form goes through the three ways text leaves a process: a job's error (a backend's error excerpt), an
autoscaler event (the scaler's Redactor) and a log line (the server's access-log filter)."""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Callable
from urllib.parse import quote, quote_plus

import httpx
import pytest

from offload.backends.http import error_for_response
from offload.redact import REDACTED, Redactor
from offload.server.runner import _HookPathFilter

SECRET = "k3y/with+special:chars=x&y~1"  # characters every encoding changes, an `id:secret` pair as fal's
HOOK_SECRET = "Zm9vYmFyYmF6cXV4X3NlY3JldA"  # secrets.token_urlsafe's alphabet
HOOK_URL = f"https://q.example/v1/hooks/falapp/{quote('q:0192ab', safe='')}/1/{HOOK_SECRET}"


def _json_u(text: str, upper: bool = False) -> str:
    return "".join(c if c.isalnum() else (f"\\u{ord(c):04X}" if upper else f"\\u{ord(c):04x}") for c in text)


FORMS: dict[str, Callable[[str], str]] = {
    "plain": lambda s: s,
    "percent": lambda s: quote(s, safe=""),
    "percent-keep-slash": quote,
    "percent-lower-hex": lambda s: quote(s, safe="").lower(),
    "form-encoded": quote_plus,
    "percent-twice": lambda s: quote(quote(s, safe=""), safe=""),
    "json-slash": lambda s: json.dumps(s)[1:-1].replace("/", "\\/"),
    "json-u-lower": _json_u,
    "json-u-upper": lambda s: _json_u(s, upper=True),
    "base64": lambda s: base64.b64encode(s.encode()).decode(),
    "base64-url-unpadded": lambda s: base64.urlsafe_b64encode(s.encode()).decode().rstrip("="),
}


def _leaks(text: str, form: str, secret: str) -> bool:
    return form in text or secret in text


def _job_error(echoed: str) -> str:
    """What a job's error says when the provider's error body echoes `echoed` (the backend's excerpt)."""
    body = '{"detail": "invalid request: ' + echoed + ' rejected"}'  # the form as the provider's JSON has it
    error = error_for_response(httpx.Response(422, text=body), what="fal backend 'falapp': POST", secrets=[SECRET])
    return str(error)


def _access_log(path: str) -> str:
    record = logging.LogRecord(
        "uvicorn.access", logging.INFO, "", 0, '%s - "%s %s" %d', ("1.2.3.4", "GET", path, 404), None
    )
    assert _HookPathFilter().filter(record)
    return record.getMessage()


@pytest.mark.parametrize("name", sorted(FORMS))
def test_a_registered_secret_in_any_form_leaves_no_job_error_or_event(name: str) -> None:
    form = FORMS[name](SECRET)
    assert form == SECRET or form != SECRET.replace(":", "")  # (the form differs where it should)
    error = _job_error(form)
    assert not _leaks(error, form, SECRET) and REDACTED in error, error
    event = Redactor([SECRET])(f"renting failed: the provider answered '{form}'")
    assert not _leaks(event, form, SECRET) and REDACTED in event, event
    for half in SECRET.split(":"):  # each half of an `id:secret` pair is a secret of its own
        alone = FORMS[name](half)
        assert not _leaks(Redactor([SECRET])(f"echo {alone} end"), alone, half)


@pytest.mark.parametrize("name", sorted(n for n in FORMS if not n.startswith("base64")))
def test_a_webhook_urls_secret_in_any_form_leaves_no_log_job_error_or_event(name: str) -> None:
    """fal's `?fal_webhook=` carries the URL percent-encoded (its job id, `%3A` already, encoded again); a JSON
    error body may escape its slashes. The path up to the secret stays readable."""
    form = FORMS[name](HOOK_URL)
    log_line = _access_log(f"/v1/nothing?fal_webhook={form}&x=1")
    error = _job_error(f"https://queue.fal.run/fal-ai/flux?fal_webhook={form}")
    event = Redactor()(f"submit failed for {form}")
    for text in (log_line, error, event):
        assert HOOK_SECRET not in text and REDACTED in text, text
        assert "hooks" in text  # only the secret went
