"""callback_url through the Python client and the CLI: kept on the job record (where the server's sender reads
it), a malformed one refused before anything reaches the store, in one error line."""

from __future__ import annotations

import pytest
from test_cli import as_json, cli, failed, ok, with_store

from offload import Client, InvalidJob

HOOK = "https://hooks.example.com/offload?job=1"


def test_the_client_keeps_a_jobs_callback_url_and_refuses_a_malformed_one(valkey_url: str) -> None:
    with Client(valkey_url) as client:
        job = client.get(client.enqueue("cbq", 1, callback_url=HOOK))
        (bulk,) = client.enqueue_many("cbq", [{"input": 2, "callback_url": HOOK}])
        with pytest.raises(InvalidJob, match=r"^callback_url must be an http:// or https:// URL, got scheme 'file'"):
            client.enqueue("cbq", 3, callback_url="file:///etc/passwd")
        assert job.callback_url == HOOK and client.get(bulk).callback_url == HOOK
        assert client.get(client.enqueue("cbq", 4)).callback_url is None
        assert client.stats("cbq").counts["queued"] == 3


def test_the_cli_takes_a_callback_url(valkey_url: str) -> None:
    job_id = ok(valkey_url, "enqueue", "-q", "cbq", "-i", "1", "--callback-url", HOOK).strip()
    assert as_json(valkey_url, "status", job_id)["callback_url"] == HOOK
    err = failed(cli(valkey_url, "enqueue", "-q", "cbq", "-i", "1", "--callback-url", "https://u:p@h.example/x"))
    assert err.strip() == "error: callback_url must not carry credentials (user:password@)"
    assert with_store(valkey_url, lambda s: s.stats("cbq")).counts["queued"] == 1  # the refused one added nothing
