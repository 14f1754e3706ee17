"""Configuration: `offload.yaml` (storage, backends, queues) with `${ENV}` references for secrets, env
overrides, and the tutorial's env names as fallbacks, so a team keeps its env file when it moves over.

This is the one validation: every block has its typed model (storage and each backend kind one per kind, in
offload.storage.settings and offload.backends.settings; autoscale and alerts in offload.autoscale), all checked
here when the file is read, and passed on as those typed objects. Every problem is a ConfigError that names the
offending field (`storage.bucket: required`), raised at start, never mid-run.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from offload.autoscale.alert_settings import AlertSettings
from offload.autoscale.settings import Overflow, ServerSide, autoscale_problems, overflow_problems, yaml_blocks
from offload.backends.settings import AnyBackendSettings, BackendSettings, HealthSettings
from offload.callback_settings import CallbackSettings
from offload.caps import CapLimits, reservation
from offload.connection import configured_url
from offload.egress import url_problem
from offload.env import process_env
from offload.errors import ConfigError
from offload.history_settings import HistorySettings
from offload.local import stack
from offload.local.embedded import data_dir
from offload.models import (
    DEFAULT_CONCURRENCY,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_POLL_INTERVAL_S,
    DEFAULT_POLL_TIMEOUT_S,
    DEFAULT_SUBMIT_CONCURRENCY,
)
from offload.queue import durability
from offload.queue.durability import Durability
from offload.queue.keyspace import validate_queue
from offload.route_settings import InputMap, InputMapSettings, RouteKind, input_map, route_problems
from offload.schema import NonEmpty, Strict, field_errors, parse, parse_networks, parse_rate
from offload.storage.namespace import check_prefixes
from offload.storage.settings import LocalStorageSettings, StorageSettings
from offload.suggest import closest, did_you_mean
from offload.tracing import Exporter

WEBHOOK_KINDS = frozenset({"replicate", "fal", "runpod"})  # the backends whose providers call back
ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
__all__ = [
    "BackendSettings",
    "ConfigError",
    "HealthSettings",
    "QueueSettings",
    "Settings",
    "StorageSettings",
    "config_file",
    "load_settings",
    "parse_rate",
    "store_url",
]


# `offload server`'s limits, the defaults of its options and of ServerOptions (which tests build directly).
SERVER_MAX_BATCH = 1000  # jobs per batch enqueue
SERVER_MAX_BODY = 16 << 20  # bytes per request body
SERVER_WORKER_LEASE_MS = 30_000  # lease of a GPU worker; it heartbeats every third of it
SERVER_MAX_CONNECTIONS = 2048  # concurrent connections + requests (uvicorn's limit_concurrency), then 503
SERVER_HEADER_TIMEOUT_S = 10.0  # a connection must send its request headers within this (slowloris)
SERVER_BODY_TIMEOUT_S = 30.0  # a request body gets this long to arrive (server/limits.py) ...
SERVER_BODY_MIN_RATE = 16 << 10  # ... plus one second per this many bytes it delivers; then 408, closed
SERVER_MAX_REQUESTS_PER_KEY = 1024  # requests one key has open at once (per server process), then 429
SERVER_MAX_STREAMS_PER_KEY = 512  # event streams and long-polls (SSE, wait, claim) one key has open, then 429
SERVER_MAX_REQUESTS_PER_ADDRESS = 256  # requests without a key (webhooks included) open per client address


class ServerSettings(Strict):
    """What the server's public address is: set, backends that support it send each submission a webhook URL
    under it (`<public_url>/v1/hooks/...`), and polling becomes a slow fallback. `trusted_proxies`: the reverse
    proxies (CIDRs) whose forwarding headers name the client (offload/server/clientaddr.py)."""

    public_url: str | None = None
    trusted_proxies: list[str] = Field(default_factory=list)

    @field_validator("trusted_proxies")
    @classmethod
    def _cidrs(cls, v: list[str]) -> list[str]:
        parse_networks(v)
        return [c.strip() for c in v]

    @field_validator("public_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"https?://[^\s/?#]+(/[^\s?#]*)?", v):
            raise ValueError(f"must be an http:// or https:// URL without query or fragment, got {v!r}")
        return v.rstrip("/") if v is not None else None


class TracingSettings(Strict):
    """OpenTelemetry traces of every job (docs/how-to/tracing.md); OFFLOAD_TRACING and OFFLOAD_TRACING_EXPORTER
    override both fields."""

    enabled: bool = Field(False, description="trace each job: needs offload[otel]")
    exporter: Exporter = Field(
        "none",
        description="none: the global TracerProvider (the application's, or opentelemetry-instrument's); otlp or "
        "console: offload installs an SDK provider with that exporter where none is installed",
    )


class QueueSettings(Strict):
    backend: str | None = None  # None: served by GPU workers (`offload worker --handler`), not dispatched
    backends: list[NonEmpty] | None = Field(
        None,
        min_length=1,
        description="several backends for one queue (instead of `backend`), chosen per submission by `route`",
    )
    route: RouteKind = Field(
        "fallback",
        description="how `backends` are chosen: fallback (in order, the first healthy), weighted (by `weights` among "
        "the healthy), cheapest (by price_per_job, or price_per_second x the measured mean run time; unknown last)",
    )
    weights: dict[str, float] | None = Field(
        None, description="route: weighted: each backend's share, e.g. {a: 3, b: 1}"
    )
    inputs: dict[str, InputMapSettings] | None = Field(
        None,
        description="per backend, `module:function` taking the job input and returning that backend's input, or "
        '`{template: ...}`: that input as JSON, `{"$input": "prompt"}` copying a field of the job input',
    )
    health: HealthSettings = Field(default_factory=HealthSettings, description="when a routed backend cools down")
    concurrency: int = Field(DEFAULT_CONCURRENCY, ge=1, le=100_000)
    max_attempts: int = Field(DEFAULT_MAX_ATTEMPTS, ge=1)
    daily_job_cap: int | None = Field(None, ge=0)
    daily_spend_cap: float | None = Field(None, ge=0)
    poll_interval: float = Field(DEFAULT_POLL_INTERVAL_S, gt=0)
    poll_timeout: float = Field(DEFAULT_POLL_TIMEOUT_S, gt=0)
    submit_concurrency: int = Field(
        DEFAULT_SUBMIT_CONCURRENCY,
        ge=1,
        description="submissions between intent and recorded remote id at "
        "once, per worker (not for synchronous backends)",
    )
    ingest_list: str | None = None
    # a storage prefix this queue owns besides its own results/<queue>: (offload/storage/namespace.py)
    output_prefix: str | None = None
    autoscale: dict[str, Any] | None = None  # validated by offload.autoscale.settings (see load_settings)
    deployment: dict[str, Any] | None = None  # the guide's place for autoscale.deployment (see yaml_blocks)
    timeout: float | None = Field(
        None,
        gt=0,
        description="seconds one attempt may run on a GPU worker (`offload worker --handler`); past it the server "
        "fails the attempt and tells the worker to abandon it. Dispatch queues are bounded by poll_timeout",
    )
    callback_url: str | None = Field(
        None, description="where a completion webhook of each of its jobs goes (a job's own callback_url wins)"
    )

    @field_validator("callback_url")
    @classmethod
    def _callback_url(cls, v: str | None) -> str | None:
        if v is not None and (problem := url_problem(v)):
            raise ValueError(problem)
        return v

    @property
    def route_backends(self) -> list[str]:
        """The backends this queue dispatches to, in the configured order ([] for a GPU-worker queue)."""
        if self.backends:
            return list(self.backends)
        return [self.backend] if self.backend is not None else []

    @property
    def overflow_backends(self) -> list[str]:
        """A GPU-worker queue's serverless overflow (its autoscale block's `overflow.backends`; [] for none)."""
        flow = (self.autoscale or {}).get("overflow")
        names = flow.get("backends") if isinstance(flow, Mapping) else None
        return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []

    @property
    def served_backends(self) -> list[str]:
        """The backends a dispatch worker sends this queue's jobs to: its route, else its overflow."""
        return self.route_backends or self.overflow_backends

    @property
    def dispatched(self) -> bool:
        """Whether dispatch workers serve this queue (it names a backend), rather than GPU workers."""
        return bool(self.route_backends)

    @field_validator("timeout")
    @classmethod
    def _timeout_for_gpu_workers(cls, v: float | None, info: ValidationInfo) -> float | None:
        if v is not None and (
            info.data.get("backend") is not None or info.data.get("backends")
        ):  # one meaning per name: no second poll_timeout
            raise ValueError(
                "bounds a run on GPU workers (a queue without a backend); a dispatch queue's remote jobs are "
                "bounded by poll_timeout"
            )
        return v


class Settings(Strict):
    redis_url: str | None = None
    durability: Durability | None = None  # acknowledged writes wait for replicas (offload/queue/durability.py)
    storage: StorageSettings = LocalStorageSettings()
    server: ServerSettings = ServerSettings()
    backends: dict[str, BackendSettings] = Field(default_factory=dict)
    queues: dict[str, QueueSettings] = Field(default_factory=dict)
    autoscaler: ServerSide | None = None  # the autoscaler's server-side settings (offload.autoscale.settings)
    alerts: AlertSettings | None = None  # where alerts go (offload.autoscale.alert_settings)
    callbacks: CallbackSettings = CallbackSettings()  # where completion webhooks may go (offload.callback_settings)
    history: HistorySettings = HistorySettings()  # each queue's history: on, retention (offload.history_settings)
    tracing: TracingSettings = TracingSettings()  # OpenTelemetry traces, opt-in (offload.tracing)

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

    def cap_limits(self, name: str) -> CapLimits | None:
        """The daily caps of queue `name` and what one of its submissions reserves, or None: not configured, or
        no cap."""
        q = self.queues.get(name)
        if q is None or (q.daily_job_cap is None and q.daily_spend_cap is None):
            return None
        reserves = [  # a routed queue reserves what its dearest backend may cost: the route is chosen later
            reservation(
                max_job_cost=b.max_job_cost,
                price_per_job=b.price_per_job,
                price_per_second=b.price_per_second,
                poll_timeout=q.poll_timeout,
            )
            for b in (self.backends.get(n) for n in q.served_backends)
            if b is not None
        ]
        return CapLimits(q.daily_job_cap, q.daily_spend_cap, max(reserves, default=0.0))

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

    def backend_for(self, queue: str) -> tuple[str, AnyBackendSettings]:
        """The queue's (first) backend: the one of a single-`backend` queue."""
        return self.backends_for(queue)[0]

    def backends_for(self, queue: str) -> list[tuple[str, AnyBackendSettings]]:
        """Every backend the queue dispatches to, in the configured order (a GPU-worker queue's: its overflow)."""
        q = self.queue(queue)
        if not q.served_backends:
            raise ConfigError(
                f"queues.{queue}.backend: required to dispatch this queue (it names no backend, and no "
                "autoscale.overflow backends)"
            )
        out = []
        for name in q.served_backends:
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
            out.append((name, b))
        return out

    def overflow(self, queue: str) -> Overflow | None:
        """The queue's `autoscale.overflow` block (None: it has none)."""
        flow = (self.queue(queue).autoscale or {}).get("overflow")
        return Overflow.model_validate(flow) if isinstance(flow, Mapping) else None

    def input_maps(self, queue: str) -> dict[str, InputMap]:
        """The queue's per-backend input mappings: functions imported, templates ready (checked at start by
        `cross_checks` and the model)."""
        return {name: input_map(spec) for name, spec in (self.queue(queue).inputs or {}).items()}

    def health_for(self, queue: str, backend: str) -> HealthSettings:
        """The cool-down thresholds of `backend` in `queue`: the queue's `health:`, the backend's own over it."""
        own = self.backends[backend].health
        base = self.queue(queue).health
        return own.over(base) if own is not None else base


def _expand(value: Any, env: Mapping[str, str], path: str, missing: list[ConfigError] | None = None) -> Any:
    """Replace ${VAR} and ${VAR:-default} in strings; a missing variable names the field that needs it."""
    if isinstance(value, dict):
        return {k: _expand(v, env, f"{path}.{k}" if path else str(k), missing) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, env, f"{path}[{i}]", missing) for i, v in enumerate(value)]
    if isinstance(value, str):

        def sub(m: re.Match[str]) -> str:
            if m.group(1) in env:
                return env[m.group(1)]
            if m.group(2) is not None:
                return m.group(2)
            problem = ConfigError(f"{path}: environment variable {m.group(1)} is not set")
            if missing is None:
                raise problem
            missing.append(problem)
            return ""

        return ENV_REF.sub(sub, value)
    return value


def _pick(env: Mapping[str, str], *names: str) -> str | None:
    """The first variable set: OFFLOAD_* names first, then the tutorial's."""
    return next((env[n] for n in names if env.get(n)), None)


def _from_env(data: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """Overlay env settings (OFFLOAD_* first, tutorial names as fallback) onto the file's data."""
    if url := _pick(env, "OFFLOAD_REDIS_URL", "REDIS_URL"):
        data["redis_url"] = url
    if wanted := durability.from_env(env):  # OFFLOAD_DURABILITY_REPLICAS, _TIMEOUT_MS, _FSYNC
        data["durability"] = {**(data.get("durability") or {}), **wanted}
    if public := _pick(
        env, "OFFLOAD_SERVER_PUBLIC_URL"
    ):  # not OFFLOAD_PUBLIC_URL: the autoscaler's, for rented machines
        data.setdefault("server", {})["public_url"] = public
    if proxies := _pick(env, "OFFLOAD_TRUSTED_PROXIES"):
        data.setdefault("server", {})["trusted_proxies"] = [p for p in proxies.split(",") if p.strip()]
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
    env = process_env() if env is None else env
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
    settings: Settings = parse(Settings, read_data(path, env))
    if (problem := next(cross_checks(settings), None)) is not None:
        raise problem
    return settings


def problems(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> list[ConfigError]:
    """Every problem `load_settings` would raise one at a time, for `offload config check`. An unreadable file (or
    none where one was named) is the one problem: nothing else can be checked without it."""
    missing: list[ConfigError] = []
    data = read_data(path, env, missing)
    try:
        settings = Settings.model_validate(data)
    except ValidationError as exc:
        return [*missing, *field_errors(exc, Settings, "", data)]
    return [*missing, *cross_checks(settings)]


def read_data(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    missing: list[ConfigError] | None = None,
) -> dict[str, Any]:
    """The file's settings with ${VAR}s expanded, and the environment's on top: the input of `parse`. A missing
    variable raises, or with `missing` given is noted there (and reads as empty) so the rest is still checked."""
    env = process_env() if env is None else env
    file = config_file(path, env)
    data: dict[str, Any] = {}
    if file is not None:
        home = data_dir(env.get("OFFLOAD_HOME"))
        if file.resolve() == stack.config_path(home):  # the generated file refers to the stack's S3 secret
            env = {**stack.secret_env(home), **env}
        try:
            loaded = yaml.safe_load(file.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{file}: not valid YAML: {' '.join(str(exc).split())}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{file}: the top level must be a mapping")
        data = _expand(loaded, env, "", missing)
    return _from_env(data, env)


def cross_checks(settings: Settings) -> Iterator[ConfigError]:
    """The problems no single block's model can see (references between blocks, the autoscale blocks), each once."""
    try:
        blocks = yaml_blocks(settings)
    except ConfigError as exc:
        yield exc
        blocks = {}
    for qname, block in blocks.items():
        yield from autoscale_problems(block, f"queues.{qname}.autoscale")
        yield from overflow_problems(qname, block, settings)  # (offload.autoscale.settings)
    for qname, q in settings.queues.items():
        if q.backend is not None and q.backend not in settings.backends:
            near = did_you_mean(closest(q.backend, settings.backends))
            yield ConfigError(f"queues.{qname}.backend: no backend named {q.backend!r} is configured{near}")
        yield from route_problems(f"queues.{qname}", q, settings.backends)
        if q.callback_url is not None and (problem := settings.callbacks.problem(q.callback_url)):
            yield ConfigError(f"queues.{qname}.callback_url: {problem}")
    if settings.server.public_url:
        for bname, b in settings.backends.items():
            if b.kind == "replicate" and b.webhook_secret is None:
                yield ConfigError(
                    f"backends.{bname}.webhook_secret: required with server.public_url set (Replicate signs its "
                    "webhooks; the secret is at GET /v1/webhooks/default/secret)"
                )
    try:
        check_prefixes(settings.output_prefixes())
    except ConfigError as exc:
        yield exc


def store_url(
    url: str | None = None, config: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> str | None:
    """Where the job store is, for every command and the Python client alike: `url` (--url, `Client(url)`), else
    OFFLOAD_REDIS_URL, else REDIS_URL, else the redis_url of the offload.yaml `config_file` picks, else None (the
    embedded default). The file is read only when nothing before it names the store, so a shell without the
    workers' secrets (which the file may refer to) still reaches it."""
    return url or configured_url(env) or load_settings(config, env).redis_url
