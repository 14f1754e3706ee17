"""Configuration: `offload.yaml` (storage, backends, queues) with `${ENV}` references for secrets, env
overrides, and the tutorial's env names as fallbacks, so a team keeps its env file when it moves over.

Every problem is a ConfigError that names the offending field, raised at start, never mid-run.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from offload import stack
from offload.embedded import data_dir
from offload.errors import ConfigError
from offload.files import DEFAULT_MAX_FILE_BYTES
from offload.queue.keys import validate_queue
from offload.storage.namespace import check_prefixes

RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(s|sec|second|m|min|minute|h|hour)\s*$")
FAL_JWKS_URL = "https://rest.alpha.fal.ai/.well-known/jwks.json"
WEBHOOK_KINDS = frozenset({"replicate", "fal", "runpod"})
WEBHOOK_FIELDS = frozenset(
    {"webhook_secret", "webhook_jwks_url", "webhook_jwks_ttl_s", "webhook_grace_s", "webhook_poll_interval_s"}
)
ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_PER = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60, "h": 3600, "hour": 3600}


def parse_rate(text: str) -> float:
    """'20/s' -> 20.0 requests per second."""
    m = RATE_RE.match(text)
    if not m:
        raise ValueError(f"rate limit must look like '20/s', '600/min' or '1000/hour', got {text!r}")
    return float(m.group(1)) / _PER[m.group(2)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StorageSettings(_Strict):
    kind: Literal["s3", "local"] = "local"
    path: str = ".offload/results"
    endpoint_url: str | None = None
    bucket: str | None = None
    prefix: str = ""
    region: str = "us-east-1"
    access_key_id: str | None = None
    secret_access_key: SecretStr | None = None
    copy_files: bool = True
    # files by reference (offload.storage.inputs): the largest File() a job may carry; the life of the presigned
    # GET a provider gets for an input file; how old an uploaded file no job refers to must be before the
    # server's sweep removes it; seconds between sweeps
    max_input_file_bytes: Annotated[int, Field(ge=1)] = DEFAULT_MAX_FILE_BYTES
    input_url_expires_s: Annotated[int, Field(ge=60, le=7 * 86_400)] = 86_400
    upload_grace_s: Annotated[float, Field(gt=0)] = 3600.0
    sweep_interval_s: Annotated[float, Field(gt=0)] = 600.0


class BackendSettings(BaseModel):
    """Common settings; each backend kind reads its own extra keys (endpoint_id, model, ...)."""

    model_config = ConfigDict(extra="allow")
    kind: Literal["http-job", "openai", "runpod", "replicate", "fal"]
    base_url: str | None = None
    api_key: SecretStr | None = None
    timeout: float | None = Field(None, gt=0, description="seconds per request; default: the backend's own")
    rate_limit: str | None = None
    price_per_job: float | None = Field(None, ge=0)
    price_per_second: float | None = Field(None, ge=0)
    max_job_cost: float | None = Field(
        None,
        ge=0,
        description="the most one submission may cost (USD): what is "
        "reserved against daily_spend_cap before it is sent",
    )

    # Webhooks (used when `server.public_url` is set; see the README's "Webhooks"):
    webhook_secret: SecretStr | None = Field(
        None, description="replicate: the account's webhook signing secret (whsec_...), GET /v1/webhooks/default/secret"
    )
    webhook_jwks_url: str = Field(FAL_JWKS_URL, description="fal: where the webhook signing keys are published")
    webhook_jwks_ttl_s: float = Field(86_400.0, gt=0, description="fal: how long fetched signing keys are trusted")
    webhook_grace_s: float | None = Field(
        None,
        ge=0,
        description="a job whose earlier submission's outcome is unknown waits this long for its webhook before "
        "it is submitted again (default 10 s with webhooks on, else 0)",
    )
    webhook_poll_interval_s: float = Field(
        60.0, gt=0, description="with webhooks on, the fallback poll interval of a remote job"
    )

    @field_validator("rate_limit")
    @classmethod
    def _rate(cls, v: str | None) -> str | None:
        if v is not None:
            parse_rate(v)
        return v

    @field_validator("webhook_secret")
    @classmethod
    def _whsec(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and not re.fullmatch(r"whsec_[A-Za-z0-9+/=]{8,}", v.get_secret_value()):
            raise ValueError("must look like whsec_<base64> (Replicate's webhook signing secret)")
        return v

    @field_validator("webhook_jwks_url")
    @classmethod
    def _jwks(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"must be an http:// or https:// URL, got {v!r}")
        return v

    def provider_settings(self) -> dict[str, Any]:
        """What the backend constructor sees: plain values, secrets revealed only here."""
        data = self.model_dump(
            exclude={"rate_limit", "price_per_job", "price_per_second", "max_job_cost", "kind", *WEBHOOK_FIELDS},
            exclude_none=True,
        )
        data["api_key"] = self.api_key.get_secret_value() if self.api_key else None
        return data


class ServerSettings(_Strict):
    """What the server's public address is: set, backends that support it send each submission a webhook URL
    under it (`<public_url>/v1/hooks/...`), and polling becomes a slow fallback."""

    public_url: str | None = None

    @field_validator("public_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"https?://[^\s/?#]+(/[^\s?#]*)?", v):
            raise ValueError(f"must be an http:// or https:// URL without query or fragment, got {v!r}")
        return v.rstrip("/") if v is not None else None


class QueueSettings(_Strict):
    backend: str | None = None  # None: served by GPU workers (`offload worker --handler`), not dispatched
    concurrency: int = Field(256, ge=1, le=100_000)
    max_attempts: int = Field(3, ge=1)
    daily_job_cap: int | None = Field(None, ge=0)
    daily_spend_cap: float | None = Field(None, ge=0)
    poll_interval: float = Field(5.0, gt=0)
    poll_timeout: float = Field(600.0, gt=0)
    submit_concurrency: int = Field(
        32,
        ge=1,
        description="submissions between intent and recorded remote id at "
        "once, per worker (not for synchronous backends)",
    )
    ingest_list: str | None = None
    # a storage prefix this queue owns besides its own results/<queue>: (offload/storage/namespace.py)
    output_prefix: str | None = None
    autoscale: dict[str, Any] | None = None  # validated by offload.autoscale.config (see load_settings)
    deployment: dict[str, Any] | None = None  # the guide's place for autoscale.deployment (see yaml_blocks)


class Settings(_Strict):
    redis_url: str | None = None
    storage: StorageSettings = StorageSettings()
    server: ServerSettings = ServerSettings()
    backends: dict[str, BackendSettings] = {}
    queues: dict[str, QueueSettings] = {}
    autoscaler: dict[str, Any] | None = None  # validated by offload.autoscale.config.server_side
    alerts: dict[str, Any] | None = None  # validated by offload.autoscale.alerts.alert_settings

    @field_validator("queues")
    @classmethod
    def _names(cls, v: dict[str, QueueSettings]) -> dict[str, QueueSettings]:
        for name in v:
            validate_queue(name)
        return v

    def queue(self, name: str) -> QueueSettings:
        try:
            return self.queues[name]
        except KeyError:
            known = ", ".join(sorted(self.queues)) or "none"
            raise ConfigError(f"queue {name!r} is not configured (configured: {known})") from None

    def hook_base(self, backend: str) -> str | None:
        """Where the provider of `backend` is to call back (`<public_url>/v1/hooks/<backend>`), or None: no public
        URL configured, or a kind without webhooks."""
        b = self.backends.get(backend)
        if not self.server.public_url or b is None or b.kind not in WEBHOOK_KINDS:
            return None
        return f"{self.server.public_url}/v1/hooks/{backend}"

    def hook_grace_s(self, backend: str) -> float:
        """How long a job whose earlier submission's outcome is unknown waits for that submission's webhook."""
        b = self.backends[backend]
        if b.webhook_grace_s is not None:
            return b.webhook_grace_s if self.hook_base(backend) else 0.0
        return 10.0 if self.hook_base(backend) else 0.0

    def output_prefixes(self) -> dict[str, str | None]:
        return {name: q.output_prefix for name, q in self.queues.items()}

    def backend_for(self, queue: str) -> tuple[str, BackendSettings]:
        q = self.queue(queue)
        name = q.backend
        if name is None:
            raise ConfigError(f"queues.{queue}.backend: required to dispatch this queue (it names no backend)")
        b = self.backends[name]
        if (
            q.daily_spend_cap is not None
            and b.max_job_cost is None
            and b.price_per_job is None
            and b.price_per_second is None
        ):
            raise ConfigError(
                f"queues.{queue}.daily_spend_cap: backend {name!r} has no price_per_job, price_per_second or "
                f"max_job_cost, so a submission cannot be reserved against the cap before it is sent; set "
                f"backends.{name}.max_job_cost (the most one submission may cost)"
            )
        return name, b


def _expand(value: Any, env: Mapping[str, str], path: str) -> Any:
    """Replace ${VAR} and ${VAR:-default} in strings; a missing variable names the field that needs it."""
    if isinstance(value, dict):
        return {k: _expand(v, env, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, env, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, str):

        def sub(m: re.Match[str]) -> str:
            if m.group(1) in env:
                return env[m.group(1)]
            if m.group(2) is not None:
                return m.group(2)
            raise ConfigError(f"{path}: environment variable {m.group(1)} is not set")

        return ENV_REF.sub(sub, value)
    return value


def _pick(env: Mapping[str, str], *names: str) -> str | None:
    """The first variable set: OFFLOAD_* names first, then the tutorial's."""
    return next((env[n] for n in names if env.get(n)), None)


def _from_env(data: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """Overlay env settings (OFFLOAD_* first, tutorial names as fallback) onto the file's data."""
    if url := _pick(env, "OFFLOAD_REDIS_URL", "REDIS_URL"):
        data["redis_url"] = url
    if public := _pick(
        env, "OFFLOAD_SERVER_PUBLIC_URL"
    ):  # not OFFLOAD_PUBLIC_URL: the autoscaler's, for rented machines
        data.setdefault("server", {})["public_url"] = public
    base = _pick(env, "OFFLOAD_API_BASE", "GPU_API_BASE")
    list_key = _pick(env, "OFFLOAD_QUEUE_KEY", "QUEUE_KEY")
    if base or list_key:  # the tutorial's single-queue setup
        queue_name = _pick(env, "OFFLOAD_QUEUE") or re.sub(r"[^A-Za-z0-9_.-]", "-", list_key or "gpu:jobs")
        backends = data.setdefault("backends", {})
        if base:
            backends.setdefault("gpu", {"kind": "http-job"})
            backends["gpu"]["base_url"] = base
            if key := _pick(env, "OFFLOAD_API_KEY", "GPU_API_KEY"):
                backends["gpu"]["api_key"] = key
        queue = data.setdefault("queues", {}).setdefault(queue_name, {"backend": "gpu"})
        queue.setdefault("ingest_list", list_key or "gpu:jobs")
        queue.setdefault("output_prefix", "results/")  # the tutorial's producers name results/<id>.json
        for field, names in {
            "max_attempts": ("OFFLOAD_MAX_ATTEMPTS", "MAX_ATTEMPTS"),
            "daily_job_cap": ("OFFLOAD_DAILY_JOB_CAP", "DAILY_JOB_CAP"),
            "poll_interval": ("OFFLOAD_POLL_INTERVAL", "POLL_INTERVAL"),
            "poll_timeout": ("OFFLOAD_POLL_TIMEOUT", "POLL_TIMEOUT"),
        }.items():
            if (v := _pick(env, *names)) is not None:
                queue[field] = v
    if bucket := _pick(env, "OFFLOAD_RESULT_BUCKET", "RESULT_BUCKET"):
        storage = data.setdefault("storage", {})
        storage.update({"kind": "s3", "bucket": bucket})
        for field, names in {
            "endpoint_url": ("OFFLOAD_S3_ENDPOINT", "S3_ENDPOINT"),
            "access_key_id": ("OFFLOAD_S3_ACCESS_KEY_ID", "AWS_ACCESS_KEY_ID"),
            "secret_access_key": ("OFFLOAD_S3_SECRET_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY"),
        }.items():
            if (v := _pick(env, *names)) is not None:
                storage[field] = v
    return data


def config_file(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> Path | None:
    """The offload.yaml to read: `path` (--config), else OFFLOAD_CONFIG, else ./offload.yaml, else the local
    stack's (`offload up`), else none (the environment alone). A file named by `path` or OFFLOAD_CONFIG must exist:
    a typo there would otherwise run on another configuration."""
    env = os.environ if env is None else env
    named = path or env.get("OFFLOAD_CONFIG")
    if named:
        file = Path(named)
        if not file.is_file():
            raise ConfigError(f"{'--config' if path else 'OFFLOAD_CONFIG'}: config file {file} does not exist")
        return file
    for candidate in (Path("offload.yaml"), stack.config_path(data_dir(env.get("OFFLOAD_HOME")))):
        if candidate.is_file():
            return candidate
    return None


def load_settings(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Read the offload.yaml `config_file` picks, then the environment on top."""
    env = os.environ if env is None else env
    file = config_file(path, env)
    data: dict[str, Any] = {}
    if file is not None:
        home = data_dir(env.get("OFFLOAD_HOME"))
        if file.resolve() == stack.config_path(home):  # the generated file refers to the stack's S3 secret
            env = {**stack.secret_env(home), **env}
        try:
            loaded = yaml.safe_load(file.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{file}: not valid YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{file}: the top level must be a mapping")
        data = _expand(loaded, env, "")
    data = _from_env(data, env)
    try:
        settings = Settings.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{where}: {first['msg']}") from None
    from offload.autoscale.config import validate_autoscale, yaml_blocks  # a leaf schema module: no cycle

    for qname, block in yaml_blocks(settings).items():
        validate_autoscale(block, f"queues.{qname}.autoscale")
    for qname, q in settings.queues.items():
        if q.backend is not None and q.backend not in settings.backends:
            raise ConfigError(f"queues.{qname}.backend: no backend named {q.backend!r} is configured")
    if settings.autoscaler is not None or settings.alerts is not None:
        from offload.autoscale.alerts import alert_settings
        from offload.autoscale.config import server_side

        server_side(settings.autoscaler, dict(env))
        alert_settings(settings.alerts)
    if settings.server.public_url:
        for bname, b in settings.backends.items():
            if b.kind == "replicate" and b.webhook_secret is None:
                raise ConfigError(
                    f"backends.{bname}.webhook_secret: required with server.public_url set (Replicate signs its "
                    "webhooks; the secret is at GET /v1/webhooks/default/secret)"
                )
    check_prefixes(settings.output_prefixes())
    if settings.storage.kind == "s3" and not settings.storage.bucket:
        raise ConfigError("storage.bucket: required when storage.kind is s3")
    return settings
