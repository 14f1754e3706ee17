"""Object storage for job results: S3-compatible or a local directory, behind one small async protocol.

`create_storage(settings)` takes the `storage:` block of offload.yaml (a plain mapping, or a pydantic model's
`model_dump()`: `SecretStr` values are accepted) and names the offending setting in any `ConfigError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from offload.errors import ConfigError
from offload.storage.base import (
    InvalidKey,
    ObjectInfo,
    ObjectNotFound,
    Storage,
    StorageConfigError,
    StorageError,
    validate_key,
)
from offload.storage.local import LocalStorage
from offload.storage.outputs import CopiedFile, StoredOutput, files_prefix, store_output
from offload.storage.s3 import DEFAULT_THREADS, S3Settings, S3Storage

__all__ = [
    "CopiedFile",
    "InvalidKey",
    "LocalStorage",
    "ObjectInfo",
    "ObjectNotFound",
    "S3Settings",
    "S3Storage",
    "Storage",
    "StorageConfigError",
    "StorageError",
    "StoredOutput",
    "create_storage",
    "files_prefix",
    "store_output",
    "validate_key",
]

DEFAULT_LOCAL_PATH = ".offload/results"
_S3_KEYS = {
    "bucket",
    "endpoint_url",
    "prefix",
    "region",
    "access_key_id",
    "secret_access_key",
    "addressing_style",
    "max_threads",
    "connect_timeout",
    "read_timeout",
    "max_attempts",
}
_LOCAL_KEYS = {"path", "prefix"}
# Settings of the storage block that belong to store_output, not to the store itself: accepted, ignored here.
_OUTPUT_KEYS = {
    "kind", "copy_files", "allow_hosts", "max_file_bytes", "max_files", "file_timeout_s",
    "max_input_file_bytes", "input_url_expires_s", "upload_grace_s", "sweep_interval_s",
}  # fmt: skip


def create_storage(settings: Mapping[str, Any]) -> Storage:
    """Build the configured backend. Unset (`None`) values fall back to defaults; unknown keys are errors, since
    a misspelt `endpoint_ulr` would otherwise silently send results to AWS."""
    unknown = set(settings) - _S3_KEYS - _LOCAL_KEYS - _OUTPUT_KEYS
    if unknown:
        raise ConfigError(f"storage.{sorted(unknown)[0]}: unknown setting")
    values = {k: _reveal(v) for k, v in settings.items() if v is not None}
    kind = values.get("kind", "local")
    if kind == "local":
        path = values.get("path") or DEFAULT_LOCAL_PATH
        if not isinstance(path, str):
            raise ConfigError("storage.path: must be a directory path")
        return LocalStorage(path, prefix=_text(values, "prefix"))
    if kind != "s3":
        raise ConfigError(f"storage.kind: must be 's3' or 'local', got {kind!r}")
    if not values.get("bucket"):
        raise ConfigError("storage.bucket: required when storage.kind is s3")
    style = values.get("addressing_style", "path")
    if style not in ("path", "virtual", "auto"):
        raise ConfigError(f"storage.addressing_style: must be path, virtual or auto, got {style!r}")
    s3 = S3Settings(
        bucket=_text(values, "bucket"),
        endpoint_url=values.get("endpoint_url") or None,
        prefix=_text(values, "prefix"),
        region=_text(values, "region") or "us-east-1",
        access_key_id=values.get("access_key_id") or None,
        secret_access_key=values.get("secret_access_key") or None,
        addressing_style=style,
        max_threads=_number(values, "max_threads", DEFAULT_THREADS, int),
        connect_timeout=_number(values, "connect_timeout", 5.0, float),
        read_timeout=_number(values, "read_timeout", 60.0, float),
        max_attempts=_number(values, "max_attempts", 3, int),
    )
    return S3Storage(s3)


def _reveal(value: Any) -> Any:
    """pydantic's SecretStr (what offload.config holds secrets in) without importing pydantic here."""
    getter = getattr(value, "get_secret_value", None)
    return getter() if callable(getter) else value


def _text(values: Mapping[str, Any], name: str) -> str:
    value = values.get(name, "")
    if not isinstance(value, str):
        raise ConfigError(f"storage.{name}: must be a string")
    return value


def _number(values: Mapping[str, Any], name: str, default: float, kind: type[Any]) -> Any:
    value = values.get(name, default)
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"storage.{name}: must be a number, got {value!r}") from None
    if number <= 0:
        raise ConfigError(f"storage.{name}: must be positive")
    return number
