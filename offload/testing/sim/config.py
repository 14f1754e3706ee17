"""What the simulator does: one `SimConfig`, loadable from YAML/JSON, CLI flags or `POST /_sim/config`.

Behaviour is set once in `default` and overridden per route family in `families`; an override names only the
fields it changes (pydantic's `model_fields_set`), so `families: {fal: {fail_rate: 0.5}}` keeps every other
default. Times are seconds. A remote job's queue delay and running time are drawn once, at submit, from the
`queue_delay` and `latency` distributions, so a job's whole timeline is fixed the moment it exists: status is
computed from timestamps, which is what lets one core serve ~10k jobs in flight.
"""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, model_validator

from offload.schema import Strict

Family = Literal["jobs", "runpod", "replicate", "fal", "openai", "anthropic", "pods", "vastai"]
FAMILIES: tuple[Family, ...] = ("jobs", "runpod", "replicate", "fal", "openai", "anthropic", "pods", "vastai")
Op = Literal["submit", "status", "result", "cancel"]
ALL_OPS: list[Op] = ["submit", "status", "result", "cancel"]

_RANGE = re.compile(r"^\s*([0-9.]+)\s*(?:-|\.\.)\s*([0-9.]+)\s*$")
_LOGNORMAL = re.compile(r"^\s*(?:lognormal|ln):([0-9.]+)(?::([0-9.]+))?(?::([0-9.]+))?\s*$")


class Latency(Strict):
    """A duration distribution. Also accepts shorthands: `2` (fixed), `"1-3"` (uniform),
    `"lognormal:2:0.5[:30]"` (median, sigma, optional cap)."""

    kind: Literal["fixed", "uniform", "lognormal"] = "fixed"
    seconds: float = Field(default=1.0, ge=0)
    min: float = Field(default=0.0, ge=0)
    max: float | None = Field(default=None, ge=0, description="uniform upper bound; lognormal cap")
    median: float = Field(default=1.0, gt=0)
    sigma: float = Field(default=0.5, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError("latency must be a number, a range 'a-b', 'lognormal:median:sigma' or an object")
        if isinstance(value, int | float):
            return {"kind": "fixed", "seconds": float(value)}
        if isinstance(value, str):
            return parse_latency(value)
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Latency:
        if self.kind == "uniform" and (self.max is None or self.max < self.min):
            raise ValueError("uniform latency needs max >= min")
        return self

    def sample(self, rng: random.Random) -> float:
        """One draw; lognormal is parameterised by its median because that is the number people know."""
        if self.kind == "fixed":
            return self.seconds
        if self.kind == "uniform":
            assert self.max is not None
            return rng.uniform(self.min, self.max)
        value = rng.lognormvariate(math.log(self.median), self.sigma)
        return min(value, self.max) if self.max is not None else value


def parse_latency(text: str) -> dict[str, Any]:
    """The CLI/shorthand grammar: `2`, `1-3` / `1..3`, `lognormal:median[:sigma[:cap]]`."""
    text = text.strip()
    if m := _RANGE.match(text):
        return {"kind": "uniform", "min": float(m[1]), "max": float(m[2])}
    if m := _LOGNORMAL.match(text):
        out: dict[str, Any] = {"kind": "lognormal", "median": float(m[1])}
        if m[2]:
            out["sigma"] = float(m[2])
        if m[3]:
            out["max"] = float(m[3])
        return out
    try:
        return {"kind": "fixed", "seconds": float(text)}
    except ValueError:
        raise ValueError(f"bad latency {text!r}: use 2, 1-3 or lognormal:2:0.5") from None


class OutageWindow(Strict):
    """A time range (seconds after the config was applied) in which every request of the family fails.
    `mode` 503 answers with the family's 503 body; `reset` drops the TCP connection (RST) without a response;
    `429` answers every request with the family's 429 (a rate-limit storm)."""

    start: float = Field(default=0.0, ge=0)
    end: float | None = Field(default=None, description="None: until the config is replaced")
    mode: Literal["503", "reset", "429"] = "503"


class Behaviour(Strict):
    """How one route family behaves. Rates are probabilities per request (faults) or per job (fail_rate)."""

    latency: Latency = Field(default_factory=lambda: Latency(seconds=1.0))
    queue_delay: Latency = Field(default_factory=lambda: Latency(seconds=0.0))
    fail_rate: float = Field(default=0.0, ge=0, le=1, description="share of jobs that end failed")
    error_message: str = "Simulated failure"
    rate_429: float = Field(default=0.0, ge=0, le=1)
    retry_after_header: bool = Field(default=True, description="send Retry-After on 429s")
    retry_after_seconds: float = Field(default=1.0, ge=0, description="header value and body hint")
    retry_after_format: Literal["seconds", "http-date"] = "seconds"
    malformed_rate: float = Field(default=0.0, ge=0, le=1, description="share of 2xx bodies that are garbage")
    malformed_kind: Literal["mixed", "invalid_json", "missing_fields"] = "mixed"
    error_rate: float = Field(default=0.0, ge=0, le=1, description="share of requests answered with a 5xx")
    error_statuses: list[Annotated[int, Field(ge=500, le=599)]] = Field(
        default_factory=lambda: [500, 502, 503], min_length=1, description="the 5xx codes error_rate draws from"
    )
    submit_latency: Latency = Field(
        default_factory=lambda: Latency(seconds=0.0),
        description="how long a submit (or a machine rental) takes to answer once it is done (a slow API)",
    )
    lost_response_rate: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="share of submits (and provider batch creates) that create the job, then reset the connection "
        "instead of answering",
    )
    gateway_error_rate: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="share of submits that create the job, then answer a gateway's 5xx page instead (nginx, an ALB, "
        "Cloudflare in front of the API: the provider took it, the client cannot tell)",
    )
    gateway_statuses: list[Annotated[int, Field(ge=500, le=599)]] = Field(
        default_factory=lambda: [502, 504, 524], min_length=1, description="the 5xx codes gateway_error_rate draws from"
    )
    status_lag: float = Field(
        default=0.0, ge=0, description="seconds after its submit during which a job's status and result answer 404"
    )
    output_bytes: int = Field(
        default=0, ge=0, le=4 * 2**30, description="padding added to every succeeded output (a huge answer)"
    )
    cancel_error: int | None = Field(
        default=None,
        ge=400,
        le=599,
        description="answer every cancel with this status, cancelling nothing (405: an API without the route)",
    )
    faults_on: list[Op] = Field(default_factory=lambda: list(ALL_OPS), description="ops that 429/malformed hit")
    outages: list[OutageWindow] = Field(default_factory=list)
    result_ttl: float | None = Field(
        default=1800.0,
        ge=0,
        description="seconds after a job ends until it 404s (RunPod keeps /run results 30 min); null: forever",
    )
    expiry_mode: Literal["404", "data_removed"] = Field(
        default="404",
        description="replicate only: data_removed keeps the prediction but nulls output/input",
    )
    files_per_job: int = Field(default=1, ge=0, le=100)
    file_type: Literal["png", "txt", "json", "bin"] = "png"
    file_size: int = Field(default=1024, ge=0, le=64 * 1024 * 1024, description="bytes of a .bin file")


class Offer(Strict):
    """A Vast.ai offer (a machine for rent); RunPod pods draw from the same hosts."""

    id: int
    gpu_name: str = "RTX 4090"
    num_gpus: int = 1
    dph_total: float = 0.40
    machine_id: int = 1000
    geolocation: str = "Oregon, US"
    reliability2: float = 0.99
    verified: bool = True
    inet_down: float = 800.0
    cuda_max_good: float = 12.8
    disk_space: float = 200.0
    min_bid: float | None = Field(default=None, ge=0, description="lowest interruptible bid (default: dph_total / 2)")


def _default_offers() -> list[Offer]:
    rows = [
        (0.35, 1001, "Quebec, CA"),
        (0.31, 1002, "Shanghai, CN"),
        (0.42, 1003, "Oregon, US"),
        (0.38, 1004, "Bavaria, DE"),
        (0.55, 1005, "Texas, US"),
        (0.29, 1006, "Lagos, NG"),
    ]
    offers = [Offer(id=5000 + i, dph_total=p, machine_id=m, geolocation=g) for i, (p, m, g) in enumerate(rows)]
    offers[5].verified = False
    return offers


class MachineSim(Strict):
    """The GPU-rental side (RunPod pods, Vast.ai instances): what is for rent and how machines misbehave."""

    boot_seconds: float = Field(default=1.0, ge=0, description="created -> running")
    runpod_gpus: dict[str, float] = Field(
        default_factory=lambda: {
            "NVIDIA GeForce RTX 4090": 0.69,
            "NVIDIA RTX A5000": 0.36,
            "NVIDIA GeForce RTX 3090": 0.43,
        },
        description="RunPod GPU ids for rent and their price per hour",
    )
    out_of_stock: list[str] = Field(default_factory=list, description="RunPod GPU ids with no capacity")
    runpod_place_on: list[str] = Field(
        default_factory=list,
        description="hosts (machineId) the next RunPod pods land on, one per pod in order, then the usual spread "
        "(a create cannot refuse a host)",
    )
    runpod_billed: dict[str, float] = Field(
        default_factory=dict,
        description="RunPod GPU ids whose new on-demand pods report this costPerHr instead of the listed price",
    )
    offers: list[Offer] = Field(default_factory=_default_offers)
    offer_taken: list[int] = Field(default_factory=list, description="offers that are gone when rented (no_such_ask)")
    broken_hosts: list[str] = Field(default_factory=list, description="machine ids that never start the container")
    preempt_after: float | None = Field(default=None, ge=0, description="running machines vanish after this")
    runpod_spot_gpus: dict[str, float] = Field(
        default_factory=dict,
        description="RunPod minimum bid per GPU and hour for interruptible pods (default: half the on-demand price)",
    )
    spot_preempt_after: float | None = Field(
        default=None,
        ge=0,
        description="running interruptible machines are "
        "pre-empted after this (RunPod: EXITED; Vast.ai: outbid, stopped)",
    )
    destroy_failures: int = Field(default=0, ge=0, description="the next N destroy calls answer 500")
    create_errors: int = Field(default=0, ge=0, description="the next N create/rent calls answer 503, renting nothing")
    create_lost: int = Field(
        default=0, ge=0, description="the next N create/rent calls rent the machine, then drop the connection"
    )
    rest_disabled: bool = Field(default=False, description="RunPod REST pod routes answer 404 (GraphQL only)")


class BatchSim(Strict):
    """The provider batch APIs (OpenAI's Batch API, Anthropic's Message Batches): how long a batch runs, which of
    its lines fail, when it expires, and the providers' size limits. A batch's timeline is fixed when it is
    created, as a job's is: its lines finish one after another, evenly spread over `seconds`."""

    validate_seconds: float = Field(default=0.0, ge=0, description="OpenAI: created -> in_progress (validating)")
    seconds: float = Field(default=1.0, ge=0, description="in progress -> every line done")
    finalize_seconds: float = Field(default=0.0, ge=0, description="OpenAI: last line done -> completed")
    cancel_seconds: float = Field(default=0.0, ge=0, description="a cancel asked -> the batch ended (cancelling)")
    cancel_after: float | None = Field(
        default=None, gt=0, description="seconds after its create the provider cancels a batch itself (mid-way)"
    )
    expire_after: float = Field(
        default=86_400.0, gt=0, description="seconds after its create a batch expires: its unfinished lines expire"
    )
    fail_rate: float = Field(
        default=0.0, ge=0, le=1, description="share of lines that fail (on top of the family's fail_rate)"
    )
    openai_max_requests: int = Field(default=50_000, ge=1, description="lines in one OpenAI batch input file")
    openai_max_file_bytes: int = Field(default=200 * 2**20, ge=1, description="bytes of one OpenAI batch file")
    anthropic_max_requests: int = Field(default=100_000, ge=1, description="requests in one Message Batch")
    anthropic_max_bytes: int = Field(default=256 * 2**20, ge=1, description="bytes of one Message Batch create")


class SimConfig(Strict):
    """The whole simulator. `families` holds partial overrides of `default`."""

    seed: int | None = None
    api_key: str | None = Field(default=None, description="None: any non-empty credential is accepted")
    public_url: str | None = Field(default=None, description="base of returned URLs; default: the request's")
    fal_prefix: str = Field(default="", description="mount fal's queue routes under this path, e.g. /fal")
    max_wait: float = Field(default=60.0, ge=0, description="cap for Prefer: wait and /runsync holds")
    honour_idempotency_key: bool = Field(
        default=True, description="a submit repeating an Idempotency-Key gets the first answer, no new job"
    )
    idempotency_ttl: float = Field(default=86_400.0, gt=0, description="seconds a key is remembered")
    default: Behaviour = Field(default_factory=Behaviour)
    families: dict[Family, Behaviour] = Field(default_factory=dict)
    machines: MachineSim = Field(default_factory=MachineSim)
    batches: BatchSim = Field(default_factory=BatchSim)

    @model_validator(mode="after")
    def _prefix(self) -> SimConfig:
        prefix = self.fal_prefix.strip("/")
        self.fal_prefix = f"/{prefix}" if prefix else ""
        return self

    def behaviour(self, family: Family) -> Behaviour:
        """`default` with the family's explicitly set fields on top."""
        override = self.families.get(family)
        if override is None:
            return self.default
        return self.default.model_copy(update={k: getattr(override, k) for k in override.model_fields_set})

    @classmethod
    def load(cls, path: str | Path) -> SimConfig:
        """YAML or JSON (YAML is a superset; `.json` files go through json for exact error positions)."""
        p = Path(path)
        text = p.read_text()
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
        return cls.model_validate(data or {})

    def with_default(self, **changes: Any) -> SimConfig:
        """A copy with some `default` fields replaced (validated), for CLI shortcut flags."""
        if not changes:
            return self
        merged = {**self.default.model_dump(exclude_unset=True), **changes}
        data = self.model_dump(exclude_unset=True)
        data["default"] = merged
        return SimConfig.model_validate(data)

    def merged(self, changes: dict[str, Any]) -> SimConfig:
        """This config with `changes` deep-merged into it (what `POST /_sim/config?merge=true` does)."""
        return SimConfig.model_validate(_deep_merge(self.model_dump(mode="json", exclude_unset=True), changes))

    def public_dump(self) -> dict[str, Any]:
        """What `GET /_sim/config` shows: the config as given plus each family's effective behaviour."""
        return {
            "config": self.model_dump(mode="json", exclude_unset=True),
            "effective": {f: self.behaviour(f).model_dump(mode="json") for f in FAMILIES},
        }


_DISTRIBUTIONS = ("latency", "queue_delay", "submit_latency")  # replaced whole: a shorthand is not a mapping


def _deep_merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key not in _DISTRIBUTIONS:
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out
