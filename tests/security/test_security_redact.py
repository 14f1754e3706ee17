"""One redaction path (for URLs and for error excerpts): URLs are masked in every form, and a
backend's error keeps no userinfo, no redirect target's query, no JSON token field; the same function serves
the backends, the providers, the Redis connection errors and the autoscaler's journal."""

from __future__ import annotations

import httpx
import pytest

from offload.backends.http import error_for_exception, error_for_response
from offload.connection import mask_url
from offload.redact import excerpt


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("redis://user:pw@host:6379/0", "redis://user:***@host:6379/0"),
        ("redis://:pw@host/0", "redis://:***@host/0"),
        ("redis://host:6379", "redis://host:6379"),
        ("redis://default:p@ss@w0rd@cache:6379/0", "redis://default:***@cache:6379/0"),  # '@' inside the password
        ("redis://cache:6379/0?password=hunter2&db=1", "redis://cache:6379/0?password=***&db=1"),
        ("https://ghp_TOKEN123@github.com/org/repo", "https://***@github.com/org/repo"),
        (
            "https://s3/b/k?X-Amz-Credential=AKIA1%2F2&X-Amz-Signature=abc&x=1",
            "https://s3/b/k?X-Amz-Credential=***&X-Amz-Signature=***&x=1",
        ),
        ("https://h/p?sig=abc&api_key=k&token=t", "https://h/p?sig=***&api_key=***&token=***"),
    ],
)
def test_mask_url_handles_every_form(url: str, masked: str) -> None:
    assert mask_url(url) == masked


def test_backend_errors_keep_no_credentials() -> None:
    what = "http-job backend 'gpu': POST https://gpu.example.com/jobs"
    body = (
        '{"error": "bad", "token": "tok-0123456789", "api_key": "k-0123456789", "authorization": "Basic xyz",'
        ' "echo": "https://user:pass-0123@gpu.example.com/jobs"}'
    )
    err = error_for_response(httpx.Response(400, text=body), what=what, secrets=["sk-live-0123456789"])
    for leaked in ("tok-0123456789", "k-0123456789", "Basic xyz", "pass-0123"):
        assert leaked not in str(err) and leaked not in err.excerpt, leaked
    moved = httpx.Response(302, headers={"Location": "https://login.example.com/sso?session=abc123&next=x"})
    err = error_for_response(moved, what=what)
    assert "abc123" not in str(err) and "https://login.example.com/sso" in str(err)
    exc = httpx.ConnectError("cannot connect to https://admin:hunter2-0123@gpu.example.com:8443/v1")
    assert "hunter2-0123" not in str(error_for_exception(exc, what=what))


def test_secrets_of_the_configuration_are_redacted_in_any_shape() -> None:
    from offload.redact import Redactor, redact

    key = "id-0123:sec-ret/456+7"  # fal's id:secret form, with characters that get percent-encoded
    text = f"echo {key} / {key.split(':')[1]} / id-0123%3Asec-ret%2F456%2B7"
    assert "sec-ret" not in redact(text, [key]) and "456" not in excerpt(text, [key])
    scrub = Redactor(["hf-token-0123456789"])
    scrub.add(None, "worker-key-0123456789")
    assert scrub("HF_TOKEN hf-token-0123456789 and worker-key-0123456789") == "HF_TOKEN [REDACTED] and [REDACTED]"
