"""Reading one backend's settings from the config mapping, with errors that name the offending field.

Every read is remembered, so after a backend has taken what it needs, anything left over is reported as unknown:
a typo such as `endpoint_Id` would otherwise be ignored and the backend would run with a default nobody chose.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from offload.backends.http import DEFAULT_MAX_CONNECTIONS, DEFAULT_TIMEOUT
from offload.errors import ConfigError


class Settings:
    """Typed accessors over `backends.<name>`; each raises ConfigError naming `backends.<name>.<key>`."""

    def __init__(self, kind: str, name: str, values: Mapping[str, Any]) -> None:
        if not isinstance(values, Mapping):
            raise ConfigError(f"backends.{name} must be a mapping of settings, not {type(values).__name__}")
        self.kind = kind
        self.name = name
        self._values = dict(values)
        self._used: set[str] = {"kind"}  # the config file may keep the kind next to the settings

    def where(self, key: str) -> str:
        return f"backends.{self.name}.{key}"

    def _get(self, key: str) -> Any:
        self._used.add(key)
        return self._values.get(key)

    def text(self, key: str, default: str | None = None) -> str | None:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{self.where(key)} must be a non-empty string (is its environment variable set?)")
        return value.strip()

    def need(self, key: str) -> str:
        value = self.text(key)
        if value is None:
            raise ConfigError(f"{self.where(key)} is required for kind {self.kind}")
        return value

    def url(self, key: str, default: str | None = None) -> str | None:
        value = self.text(key, default)
        if value is not None and not value.startswith(("http://", "https://")):
            raise ConfigError(f"{self.where(key)} must be an http:// or https:// URL, got {value!r}")
        return value.rstrip("/") if value is not None else None

    def number(self, key: str, default: float | None) -> float | None:
        value = self._get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ConfigError(f"{self.where(key)} must be a non-negative number, got {value!r}")
        return float(value)

    def positive(self, key: str, default: float) -> float:
        value = self.number(key, default)
        if value is None or value <= 0:
            raise ConfigError(f"{self.where(key)} must be a positive number, got {value!r}")
        return value

    def integer(self, key: str, default: int, minimum: int = 1) -> int:
        value = self._get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{self.where(key)} must be an integer >= {minimum}, got {value!r}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ConfigError(f"{self.where(key)} must be true or false, got {value!r}")
        return value

    def mapping(self, key: str) -> dict[str, Any] | None:
        value = self._get(key)
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise ConfigError(f"{self.where(key)} must be a mapping, got {type(value).__name__}")
        return dict(value)

    def common(self, *, default_base: str | None, default_timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
        """`base_url`, `api_key`, `timeout` and `max_connections`: the keyword arguments of HttpBackend."""
        base_url = self.url("base_url", default_base)
        if base_url is None:
            raise ConfigError(f"{self.where('base_url')} is required for kind {self.kind}")
        return {
            "base_url": base_url,
            "api_key": self.text("api_key"),
            "timeout": self.positive("timeout", default_timeout),
            "max_connections": self.integer("max_connections", DEFAULT_MAX_CONNECTIONS),
        }

    def finish(self) -> None:
        """Raise for the first setting nobody read. A None value counts as unset (a model dump of optional
        fields), so only settings someone actually gave are reported."""
        unknown = sorted(k for k, v in self._values.items() if k not in self._used and v is not None)
        if unknown:
            known = ", ".join(sorted(self._used - {"kind"}))
            raise ConfigError(f"{self.where(unknown[0])} is not a setting of kind {self.kind} (known: {known})")
