"""The per-queue `autoscale` block of offload.yaml (also settable through the API), plus durations and cron.

The same pydantic model validates the YAML file, the API body and what is stored in Redis, so every way in
names the offending field the same way (`queues.gpu.autoscale.max_workers: ...`). Cron is parsed here rather
than with a dependency: five fields are enough, and the scaler needs one operation only ("the latest fire
time at or before t"), which it evaluates against an injectable clock.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from offload.autoscale.vault import Vault
from offload.errors import ConfigError

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: Any) -> float:
    """`30s`, `5m`, `1h30m`, `250ms` or a bare number of seconds -> seconds."""
    if isinstance(value, bool):
        raise ValueError("a duration must be a number of seconds or text like '30s', '5m', '1h30m'")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        try:
            seconds = float(text)
        except ValueError:
            parts = _DURATION.findall(text)
            if not parts or "".join(n + u for n, u in parts) != text:
                raise ValueError(f"bad duration {value!r}: use e.g. '30s', '5m', '1h30m' or seconds") from None
            seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    else:
        raise ValueError("a duration must be a number of seconds or text like '30s'")
    if seconds < 0:
        raise ValueError("a duration cannot be negative")
    return seconds


Duration = Annotated[float, BeforeValidator(parse_duration)]

_CRON_RANGES = ((0, 59), (0, 23), (1, 31), (1, 12), (0, 6))
_NAMES = {
    3: {m: i + 1 for i, m in enumerate(
        ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"])},
    4: {d: i for i, d in enumerate(["sun", "mon", "tue", "wed", "thu", "fri", "sat"])},
}


class Cron:
    """A standard five-field cron expression (minute hour day-of-month month day-of-week), in a time zone.

    Day-of-month and day-of-week follow the usual rule: when both are restricted, either may match."""

    def __init__(self, expr: str, tz: str = "UTC") -> None:
        fields = expr.split()
        if len(fields) != 5:
            raise ValueError(f"cron {expr!r} must have 5 fields (minute hour day month weekday)")
        self.expr = expr
        self.sets = [self._field(f, i) for i, f in enumerate(fields)]
        self.sets[4] = {d % 7 for d in self.sets[4]}  # 7 is Sunday too
        self.dom_any, self.dow_any = fields[2] == "*", fields[4] == "*"
        try:
            self.tz = ZoneInfo(tz)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {tz!r}") from None

    @staticmethod
    def _field(text: str, index: int) -> set[int]:
        lo, hi = _CRON_RANGES[index]
        hi_ok = 7 if index == 4 else hi
        out: set[int] = set()
        for part in text.lower().split(","):
            body, _, step_text = part.partition("/")
            step = int(step_text) if step_text else 1
            if step < 1:
                raise ValueError(f"cron step must be >= 1 in {text!r}")
            if body == "*":
                a, b = lo, hi
            else:
                a_text, _, b_text = body.partition("-")
                a_val = _NAMES.get(index, {}).get(a_text) if not a_text.isdigit() else int(a_text)
                b_val = (_NAMES.get(index, {}).get(b_text) if not b_text.isdigit() else int(b_text)) if b_text \
                    else (hi if step_text else a_val)
                if a_val is None or b_val is None or not (lo <= a_val <= hi_ok and lo <= b_val <= hi_ok
                                                          and a_val <= b_val):
                    raise ValueError(f"cron field {text!r} is out of range {lo}-{hi}")
                a, b = a_val, b_val
            out.update(range(a, b + 1, step))
        return out

    def matches(self, t: datetime) -> bool:
        minute, hour, dom, month, dow = self.sets
        if t.minute not in minute or t.hour not in hour or t.month not in month:
            return False
        dom_ok, dow_ok = t.day in dom, (t.weekday() + 1) % 7 in dow
        if self.dom_any or self.dow_any:
            return dom_ok and dow_ok
        return dom_ok or dow_ok

    def last_fire(self, now: float, lookback: float) -> float | None:
        """The latest minute at or before `now` (epoch seconds) that matches, searching back `lookback` s."""
        t = datetime.fromtimestamp(now, self.tz).replace(second=0, microsecond=0)
        end = t - timedelta(seconds=lookback + 60)
        while t > end:
            if self.matches(t):
                return t.astimezone(UTC).timestamp()
            t -= timedelta(minutes=1)
        return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _cron_text(v: str) -> str:
    Cron(v)
    return v


class NoWorkers(_Strict):
    trigger: Literal["no_workers"]


class QueueDepth(_Strict):
    trigger: Literal["queue_depth"]
    threshold: int = Field(..., ge=0)


class Latency(_Strict):
    trigger: Literal["latency"]
    max_latency: Duration = Field(..., gt=0)


class UpSchedule(_Strict):
    trigger: Literal["schedule"]
    cron: Annotated[str, BeforeValidator(_cron_text)]
    workers: int = Field(1, ge=0)
    duration: Duration | None = Field(None, gt=0, description="how long the floor holds; default: one poll")


class Idle(_Strict):
    trigger: Literal["idle"]
    timeout: Duration = Field(..., gt=0)


class DownSchedule(_Strict):
    trigger: Literal["schedule"]
    cron: Annotated[str, BeforeValidator(_cron_text)]


ScaleUp = Annotated[NoWorkers | QueueDepth | Latency | UpSchedule, Field(discriminator="trigger")]
ScaleDown = Annotated[Idle | DownSchedule, Field(discriminator="trigger")]


class InstanceSpec(_Strict):
    """What to rent. The provider's own GPU setting wins over `gpu` (GPU names differ per provider)."""

    gpu: str | None = None
    gpu_count: int = Field(1, ge=1, le=16)
    image: str | None = None
    disk_gb: int | None = Field(None, ge=1, le=10_000)
    max_price_per_hour: float | None = Field(None, gt=0)
    handler: str | None = Field(None, description="module:function: start `offload worker --handler` with it")
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("env")
    @classmethod
    def _no_secrets_override(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if name in ("OFFLOAD_TOKEN", "OFFLOAD_SERVER", "OFFLOAD_INSTANCE_ID", "OFFLOAD_QUEUE"):
                raise ValueError(f"{name} is set by the autoscaler and cannot be overridden")
        return v


class AutoscaleSettings(_Strict):
    """One queue's autoscaling policy."""

    enabled: bool = False
    provider: str | None = None
    min_workers: int = Field(0, ge=0)
    max_workers: int | None = Field(None, ge=1)
    poll_interval: Duration = Field(30.0, ge=0.05)
    boot_timeout: Duration = Field(1200.0, gt=0)
    timezone: str = "UTC"
    scale_up: list[ScaleUp] = Field(default_factory=lambda: [NoWorkers(trigger="no_workers")])  # type: ignore[arg-type]
    scale_down: list[ScaleDown] = Field(default_factory=lambda: [Idle(trigger="idle", timeout=600.0)])  # type: ignore[arg-type]
    instance: InstanceSpec = Field(default_factory=lambda: InstanceSpec.model_validate({}))
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

    @model_validator(mode="after")
    def _consistent(self) -> AutoscaleSettings:
        if self.enabled and not self.provider:
            raise ValueError("provider: required when autoscaling is enabled")
        if self.enabled and self.max_workers is None:
            raise ValueError("max_workers: required when autoscaling is enabled (>= 1)")
        if self.max_workers is not None and self.min_workers > self.max_workers:
            raise ValueError(f"min_workers: {self.min_workers} is above max_workers ({self.max_workers})")
        for i, t in enumerate(self.scale_up):
            if isinstance(t, UpSchedule) and self.max_workers is not None and t.workers > self.max_workers:
                raise ValueError(f"scale_up.{i}.workers: {t.workers} is above max_workers ({self.max_workers})")
        return self

    @property
    def limit(self) -> int:
        return self.max_workers or 0

    def crons(self) -> tuple[list[tuple[Cron, UpSchedule]], list[Cron]]:
        up = [(Cron(t.cron, self.timezone), t) for t in self.scale_up if isinstance(t, UpSchedule)]
        down = [Cron(t.cron, self.timezone) for t in self.scale_down if isinstance(t, DownSchedule)]
        return up, down


SEALED = "sealed"  # an instance.env value stored encrypted: {"sealed": "<vault token>"}


def seal_env(block: dict[str, Any], vault: Vault, queue: str) -> dict[str, Any]:
    """The block as stored in Redis: `instance.env` values (HF_TOKEN and the like) encrypted like a provider's
    credentials, so a copy of the database holds none of them."""
    env = (block.get("instance") or {}).get("env") if isinstance(block.get("instance"), dict) else None
    if not isinstance(env, dict) or not env:
        return block
    sealed = {k: {SEALED: vault.encrypt(str(v), f"queue:{queue}:env:{k}")} for k, v in env.items()}
    return {**block, "instance": {**block["instance"], "env": sealed}}


def open_env(block: dict[str, Any], vault: Vault | None, queue: str) -> dict[str, Any]:
    """The stored block with `instance.env` decrypted (VaultError without the master key)."""
    env = (block.get("instance") or {}).get("env") if isinstance(block.get("instance"), dict) else None
    if not isinstance(env, dict) or not any(isinstance(v, dict) for v in env.values()):
        return block
    if vault is None:
        vault = Vault.from_env()
    opened = {k: vault.decrypt(v[SEALED], f"queue:{queue}:env:{k}") if isinstance(v, dict) else v
              for k, v in env.items()}
    return {**block, "instance": {**block["instance"], "env": opened}}


def validate_autoscale(data: Any, where: str = "autoscale") -> AutoscaleSettings:
    """Validate an autoscale block from any source; the error names the field (`where.max_workers: ...`)."""
    try:
        return AutoscaleSettings.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first["loc"] if not str(p).startswith(("function-", "tagged-union"))]
        # the trigger union adds the tag as a path element: keep "scale_up.1.threshold", drop "queue_depth"
        loc = [p for p in loc if p not in ("no_workers", "queue_depth", "latency", "schedule", "idle")]
        msg = first["msg"].removeprefix("Value error, ")
        field = ".".join([where, *loc])
        if ":" in msg and not loc and msg.split(":", 1)[0].isidentifier():  # model-level check names its field
            name, rest = msg.split(":", 1)
            field, msg = f"{where}.{name}", rest.strip()
        raise ConfigError(f"{field}: {msg}") from None


class ServerSide(_Strict):
    """The top-level `autoscaler:` block: what every queue's autoscaling shares.

    `public_url` and `worker_key` are what a rented machine receives (OFFLOAD_PUBLIC_URL and
    OFFLOAD_WORKER_API_KEY override them): a datacenter GPU cannot reach `localhost`, and a third-party host
    must never hold the admin key, so real providers refuse to rent until both are set."""

    public_url: str | None = None
    worker_key: str | None = None
    destroy_orphans: bool = False
    orphan_sweep_interval: Duration = Field(600.0, gt=0)
    tick: Duration = Field(1.0, gt=0, description="how often the loop wakes; each queue runs per its poll_interval")
    leader_ttl: Duration = Field(30.0, gt=0)
    heartbeat_timeout: Duration = Field(300.0, gt=0)
    recent_task: Duration = Field(30.0, ge=0, description="a worker that touched a task this recently is spared")
    drain_settle: Duration = Field(15.0, ge=0, description="after asking a worker to drain, wait this long (a "
                                   "heartbeat or two) before trusting its in-flight count")


def server_side(data: Any, env: dict[str, str] | None = None) -> ServerSide:
    import os

    env = dict(os.environ) if env is None else env
    try:
        out = ServerSide.model_validate(data or {})
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(f"autoscaler.{'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None
    if env.get("OFFLOAD_PUBLIC_URL"):
        out.public_url = env["OFFLOAD_PUBLIC_URL"]
    if env.get("OFFLOAD_WORKER_API_KEY"):
        out.worker_key = env["OFFLOAD_WORKER_API_KEY"]
    return out
