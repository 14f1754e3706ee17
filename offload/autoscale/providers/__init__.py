"""Machine providers: one module each. `build` turns a stored (decrypted) provider record into an adapter."""

from __future__ import annotations

import time
import types
import typing
from typing import Any, Literal

from offload.autoscale.providers.base import (
    LABEL_PREFIX,
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
from offload.autoscale.providers.local import LocalConfig, LocalProvider
from offload.autoscale.providers.mock import MockConfig, MockProvider
from offload.autoscale.providers.runpod import RunPodConfig, RunPodProvider
from offload.autoscale.providers.vastai import VastConfig, VastProvider
from offload.clock import Clock
from offload.errors import ConfigError
from offload.redis_client import RedisClient
from offload.schema import parse

TYPES: dict[str, type[Provider]] = {
    "mock": MockProvider,
    "local": LocalProvider,
    "runpod": RunPodProvider,
    "vastai": VastProvider,
}

__all__ = [
    "HOST_TYPES",
    "LABEL_PREFIX",
    "TYPES",
    "LaunchSpec",
    "Machine",
    "MachineState",
    "NotOurs",
    "OutOfCapacity",
    "Provider",
    "ProviderError",
    "Unauthorized",
    "build",
    "describe",
    "is_ours",
    "validate_config",
]
HOST_TYPES = ("local",)  # types whose machines are processes on the control-plane host: operator-only


def _kind(annotation: Any) -> tuple[str, list[Any] | None]:
    """How a form shows a setting: text, number, bool, choice (with its choices) or json (lists, objects)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _kind(args[0])
    if origin is Literal:
        return "choice", list(typing.get_args(annotation))
    if annotation is bool:
        return "bool", None
    if annotation in (int, float):
        return "number", None
    if annotation is str:
        return "text", None
    return "json", None


def describe(kind: str) -> dict[str, Any]:
    """A provider type's settings for a form (the dashboard builds its provider forms from this): name, kind,
    required, default, description, whether it is a secret (masked, kept when not retyped)."""
    cls = TYPES[kind]
    fields = []
    for name, info in cls.Config.model_fields.items():
        form, choices = _kind(info.annotation)
        secret = name in cls.secret_fields
        default = None if info.is_required() or info.default_factory is not None else info.default
        if info.default_factory is not None:
            default = info.default_factory()  # type: ignore[call-arg]
        fields.append(
            {
                "name": name,
                "kind": "secret" if secret else form,
                "choices": choices,
                "required": info.is_required(),
                "default": default,
                "description": info.description or "",
            }
        )
    return {"type": kind, "operator_only": kind in HOST_TYPES, "fields": fields}


def validate_config(kind: str, config: dict[str, Any]) -> ProviderConfig:
    cls = TYPES.get(kind)
    if cls is None:
        raise ConfigError(f"type: unknown provider type {kind!r}; choose one of: {', '.join(TYPES)}")
    parsed: ProviderConfig = parse(cls.Config, config, "config")
    return parsed


def build(name: str, kind: str, config: dict[str, Any], redis: RedisClient, clock: Clock = time.time) -> Provider:
    """The adapter for a stored provider record: its config (decrypted from Redis, so read like any input) is
    validated once by the type's model and handed to the adapter as that typed object."""
    parsed = validate_config(kind, config)
    if isinstance(parsed, MockConfig):
        return MockProvider(name, parsed, redis, clock)
    if isinstance(parsed, LocalConfig):
        return LocalProvider(name, parsed, redis, clock)
    if isinstance(parsed, RunPodConfig):
        return RunPodProvider(name, parsed)
    if isinstance(parsed, VastConfig):
        return VastProvider(name, parsed)
    raise ConfigError(f"type: provider type {kind!r} has no adapter")  # TYPES and this list disagree: a bug
