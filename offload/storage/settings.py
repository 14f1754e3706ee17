"""The `storage:` block of offload.yaml, one model per kind, discriminated by `kind` (default `local`).

Every storage rule lives here (the bucket is required for s3, keys come in pairs, the pool and timeouts are
positive), checked once when offload.yaml is read; `create_storage` builds the store from the typed model. No
boto3 here: a producer that never stores a result reads its config without the `s3` extra.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import Discriminator, Field, SecretStr, Tag, field_validator, model_validator

from offload.files import DEFAULT_MAX_FILE_BYTES
from offload.schema import NonEmpty, Strict, http_url

DEFAULT_LOCAL_PATH = ".offload/results"
DEFAULT_THREADS = 16
DEFAULT_MAX_FILES_PER_JOB = 100
DEFAULT_MAX_UPLOAD_BYTES_PER_JOB = 10 * DEFAULT_MAX_FILE_BYTES


class _FileSettings(Strict):
    """Files by reference (offload.storage.inputs): the largest File() a job may carry; the most distinct files
    one job's input (or a GPU worker's output) may refer to and one job id may be issued HTTP uploads for; the
    bytes of HTTP uploads one job id may be issued; the life of the presigned GET a provider gets for an input
    file; how old an uploaded file no job refers to must be before the server's sweep removes it; seconds between
    sweeps."""

    max_input_file_bytes: Annotated[int, Field(ge=1)] = DEFAULT_MAX_FILE_BYTES
    max_files_per_job: Annotated[int, Field(ge=1, le=100_000)] = DEFAULT_MAX_FILES_PER_JOB
    max_upload_bytes_per_job: Annotated[int, Field(ge=1)] = DEFAULT_MAX_UPLOAD_BYTES_PER_JOB
    input_url_expires_s: Annotated[int, Field(ge=60, le=7 * 86_400)] = 86_400
    upload_grace_s: Annotated[float, Field(gt=0)] = 3600.0
    sweep_interval_s: Annotated[float, Field(gt=0)] = 600.0


class LocalStorageSettings(_FileSettings):
    """Results as files under `path` (development, a single machine)."""

    kind: Literal["local"] = "local"
    path: NonEmpty = DEFAULT_LOCAL_PATH
    prefix: str = ""
    copy_files: bool = True


class S3StorageSettings(_FileSettings):
    """An S3-compatible bucket. No access key means boto3's default chain (env vars, profile, instance role)."""

    kind: Literal["s3"] = "s3"
    bucket: NonEmpty
    endpoint_url: str | None = None
    prefix: str = ""
    region: NonEmpty = "us-east-1"
    access_key_id: NonEmpty | None = None
    secret_access_key: SecretStr | None = Field(None, repr=False)
    addressing_style: Literal["path", "virtual", "auto"] = "path"
    max_threads: int = Field(DEFAULT_THREADS, ge=1, le=1024, description="boto3 calls at once (its threads and pool)")
    connect_timeout: float = Field(5.0, gt=0, description="seconds to connect to the endpoint")
    read_timeout: float = Field(60.0, gt=0, description="seconds to wait for an answer")
    max_attempts: int = Field(
        3, ge=1, description="botocore's own retries per call (standard mode) before the worker sees an error"
    )
    copy_files: bool = True

    @field_validator("endpoint_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        return http_url(v or None)

    @model_validator(mode="after")
    def _pair(self) -> Self:
        has_secret = self.secret_access_key is not None and bool(self.secret_access_key.get_secret_value())
        if (self.access_key_id is None) != (not has_secret):
            raise ValueError("access_key_id and secret_access_key: set both, or neither (boto3's default chain)")
        return self


def _kind(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("kind", "local")
        return kind if isinstance(kind, str) else None
    return getattr(value, "kind", None)


StorageSettings = Annotated[
    Annotated[LocalStorageSettings, Tag("local")] | Annotated[S3StorageSettings, Tag("s3")],
    Discriminator(_kind, custom_error_type="unknown_kind", custom_error_message="must be one of 'local', 's3'"),
]
