"""offload.yaml's `callbacks:` block: where completion webhooks may go and how hard the server tries.

A callback URL is the producer's choice, so it is held to the operator's list of hosts (`hosts`, exact names or
`.suffix` entries) and to offload.egress at every connect (public addresses only, unless `allow_private_hosts`):
one rule for every outbound request someone else named. An empty list allows no callback at all.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import Field, model_validator

from offload.egress import FilePolicy, url_problem
from offload.schema import NonEmpty, Strict

DAY_S = 86_400


class CallbackSettings(Strict):
    hosts: list[NonEmpty] = Field(
        default_factory=list,
        description="the only hosts a callback_url may name: exact host names, or `.example.com` for its subdomains",
    )
    allow_private_hosts: bool = Field(
        False, description="also loopback and private addresses (a receiver on the same network)"
    )
    max_tries: int = Field(8, ge=1, le=100, description="tries of one webhook before it is dead-lettered")
    backoff_s: float = Field(5.0, gt=0, description="the wait before the first retry; it doubles each try")
    backoff_cap_s: float = Field(3600.0, gt=0, description="the longest wait between two tries")
    timeout_s: float = Field(10.0, gt=0, le=120, description="seconds one POST may take")
    claim_s: float = Field(60.0, gt=0, description="how long a server owns a webhook it sends (more than timeout_s)")
    poll_s: float = Field(1.0, gt=0, le=60, description="how often each server looks for webhooks due")
    rotation_grace_s: int = Field(
        DAY_S, ge=0, description="how long the old secret still signs after a rotation (the default of the API's)"
    )

    @model_validator(mode="after")
    def _claim_outlasts_a_post(self) -> CallbackSettings:
        if self.claim_s <= self.timeout_s:
            raise ValueError(f"claim_s ({self.claim_s:g}) must be more than timeout_s ({self.timeout_s:g})")
        return self

    def policy(self) -> FilePolicy:
        """offload.egress's rule for every webhook POST: the listed hosts, at the allowed reach."""
        return FilePolicy.of(allow_private=self.allow_private_hosts, hosts=self.hosts)

    def problem(self, url: object) -> str | None:
        """Why `url` may not be a callback URL here (the words after `callback_url`); None when it may."""
        if (problem := url_problem(url)) is not None:
            return problem
        host = urlsplit(str(url)).hostname or ""
        if not self.policy().listed(host):
            allowed = ", ".join(self.hosts) if self.hosts else "none configured"
            return f"names host {host!r}, which callbacks.hosts does not allow (allowed: {allowed})"
        return None
