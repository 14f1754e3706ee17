"""The top-level `alerts:` block of offload.yaml: where alerts go (webhooks, email) and when they fire.

Only the settings: offload.config composes them without running the alerter (offload/autoscale/alerts.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from offload.autoscale.settings import Duration
from offload.schema import Strict, parse

AlertKind = Literal[
    "autoscale_failure",
    "boot_timeout",
    "spend_cap_reached",
    "dead_letter_growth",
    "queue_latency",
    "file_sweep",
    "store_memory",
    "eviction_policy",
]


class WebhookTarget(Strict):
    url: str
    headers: dict[str, str] = Field(default_factory=dict)
    kinds: list[AlertKind] | None = None


class EmailTarget(Strict):
    host: str
    port: int = 25
    from_addr: str
    to: list[str] = Field(..., min_length=1)
    username: str | None = None
    password: str | None = Field(None, repr=False)
    starttls: bool = False
    kinds: list[AlertKind] | None = None


class AlertSettings(Strict):
    webhooks: list[WebhookTarget] = Field(default_factory=list)
    email: EmailTarget | None = None
    cooldown: Duration = Field(900.0, ge=0)
    attempts: int = Field(
        4, ge=1, le=10, description="delivery tries per alert and target; the waits double from 0.2 s, at most 5 s"
    )
    dead_letter_growth: int | None = Field(None, ge=1, description="dead jobs added within the window")
    dead_letter_window: Duration = Field(600.0, gt=0)
    queue_latency: Duration | None = Field(None, gt=0, description="oldest ready job older than this")
    store_memory: float | None = Field(
        0.9, gt=0, le=1, description="the job store's used memory past this share of its maxmemory (null: off)"
    )


def alert_settings(data: AlertSettings | Mapping[str, Any] | None) -> AlertSettings:
    """The typed `alerts:` block as offload.config validated it; a mapping (a test's, a caller's) is validated."""
    if isinstance(data, AlertSettings):
        return data
    parsed: AlertSettings = parse(AlertSettings, data or {}, "alerts")
    return parsed
