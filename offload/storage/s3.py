"""S3-compatible object storage (AWS S3, MinIO, Ceph/OpenStack Swift S3, R2, `rclone serve s3`) through boto3.

boto3 is synchronous, so every call runs in this storage's own ThreadPoolExecutor (16 threads by default) with a
connection pool of the same size: a worker with thousands of jobs in flight queues its writes instead of spawning
thousands of threads or sockets. Large copied files are uploaded with `use_threads=False` for the same reason
(boto3's transfer manager would otherwise start 10 threads per upload).

Path-style addressing is the default because most S3-compatible servers need it; checksums are only sent when an
operation requires them, because several of those servers (rclone among them) reject the newer default trailers.
Presigned URLs use SigV4, which every current server accepts (boto3 falls back to SigV2 for custom endpoints).

Credentials live only in the boto3 session. Neither `repr()` nor any error raised here contains them: errors are
rebuilt from the S3 error code and name the setting to fix (`storage.secret_access_key`), never its value.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import boto3
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    NoCredentialsError,
    ParamValidationError,
    PartialCredentialsError,
)

from offload.clock import span_text
from offload.storage.base import (
    PART_BYTES,
    ClockRefused,
    ObjectInfo,
    ObjectNotFound,
    Put,
    StorageConfigError,
    StorageError,
    dump_json,
    join_prefix,
    validate_key,
    write_stream,
)
from offload.storage.settings import S3StorageSettings

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

log = logging.getLogger(__name__)
T = TypeVar("T")

TRANSIENT_CODES = frozenset({
    "SlowDown", "RequestTimeout", "Throttling", "ThrottlingException", "RequestThrottled", "InternalError",
    "ServiceUnavailable", "RequestTimeTooSkewed", "OperationAborted",
})  # fmt: skip
MAX_SKEW_S = 900  # S3's limit on a signed request's time against the server's clock
_CREDS = "storage.access_key_id / storage.secret_access_key"
# S3 error code -> (setting to fix, what went wrong). Codes of HEAD requests are bare statuses (no body).
CONFIG_CODES = {
    "NoSuchBucket": ("storage.bucket", "bucket {bucket!r} does not exist at {endpoint}"),
    "InvalidBucketName": ("storage.bucket", "{bucket!r} is not a valid bucket name"),
    "InvalidAccessKeyId": ("storage.access_key_id", "the access key id was not recognised by {endpoint}"),
    "SignatureDoesNotMatch": ("storage.secret_access_key", "{endpoint} rejected the request signature (wrong secret?)"),
    "AccessDenied": (_CREDS, "access to bucket {bucket!r} was denied (check the key's permissions)"),
    "403": (_CREDS, "access to bucket {bucket!r} was denied (wrong credentials or missing permissions)"),
    "AllAccessDisabled": ("storage.bucket", "all access to bucket {bucket!r} is disabled"),
    "AccountProblem": (_CREDS, "the account behind these credentials cannot use {endpoint}"),
    "InvalidToken": (_CREDS, "the credentials' session token is invalid"),
    "ExpiredToken": (_CREDS, "the credentials' session token has expired"),
    "AuthorizationHeaderMalformed": ("storage.region", "{endpoint} expects a different region than {region!r}"),
    "PermanentRedirect": ("storage.region", "bucket {bucket!r} is in a different region than {region!r}"),
    "301": ("storage.region", "bucket {bucket!r} is in a different region than {region!r}"),
    "IllegalLocationConstraintException": ("storage.region", "region {region!r} does not match the endpoint"),
}


class S3Storage:
    """Objects at `s3://bucket/prefix/key`."""

    def __init__(self, settings: S3StorageSettings) -> None:
        """`settings` as offload.storage.settings validated them (bucket set, keys in pairs, positive limits)."""
        self.settings = settings
        self.bucket = settings.bucket
        self.prefix = settings.prefix.strip("/")
        self._endpoint = _endpoint_label(settings.endpoint_url)
        config = Config(
            region_name=settings.region,
            signature_version="s3v4",
            s3={"addressing_style": settings.addressing_style},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            max_pool_connections=settings.max_threads,
            connect_timeout=settings.connect_timeout,
            read_timeout=settings.read_timeout,
            retries={"mode": "standard", "max_attempts": settings.max_attempts},
        )
        session = boto3.session.Session(
            aws_access_key_id=settings.access_key_id,
            aws_secret_access_key=settings.secret_access_key.get_secret_value() if settings.secret_access_key else None,
            region_name=settings.region,
        )
        try:
            self._client: S3Client = session.client("s3", endpoint_url=settings.endpoint_url, config=config)
        except ValueError:  # botocore: "Invalid endpoint: ..."
            raise StorageConfigError("storage.endpoint_url: not a valid URL (expected https://host[:port])") from None
        self._pool = ThreadPoolExecutor(settings.max_threads, thread_name_prefix="offload-s3")
        self._transfer = TransferConfig(
            use_threads=False, multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES
        )

    def __repr__(self) -> str:
        return f"S3Storage(bucket={self.bucket!r}, prefix={self.prefix!r}, endpoint={self._endpoint!r})"

    def _key(self, key: str) -> str:
        return join_prefix(self.prefix, validate_key(key))

    def location(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"

    async def _run(self, op: str, key: str | None, fn: Callable[[], T]) -> T:
        """Run one blocking boto3 call in the pool and translate its errors."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, fn)
        except (BotoCoreError, ClientError, S3UploadFailedError) as exc:
            raise self._translate(exc, op, key) from None

    async def put_json(self, key: str, obj: Any) -> str:
        return await self.put_bytes(key, dump_json(obj), "application/json")

    async def put_bytes(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> str:
        full = self._key(key)
        put = functools.partial(
            self._client.put_object, Bucket=self.bucket, Key=full, Body=data, ContentType=content_type
        )
        await self._run("put", full, put)
        return f"s3://{self.bucket}/{full}"

    async def put_all(self, puts: Sequence[Put]) -> list[str]:
        *first, last = puts
        done = await asyncio.gather(
            *(self.put_bytes(p.key, p.data, p.content_type) for p in first), return_exceptions=True
        )
        locations: list[str] = []
        for outcome in done:
            if isinstance(outcome, BaseException):
                raise outcome  # the last is never sent
            locations.append(outcome)
        return [*locations, await self.put_bytes(last.key, last.data, last.content_type)]

    async def put_fileobj(self, key: str, fileobj: IO[bytes], content_type: str = "application/octet-stream") -> str:
        """Multipart above 8 MiB (boto3's threshold), in the calling pool thread only."""
        full = self._key(key)
        upload = functools.partial(
            self._client.upload_fileobj,
            fileobj,
            self.bucket,
            full,
            ExtraArgs={"ContentType": content_type},
            Config=self._transfer,
        )
        await self._run("put", full, upload)
        return f"s3://{self.bucket}/{full}"

    async def get_bytes(self, key: str) -> bytes:
        full = self._key(key)

        def get() -> bytes:
            return self._client.get_object(Bucket=self.bucket, Key=full)["Body"].read()

        return await self._run("get", full, get)

    async def exists(self, key: str) -> bool:
        """A missing bucket also reads as False (a HEAD answer has no body to tell the two 404s apart); the next
        write then raises the `storage.bucket` error."""
        full = self._key(key)
        try:
            await self._run("head", full, functools.partial(self._client.head_object, Bucket=self.bucket, Key=full))
        except ObjectNotFound:
            return False
        return True

    async def presigned_url(self, key: str, expires_s: int = 3600) -> str:
        """Signed locally (no request), so it works even when the store is down; S3 caps `expires_s` at 7 days."""
        params = {"Bucket": self.bucket, "Key": self._key(key)}
        return self._client.generate_presigned_url("get_object", Params=params, ExpiresIn=int(expires_s))

    async def download(self, key: str, path: Path) -> tuple[int, str]:
        full = self._key(key)

        def fetch() -> tuple[int, str]:
            body = self._client.get_object(Bucket=self.bucket, Key=full)["Body"]
            return write_stream(path, iter(lambda: body.read(1 << 20), b""))

        return await self._run("get", full, fetch)

    async def head(self, key: str) -> ObjectInfo | None:
        full = self._key(key)
        try:
            meta = await self._run(
                "head", full, functools.partial(self._client.head_object, Bucket=self.bucket, Key=full)
            )
        except ObjectNotFound:
            return None
        etag = str(meta.get("ETag") or "").strip('"') or None
        return ObjectInfo(key, int(meta.get("ContentLength") or 0), etag, meta["LastModified"].timestamp())

    async def delete(self, key: str) -> None:
        full = self._key(key)
        await self._run("delete", full, functools.partial(self._client.delete_object, Bucket=self.bucket, Key=full))

    async def list_objects(self, prefix: str, limit: int = 1000, after: str = "") -> list[ObjectInfo]:
        full = join_prefix(self.prefix, prefix) if prefix else self.prefix
        strip = len(self.prefix) + 1 if self.prefix else 0

        def listing() -> list[ObjectInfo]:
            found: list[ObjectInfo] = []
            extra = {"StartAfter": join_prefix(self.prefix, after)} if after else {}
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket,
                Prefix=full,
                PaginationConfig={"MaxItems": limit, "PageSize": min(limit, 1000)},
                **extra,  # type: ignore[arg-type]
            )
            for page in pages:
                for item in page.get("Contents", []):
                    found.append(
                        ObjectInfo(
                            item["Key"][strip:],
                            int(item.get("Size", 0)),
                            str(item.get("ETag") or "").strip('"') or None,
                            item["LastModified"].timestamp(),
                        )
                    )
            return found[:limit]

        return await self._run("list", full, listing)

    async def presigned_put_url(self, key: str, expires_s: int, content_type: str, size: int) -> str | None:
        """Signed with Content-Type and Content-Length, so the PUT must send exactly those: a client cannot
        upload more than it declared (S3 caps a single PUT at 5 GiB)."""
        params = {"Bucket": self.bucket, "Key": self._key(key), "ContentType": content_type, "ContentLength": size}
        return self._client.generate_presigned_url("put_object", Params=params, ExpiresIn=int(expires_s))

    async def abort_uploads(self, prefix: str, older_than_s: float) -> int:
        full = join_prefix(self.prefix, prefix)

        def abort() -> int:
            cutoff = time.time() - older_than_s
            try:
                uploads = self._client.list_multipart_uploads(Bucket=self.bucket, Prefix=full).get("Uploads", [])
            except ClientError as exc:  # rclone's S3 (the local stack's) answers so for a bucket that never had one
                if exc.response.get("Error", {}).get("Code") == "NoSuchUpload":
                    return 0
                raise
            count = 0
            for upload in uploads:
                if upload["Initiated"].timestamp() < cutoff:
                    self._client.abort_multipart_upload(
                        Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                    )
                    count += 1
            return count

        return await self._run("abort uploads", full, abort)

    async def create_bucket_if_missing(self) -> bool:
        """Create the bucket unless it exists (local stack, tests); True if it was created."""

        def ensure() -> bool:
            try:
                self._client.head_bucket(Bucket=self.bucket)
                return False
            except ClientError as exc:
                if _code(exc) not in ("404", "NoSuchBucket"):
                    raise
            kwargs: dict[str, Any] = {"Bucket": self.bucket}
            if self.settings.region != "us-east-1":  # AWS rejects an explicit us-east-1 constraint
                kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.settings.region}
            try:
                self._client.create_bucket(**kwargs)
            except ClientError as exc:
                if _code(exc) in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    return False  # a concurrent creator won; "Exists" means someone else's: the next put will say
                raise
            return True

        return await self._run("create bucket", None, ensure)

    async def aclose(self) -> None:
        """Wait for in-flight calls (a write in progress should finish), then close sockets."""
        await asyncio.to_thread(self._pool.shutdown, wait=True)
        self._client.close()

    def _translate(self, exc: Exception, op: str, key: str | None) -> Exception:
        """A credential-free error that says whether to retry (StorageError) or fix a setting."""
        where = f"s3://{self.bucket}/{key}" if key else f"s3://{self.bucket}"
        if isinstance(exc, S3UploadFailedError) and isinstance(exc.__context__, ClientError):
            exc = exc.__context__
        if isinstance(exc, NoCredentialsError | PartialCredentialsError):
            return StorageConfigError(f"{_CREDS}: no S3 credentials were found (set them or use an instance role)")
        if isinstance(exc, ParamValidationError):
            if "bucket name" in str(exc).lower():
                return StorageConfigError(f"storage.bucket: {self.bucket!r} is not a valid bucket name")
            return StorageError(f"{op} {where}: invalid request: {exc}", permanent=True)
        if not isinstance(exc, ClientError):  # connection refused/reset, timeouts, ...
            log.debug("s3 %s %s failed: %s", op, where, type(exc).__name__)
            return StorageError(f"{op} {where} failed: cannot reach {self._endpoint} ({type(exc).__name__})")
        code = _code(exc)
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if status in (400, 403) and (skewed := self._skewed(exc, code)):
            return ClockRefused(f"{op} {where} refused: {skewed}")
        if code in ("NoSuchKey", "404") and key is not None:
            return ObjectNotFound(f"no object at {where}")
        if code == "404":  # HEAD of a bucket has no body, hence no NoSuchBucket code
            code = "NoSuchBucket"
        if code in CONFIG_CODES:
            setting, what = CONFIG_CODES[code]
            detail = what.format(bucket=self.bucket, endpoint=self._endpoint, region=self.settings.region)
            return StorageConfigError(f"{setting}: {detail} (during {op} {where})")
        if status >= 500 or status in (408, 429) or code in TRANSIENT_CODES:
            return StorageError(f"{op} {where} failed: {code} (HTTP {status}) from {self._endpoint}")
        return StorageError(f"{op} {where} failed: {code} (HTTP {status}) from {self._endpoint}", permanent=True)

    def _skewed(self, exc: ClientError, code: str) -> str | None:
        """Why a 403 (or 400) was about this host's clock, or None. S3 refuses a request signed more than 15
        minutes off the server's clock (RequestTimeTooSkewed; rclone says AccessDenied, with a 400, for a clock
        behind), which must not read as a key's permissions: the skew is measured on the answer's Date."""
        headers = exc.response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
        try:
            skew = parsedate_to_datetime(headers["date"]).timestamp() - time.time()
        except (KeyError, TypeError, ValueError):
            skew = None
        if skew is None or abs(skew) <= MAX_SKEW_S:
            if code != "RequestTimeTooSkewed":
                return None
            return f"{self._endpoint} says this host's clock is more than 15 minutes off (fix its time sync)"
        side = "behind" if skew > 0 else "ahead of"
        return (
            f"this host's clock is {span_text(skew)} {side} {self._endpoint}'s, and S3 refuses a request signed "
            "more than 15 minutes off (fix the time sync, NTP or chrony, of whichever of the two is wrong)"
        )


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _endpoint_label(url: str | None) -> str:
    """scheme://host[:port] only: an endpoint URL may carry userinfo or a query that must not reach a message."""
    if not url:
        return "AWS S3"
    try:
        parts = urlsplit(url)
        return f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}"
    except ValueError:
        return "<invalid endpoint URL>"
