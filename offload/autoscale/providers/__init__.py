"""Machine providers: one module each. `build` turns a stored (decrypted) provider record into an adapter."""

from __future__ import annotations

import time
from typing import Any

from pydantic import ValidationError

from offload.autoscale.providers.base import (
    LABEL_PREFIX,
    Clock,
    LaunchSpec,
    Machine,
    MachineState,
    NotOurs,
    OutOfCapacity,
    Provider,
    ProviderConfig,
    ProviderError,
    Unauthorized,
    is_ours,
)
from offload.autoscale.providers.local import LocalProvider
from offload.autoscale.providers.mock import MockProvider
from offload.autoscale.providers.runpod import RunPodProvider
from offload.autoscale.providers.vastai import VastProvider
from offload.errors import ConfigError

TYPES: dict[str, type[Provider]] = {
    "mock": MockProvider, "local": LocalProvider, "runpod": RunPodProvider, "vastai": VastProvider,
}

__all__ = [
    "LABEL_PREFIX", "TYPES", "LaunchSpec", "Machine", "MachineState", "NotOurs", "OutOfCapacity", "Provider",
    "ProviderError", "Unauthorized", "build", "is_ours", "validate_config",
]


def validate_config(kind: str, config: dict[str, Any]) -> ProviderConfig:
    cls = TYPES.get(kind)
    if cls is None:
        raise ConfigError(f"type: unknown provider type {kind!r}; choose one of: {', '.join(TYPES)}")
    try:
        parsed: ProviderConfig = cls.Config.model_validate(config)
        return parsed
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"config.{where}: {first['msg']}") from None


def build(name: str, kind: str, config: dict[str, Any], redis: Any, clock: Clock = time.time) -> Provider:
    parsed = validate_config(kind, config)
    if kind == "mock":
        return MockProvider(name, parsed, redis, clock)  # type: ignore[arg-type]
    if kind == "local":
        return LocalProvider(name, parsed, redis, clock)  # type: ignore[arg-type]
    if kind == "runpod":
        return RunPodProvider(name, parsed)  # type: ignore[arg-type]
    return VastProvider(name, parsed)  # type: ignore[arg-type]
