"""The per-queue `autoscale` block of offload.yaml (also settable through the API), plus durations and cron.

The same pydantic model validates the YAML file, the API body and what is stored in Redis, so every way in
names the offending field the same way (`queues.gpu.autoscale.max_workers: ...`). Cron expressions are read
by cronsim; the scaler needs one operation only ("the latest fire time at or before t"), evaluated against an
injectable clock.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from datetime import datetime, timedelta
from typing import Annotated, Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError
from pydantic import BeforeValidator, Field, ValidationError, field_validator, model_validator

from offload.autoscale.deploy import Deployment
from offload.autoscale.vault import Vault
from offload.env import process_env
from offload.errors import ConfigError
from offload.schema import Strict, parse, parse_duration
from offload.suggest import closest, did_you_mean

Duration = Annotated[float, BeforeValidator(parse_duration)]
MAX_BINS = 1440  # a pre-rent profile's bins per period: a day by the minute


class Cron:
    """A standard five-field cron expression (minute hour day-of-month month day-of-week) in a time zone, read
    by cronsim (Debian cron's rules, including day-of-month/day-of-week "either matches" and DST: a time skipped
    by the spring change fires at the first minute after it, a repeated one fires once)."""

    def __init__(self, expr: str, tz: str = "UTC") -> None:
        if len(expr.split()) != 5:
            raise ValueError(f"cron {expr!r} must have 5 fields (minute hour day month weekday)")
        try:
            self.tz = ZoneInfo(tz)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {tz!r}") from None
        try:
            CronSim(expr, datetime.now(self.tz))
        except CronSimError as exc:
            raise ValueError(f"bad cron {expr!r}: {exc}") from None
        self.expr = expr

    def last_fire(self, now: float, lookback: float) -> float | None:
        """The latest minute at or before `now` (epoch seconds) that matches, if within `lookback` seconds."""
        minute = datetime.fromtimestamp(now, self.tz).replace(second=0, microsecond=0)
        fire = next(CronSim(self.expr, minute + timedelta(minutes=1), reverse=True), None)
        if fire is None:
            return None
        at = fire.timestamp()
        return at if now - at <= lookback + 60 else None


def _cron_text(v: str) -> str:
    Cron(v)
    return v


class NoWorkers(Strict):
    trigger: Literal["no_workers"]


class QueueDepth(Strict):
    trigger: Literal["queue_depth"]
    threshold: int = Field(..., ge=0)


class Latency(Strict):
    trigger: Literal["latency"]
    max_latency: Duration = Field(..., gt=0)


class UpSchedule(Strict):
    trigger: Literal["schedule"]
    cron: Annotated[str, BeforeValidator(_cron_text)]
    workers: int = Field(1, ge=0)
    duration: Duration | None = Field(None, gt=0, description="how long the floor holds; default: one poll")


class Idle(Strict):
    trigger: Literal["idle"]
    timeout: Duration = Field(..., gt=0)


class Cost(Strict):
    """Scale in by cost (scale_in.py): keep an idle machine through the gap the queue's arrivals predict when
    idling costs less than a re-rent, release it at once when not; the idle timeout applies until a gap is seen."""

    trigger: Literal["cost"]
    boot_time: Duration = Field(
        180.0, gt=0, description="what a re-rent costs in boot time until the queue's own boots are measured"
    )


class Predict(Strict):
    """The learned pre-rent of a queue with overflow (predict.py): arrivals by time within `period`, and machines
    rented a boot ahead of a burst that came at the same time in each of the last `recur` periods."""

    period: Duration = Field(..., gt=0, description="the period bursts recur with (1h: the minute of the hour)")
    bin: Duration = Field(60.0, gt=0, description="the profile's resolution: arrivals are counted per bin")
    recur: int = Field(3, ge=1, le=10, description="a burst is expected when it came in each of this many periods")

    @model_validator(mode="after")
    def _bounded(self) -> Predict:
        if self.bin > self.period:
            raise ValueError(f"bin: {self.bin:g}s is longer than period ({self.period:g}s)")
        if self.period / self.bin > MAX_BINS:
            raise ValueError(f"period / bin: {self.period / self.bin:g} bins, at most {MAX_BINS} (a longer bin)")
        return self


class Overflow(Strict):
    """A fleet that has serverless overflow (overflow.py): the fleet is rented for the queue's base load and a job
    goes to `backends` when the fleet is predicted not to start it within `after`."""

    backends: list[Annotated[str, Field(min_length=1)]] = Field(
        ..., min_length=1, description="the serverless backends (names under `backends:`) a job overflows to"
    )
    after: Duration = Field(300.0, gt=0, description="a job overflows when its predicted fleet wait exceeds this")
    window: Duration = Field(3600.0, gt=0, description="how far back the base load looks")
    span: Duration = Field(600.0, gt=0, description="the base load's buckets: offered load over each span")
    quantile: float = Field(
        0.25, ge=0, le=1, description="the base load: this quantile of the window's buckets (0.5: the median)"
    )

    keep_busy: float = Field(
        0.4,
        gt=0,
        le=1,
        description="a base machine is kept while it would be busy at least this share of the time: the rented "
        "price over the serverless one (0.4: $1.00/h against $2.50/h)",
    )
    run_time: Duration | None = Field(
        None,
        gt=0,
        description="the expected run time of one job until the queue's own is measured (blended with the first "
        "measured runs); unset: no machine is counted on before a run is measured",
    )
    predict: Predict | None = Field(
        None, description="rent a boot ahead of bursts that recur each period (off when unset)"
    )

    @model_validator(mode="after")
    def _fits(self) -> Overflow:
        if self.span > self.window:
            raise ValueError(f"span: {self.span:g}s is longer than window ({self.window:g}s)")
        if len(set(self.backends)) != len(self.backends):
            raise ValueError("backends: a backend is named twice")
        return self


class DownSchedule(Strict):
    trigger: Literal["schedule"]
    cron: Annotated[str, BeforeValidator(_cron_text)]


ScaleUp = Annotated[NoWorkers | QueueDepth | Latency | UpSchedule, Field(discriminator="trigger")]
ScaleDown = Annotated[Idle | Cost | DownSchedule, Field(discriminator="trigger")]


class InstanceSpec(Strict):
    """What to rent. The provider's own GPU setting wins over `gpu` (GPU names differ per provider)."""

    gpu: str | None = None
    gpu_count: int = Field(1, ge=1, le=16)
    image: str | None = None
    disk_gb: int | None = Field(None, ge=1, le=10_000)
    max_price_per_hour: float | None = Field(None, gt=0)
    handler: str | None = Field(None, description="module:function: start `offload worker --handler` with it")
    env: dict[str, str] = Field(default_factory=dict)
    spot: bool = Field(False, description="rent interruptible machines (RunPod interruptible, Vast.ai bids)")
    spot_max_price: float | None = Field(None, gt=0, description="the most to pay per hour for a spot machine")

    @field_validator("env")
    @classmethod
    def _no_secrets_override(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if name in RESERVED_ENV or name.startswith("OFFLOAD_GIT_"):
                raise ValueError(f"{name} is set by the autoscaler and cannot be overridden")
        return v

    @model_validator(mode="after")
    def _spot_has_a_cap(self) -> InstanceSpec:
        if self.spot and self.spot_max_price is None:
            raise ValueError("spot_max_price: required with spot: true (spot machines are rented up to this price)")
        return self


RESERVED_ENV = (
    "OFFLOAD_TOKEN",
    "OFFLOAD_SERVER",
    "OFFLOAD_INSTANCE_ID",
    "OFFLOAD_INSTANCE_TOKEN",
    "OFFLOAD_QUEUE",
    "OFFLOAD_WORKDIR",
    "OFFLOAD_PYTHON",
)


class AutoscaleSettings(Strict):
    """One queue's autoscaling policy."""

    enabled: bool = False
    provider: str | None = None
    providers: list[str] = Field(default_factory=list, description="several providers, in order of preference")
    choose: Literal["first", "cheapest"] = Field(
        "first",
        description="which usable provider rents: the first in the list, or the one with the lowest current offer",
    )
    min_workers: int = Field(0, ge=0)
    max_workers: int | None = Field(None, ge=1)
    jobs_per_worker: int | None = Field(None, ge=1, description="ramp in one step to ceil(jobs / jobs_per_worker)")
    poll_interval: Duration = Field(30.0, ge=0.05)
    boot_timeout: Duration = Field(1200.0, gt=0)
    drain_timeout: Duration = Field(
        3600.0,
        gt=0,
        description="a draining machine is destroyed after this even if "
        "its worker is still busy (a hung handler must not bill forever)",
    )
    protected_failures: Literal["keep", "destroy"] = Field(
        "keep", description="a protected instance whose worker died or never booted: keep it (and alert) or destroy it"
    )
    timezone: str = "UTC"
    scale_up: list[ScaleUp] = Field(default_factory=lambda: [NoWorkers(trigger="no_workers")])  # type: ignore[arg-type]
    # unset: the idle timer, and scale-in by cost once a gap is seen (docs/benchmarks-cost.md: 4-24 % fewer GPU-h
    # on every shipped trace at about the same waits); a block that lists its own triggers gets only those
    scale_down: list[ScaleDown] = Field(
        default_factory=lambda: [Idle(trigger="idle", timeout=600.0), Cost(trigger="cost")],  # type: ignore[arg-type]
        description="default: an idle timeout of 10 min, and scale-in by cost once the queue's gaps are known",
    )
    instance: InstanceSpec = Field(default_factory=lambda: InstanceSpec.model_validate({}))
    deployment: Deployment | None = None
    overflow: Overflow | None = Field(
        None, description="serverless backends for the burst; the fleet is sized for the base load"
    )
    daily_spend_cap: float | None = Field(None, gt=0)
    monthly_spend_cap: float | None = Field(None, gt=0)

    @field_validator("timezone")
    @classmethod
    def _tz(cls, v: str) -> str:
        try:
            ZoneInfo(v)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {v!r}") from None
        return v

    @field_validator("providers")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("a provider is named twice")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> AutoscaleSettings:
        if self.provider and self.providers:
            raise ValueError("providers: set either provider or providers, not both")
        if self.enabled and not self.names:
            raise ValueError("provider: required when autoscaling is enabled (or providers: [a, b])")
        if self.enabled and self.max_workers is None:
            raise ValueError("max_workers: required when autoscaling is enabled (>= 1)")
        if self.max_workers is not None and self.min_workers > self.max_workers:
            raise ValueError(f"min_workers: {self.min_workers} is above max_workers ({self.max_workers})")
        for i, t in enumerate(self.scale_up):
            if isinstance(t, UpSchedule) and self.max_workers is not None and t.workers > self.max_workers:
                raise ValueError(f"scale_up.{i}.workers: {t.workers} is above max_workers ({self.max_workers})")
        if self.deployment is not None and self.instance.handler:
            raise ValueError("instance.handler: set the handler in deployment.handler only")
        return self

    @property
    def names(self) -> list[str]:
        """The providers, in order of preference."""
        return [self.provider] if self.provider else list(self.providers)

    @property
    def limit(self) -> int:
        return self.max_workers or 0

    @property
    def boots(self) -> str:
        """What a machine of this queue boots (the instance and deployment blocks), as a short fingerprint: a
        healthy boot vouches for it until it changes."""
        what = self.instance.model_dump_json() + (self.deployment.model_dump_json() if self.deployment else "")
        return hashlib.sha256(what.encode()).hexdigest()[:16]

    def crons(self) -> tuple[list[tuple[Cron, UpSchedule]], list[Cron]]:
        up = [(Cron(t.cron, self.timezone), t) for t in self.scale_up if isinstance(t, UpSchedule)]
        down = [Cron(t.cron, self.timezone) for t in self.scale_down if isinstance(t, DownSchedule)]
        return up, down


def autoscale_errors(data: Any, where: str = "autoscale") -> list[tuple[str, str]]:
    """Every problem of an autoscale block as (field path, message), e.g. ("q.scale_up.1.threshold", "Field
    required"): the API answers with all of them, so a form can show each one at its field."""
    try:
        AutoscaleSettings.model_validate(data)
    except ValidationError as exc:
        return [_located(e, where) for e in exc.errors()]
    return []


def _located(error: Any, where: str) -> tuple[str, str]:
    loc = [str(p) for p in error["loc"] if not str(p).startswith(("function-", "tagged-union"))]
    # the trigger union adds the tag as a path element: keep "scale_up.1.threshold", drop "queue_depth"
    loc = [p for p in loc if p not in ("no_workers", "queue_depth", "latency", "schedule", "idle", "cost")]
    msg = str(error["msg"]).removeprefix("Value error, ")
    field = ".".join([where, *loc])
    if ":" in msg and msg.split(":", 1)[0].replace(".", "_").isidentifier():  # a model check names its field
        name, rest = msg.split(":", 1)
        field, msg = ".".join([where, *loc, name]), rest.strip()
    return field, msg


SEALED = "sealed"  # an instance.env value stored encrypted: {"sealed": "<vault token>", "for": {provider: digest}}
BOUND = "for"  # the providers (name -> destination digest, provider_store.py) the values were given for


def seal_env(block: dict[str, Any], vault: Vault, queue: str, bound: dict[str, str]) -> dict[str, Any]:
    """The block as stored in Redis: `instance.env` values (HF_TOKEN and the like) encrypted like a provider's
    credentials, so a copy of the database holds none of them, each bound to the providers it was given for."""
    env = (block.get("instance") or {}).get("env") if isinstance(block.get("instance"), dict) else None
    if not isinstance(env, dict) or not env:
        return block
    sealed = {k: {SEALED: vault.encrypt(str(v), f"queue:{queue}:env:{k}"), BOUND: bound} for k, v in env.items()}
    return {**block, "instance": {**block["instance"], "env": sealed}}


def env_bound(stored: dict[str, Any]) -> dict[str, str] | None:
    """The providers a stored block's `instance.env` values were given for; None when it has no values, {} when
    they were stored before values were bound (they go nowhere until given again)."""
    env = (stored.get("instance") or {}).get("env") if isinstance(stored.get("instance"), dict) else None
    if not isinstance(env, dict) or not env:
        return None
    first = next(iter(env.values()))
    bound = first.get(BOUND) if isinstance(first, dict) else None
    return dict(bound) if isinstance(bound, dict) else {}


def open_env(block: dict[str, Any], vault: Vault | None, queue: str) -> dict[str, Any]:
    """The stored block with `instance.env` decrypted (VaultError without the master key)."""
    env = (block.get("instance") or {}).get("env") if isinstance(block.get("instance"), dict) else None
    if not isinstance(env, dict) or not any(isinstance(v, dict) for v in env.values()):
        return block
    if vault is None:
        vault = Vault.from_env()
    opened = {
        k: vault.decrypt(v[SEALED], f"queue:{queue}:env:{k}") if isinstance(v, dict) else v for k, v in env.items()
    }
    return {**block, "instance": {**block["instance"], "env": opened}}


def validate_autoscale(data: Any, where: str = "autoscale") -> AutoscaleSettings:
    """Validate an autoscale block from any source; the error names the field (`where.max_workers: ...`)."""
    try:
        return AutoscaleSettings.model_validate(data)
    except ValidationError as exc:
        field, msg = _located(exc.errors()[0], where)
        raise ConfigError(f"{field}: {msg}") from None


def autoscale_problems(data: Any, where: str = "autoscale") -> list[ConfigError]:
    """Every problem of an autoscale block, one each (`offload config check`); none for a valid block."""
    try:
        AutoscaleSettings.model_validate(data)
    except ValidationError as exc:
        return [ConfigError("{}: {}".format(*_located(error, where))) for error in exc.errors()]
    return []


def yaml_blocks(settings: Any) -> dict[str, dict[str, Any]]:
    """Each queue's autoscale block from offload.yaml (`settings`: offload.config.Settings), with the guide's layout
    accepted too: `deployment:` next to `autoscale:` in the queue. It belongs to the autoscale block (the API and
    the dashboard edit it there), so it may be set in one place only."""
    out: dict[str, dict[str, Any]] = {}
    for name, q in settings.queues.items():
        block, deployment, where = q.autoscale, q.deployment, f"queues.{name}"
        if deployment is not None:
            if block is None:
                raise ConfigError(f"{where}.deployment: a deployment needs an autoscale block to rent machines for it")
            if "deployment" in block:
                raise ConfigError(f"{where}.deployment: also set in {where}.autoscale.deployment; keep one")
            block = {**block, "deployment": deployment}
        if block is not None:
            out[name] = block
    return out


def overflow_problems(qname: str, block: Mapping[str, Any], settings: Any) -> Iterator[ConfigError]:
    """An autoscale block's overflow backends must be configured backends, and the queue a GPU-worker queue."""
    flow = block.get("overflow")
    if not isinstance(flow, Mapping):
        return
    where = f"queues.{qname}.autoscale.overflow"
    if settings.queues[qname].dispatched:
        yield ConfigError(f"{where}: only a queue served by GPU workers (no backend) overflows; this one dispatches")
    names = flow.get("backends")
    for i, name in enumerate(names if isinstance(names, list) else []):
        if isinstance(name, str) and name not in settings.backends:
            near = did_you_mean(closest(name, settings.backends))
            yield ConfigError(f"{where}.backends.{i}: no backend named {name!r} is configured{near}")


def overflow_over_api(queue: str, flow: Overflow | None, settings: Any) -> str | None:
    """Why an `overflow` in a block set over the HTTP API cannot stand (None: it can). The overflow workers read
    their backends from offload.yaml, so the API's block must name the same ones, in the same order; it may tune
    the rest (`after`, the base load's window)."""
    if flow is None:
        return None
    own = settings.queues.get(queue)
    named = own.overflow_backends if own is not None else []
    if flow.backends == named:
        return None
    return (
        f"queues.{queue}.autoscale.overflow.backends: {flow.backends} is not what offload.yaml names for this queue "
        f"({named or 'no overflow'}); the overflow workers read their backends from offload.yaml: set them there"
    )


class ServerSide(Strict):
    """The top-level `autoscaler:` block: what every queue's autoscaling shares.

    `public_url` and `worker_key` are what a rented machine receives (OFFLOAD_PUBLIC_URL and
    OFFLOAD_WORKER_API_KEY override them): a datacenter GPU cannot reach `localhost`, and a third-party host
    must never hold the admin key, so real providers refuse to rent until both are set."""

    public_url: str | None = None
    worker_key: str | None = Field(None, repr=False)  # a secret: never in a repr or a log line
    destroy_orphans: bool = False
    orphan_sweep_interval: Duration = Field(600.0, gt=0)
    tick: Duration = Field(1.0, gt=0, description="how often the loop wakes; each queue runs per its poll_interval")
    leader_ttl: Duration = Field(30.0, gt=0)
    heartbeat_timeout: Duration = Field(300.0, gt=0)
    recent_task: Duration = Field(30.0, ge=0, description="a worker that touched a task this recently is spared")
    drain_settle: Duration = Field(
        15.0,
        ge=0,
        description="after asking a worker to drain, wait this long (a "
        "heartbeat or two) before trusting its in-flight count",
    )
    max_machines: int | None = Field(None, ge=1, description="machines billed at once across all queues")
    max_machines_per_provider: dict[str, int] = Field(
        default_factory=dict, description="machines billed at once per provider name, across all queues"
    )
    daily_spend_cap: float | None = Field(None, gt=0, description="USD per UTC day across all queues")
    monthly_spend_cap: float | None = Field(None, gt=0, description="USD per UTC month across all queues")

    @field_validator("max_machines_per_provider")
    @classmethod
    def _positive(cls, caps: dict[str, int]) -> dict[str, int]:
        if bad := sorted(name for name, n in caps.items() if n < 1):
            raise ValueError(f"must be at least 1 (provider {', '.join(bad)})")
        return caps


def server_side(data: ServerSide | Mapping[str, Any] | None, env: dict[str, str] | None = None) -> ServerSide:
    """The typed `autoscaler:` block (offload.config validated it; a mapping is validated here) with the
    environment's OFFLOAD_PUBLIC_URL and OFFLOAD_WORKER_API_KEY on top."""
    env = dict(process_env()) if env is None else env
    out: ServerSide = data.model_copy() if isinstance(data, ServerSide) else parse(ServerSide, data or {}, "autoscaler")
    if env.get("OFFLOAD_PUBLIC_URL"):
        out.public_url = env["OFFLOAD_PUBLIC_URL"]
    if env.get("OFFLOAD_WORKER_API_KEY"):
        out.worker_key = env["OFFLOAD_WORKER_API_KEY"]
    return out
