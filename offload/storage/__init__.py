"""Object storage for job results: S3-compatible or a local directory, behind one small async protocol.

`create_storage(settings)` takes the typed `storage:` block of offload.yaml (offload.storage.settings, as
offload.config validated it); a plain mapping is validated by the same model first. boto3 (the `s3` extra) is
imported only when an S3 store is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from offload.extras import require
from offload.schema import parse
from offload.storage.base import (
    ClockRefused,
    InvalidKey,
    ObjectInfo,
    ObjectNotFound,
    Put,
    Storage,
    StorageConfigError,
    StorageError,
    validate_key,
)
from offload.storage.local import LocalStorage
from offload.storage.outputs import CopiedFile, StoredOutput, files_prefix, store_output
from offload.storage.settings import (
    DEFAULT_LOCAL_PATH,
    LocalStorageSettings,
    S3StorageSettings,
    StorageSettings,
)

__all__ = [
    "DEFAULT_LOCAL_PATH",
    "ClockRefused",
    "CopiedFile",
    "InvalidKey",
    "LocalStorage",
    "LocalStorageSettings",
    "ObjectInfo",
    "ObjectNotFound",
    "Put",
    "S3StorageSettings",
    "Storage",
    "StorageConfigError",
    "StorageError",
    "StorageSettings",
    "StoredOutput",
    "create_storage",
    "files_prefix",
    "store_output",
    "validate_key",
]


def create_storage(settings: LocalStorageSettings | S3StorageSettings | Mapping[str, Any]) -> Storage:
    """Build the configured store from its typed settings. A mapping (a programmatic caller's) is validated by the
    same model first, naming the offending `storage.<field>` in a ConfigError."""
    if isinstance(settings, Mapping):
        settings = parse(StorageSettings, dict(settings), "storage")
    if isinstance(settings, LocalStorageSettings):
        return LocalStorage(settings.path, prefix=settings.prefix)
    require("s3", "boto3", "S3 result storage (storage.kind: s3)")
    from offload.storage.s3 import S3Storage

    return S3Storage(settings)
