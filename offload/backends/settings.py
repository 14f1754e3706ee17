"""`backends.<name>` of offload.yaml: one model per backend kind, discriminated by `kind`.

Each model holds every setting its kind reads, typed, with its default, so a typo such as `endpoint_Id` is an
error naming `backends.<name>.endpoint_Id` instead of a default nobody chose, and a backend is built from the
typed object (`from_settings`) without reading or checking anything again. Imports no HTTP stack, so offload.yaml
is read without the `worker` extra.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, Self, TypedDict
from urllib.parse import quote

from pydantic import Discriminator, Field, SecretStr, Tag, field_validator, model_validator

from offload.schema import NonEmpty, Strict, http_url, parse_rate

DEFAULT_MAX_CONNECTIONS = 512
DEFAULT_TIMEOUT = 30.0
DEFAULT_MAX_RESPONSE_BYTES = 8 * 2**20  # JSON answers: a large output belongs in files
DEFAULT_NOT_FOUND_GRACE_S = 30.0
OPENAI_BASE = "https://api.openai.com/v1"
OPENAI_PATH = "/chat/completions"
OPENAI_TIMEOUT = 600.0  # the OpenAI SDK's: a long completion is slow, not broken
RUNPOD_BASE = "https://api.runpod.ai/v2"
REPLICATE_BASE = "https://api.replicate.com/v1"
REPLICATE_FIND_PAGES = 3
FAL_BASE = "https://queue.fal.run"
FAL_JWKS_URL = "https://rest.alpha.fal.ai/.well-known/jwks.json"
ANTHROPIC_BASE = "https://api.anthropic.com"
# The providers' documented batch limits (OpenAI's Batch guide; Anthropic's Message Batches guide): requests and
# bytes per batch (OpenAI: the input file; Anthropic: the create body). offload.backends.batch reads them here.
BATCH_MAX_REQUESTS = {"openai": 50_000, "anthropic": 100_000}
BATCH_MAX_BYTES = {"openai": 200 * 2**20, "anthropic": 256 * 2**20}
BATCH_DURATION_S = 3600.0  # a batch's expected run time until one is measured (the providers promise 24 h)
_HOST = re.compile(r"\.?[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*")  # a name, .suffix or IP


class HttpOptions(TypedDict):
    """The keyword arguments every HttpBackend takes from its settings."""

    base_url: str
    api_key: str | None
    timeout: float
    max_connections: int
    max_response_bytes: int


class HealthSettings(Strict):
    """When a backend of a routed queue cools down (offload/queue/backend_health.py): `failures` 5xx answers,
    timeouts or 429s within `window_s` open it for `cool_down_s` (a longer Retry-After wins); then one probe job
    may go, and a probe that fails opens it again for twice as long, up to `max_cool_down_s`. A queue's `health:`
    sets them for its backends; a backend's own `health:` overrides the fields it names."""

    failures: int = Field(5, ge=1, description="errors within window_s that open the backend")
    window_s: float = Field(60.0, gt=0, description="the window the errors are counted in")
    cool_down_s: float = Field(30.0, gt=0, description="how long an opened backend is skipped (first time)")
    max_cool_down_s: float = Field(600.0, gt=0, description="the longest cool-down after failed probes")

    def over(self, base: HealthSettings) -> HealthSettings:
        """`base` with the fields this block names replaced (a backend's own block over its queue's)."""
        return base.model_copy(update={k: getattr(self, k) for k in self.model_fields_set})


class _Backend(Strict):
    """Settings common to every kind. The worker reads `rate_limit` and the prices; the backend the rest."""

    base_url: str
    api_key: SecretStr | None = Field(None, description="None: a placeholder credential, which the simulator accepts")
    timeout: float = Field(DEFAULT_TIMEOUT, gt=0, description="seconds per request")
    max_connections: int = Field(DEFAULT_MAX_CONNECTIONS, ge=1, description="only used when no client is shared")
    max_response_bytes: int = Field(
        DEFAULT_MAX_RESPONSE_BYTES,
        ge=1024,
        description="the longest answer read from the provider; a job whose answer is longer is dead with the reason",
    )
    not_found_grace_s: float = Field(
        DEFAULT_NOT_FOUND_GRACE_S,
        ge=0,
        description="a 404 for a remote job no poll or webhook has found yet is the provider's status lagging its "
        "submit, not expiry, until this long after the submit (at most the queue's poll_timeout)",
    )
    resubmit_on_timeout: bool = Field(
        False,
        description="a remote job still running at poll_timeout that this backend cannot cancel is submitted again "
        "(a second paid run, counted as a possible duplicate) instead of ending the job dead",
    )
    allow_private_hosts: bool = Field(
        False,
        description="output files may be copied from loopback, private (RFC 1918, CGNAT) and ULA addresses too: "
        "a local stack or a self-hosted provider (files on base_url's own host are, without it); link-local and "
        "cloud metadata addresses never",
    )
    file_hosts: list[NonEmpty] | None = Field(
        None,
        description="copy output files only from these hosts (exact, or `.suffix` for its subdomains), every "
        "redirect hop included; URLs on other hosts are left as they are",
    )
    rate_limit: str | None = None
    price_per_job: float | None = Field(None, ge=0)
    price_per_second: float | None = Field(None, ge=0)
    max_job_cost: float | None = Field(
        None, ge=0, description="the most one submission may cost (USD): reserved against daily_spend_cap first"
    )
    expected_run_s: float | None = Field(
        None,
        gt=0,
        description="a routed queue: the seconds a job is expected to take here (queue delay and run) until the "
        "workers have measured it; a job's deadline is routed by it",
    )
    health: HealthSettings | None = Field(
        None, description="a routed queue: this backend's cool-down thresholds, over the queue's `health:`"
    )
    # Webhooks, for the kinds whose providers call back (replicate, fal, runpod), used when `server.public_url`
    # is set (see docs/how-to/webhooks.md); read by the server and the worker, never sent to the provider.
    webhook_secret: SecretStr | None = Field(
        None,
        repr=False,
        description="replicate: the account's webhook signing secret (whsec_...), GET /v1/webhooks/default/secret",
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

    @field_validator("base_url", "webhook_url", check_fields=False)
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        return http_url(v)

    @field_validator("api_key")
    @classmethod
    def _key(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and not v.get_secret_value().strip():
            raise ValueError("must be a non-empty string (is its environment variable set?)")
        return v

    @field_validator("file_hosts")
    @classmethod
    def _hosts(cls, v: list[str] | None) -> list[str] | None:
        for host in v or ():
            if not _HOST.fullmatch(host):
                raise ValueError(f"{host!r} is not a host name or address (no scheme, port or path), e.g. .fal.media")
        return [h.lower() for h in v] if v is not None else None

    @field_validator("rate_limit")
    @classmethod
    def _rate(cls, v: str | None) -> str | None:
        if v is not None:
            parse_rate(v)
        return v

    def http(self) -> HttpOptions:
        """What HttpBackend takes; the key is revealed only here, on its way to the provider."""
        key = self.api_key.get_secret_value().strip() if self.api_key else None
        return {
            "base_url": self.base_url,
            "api_key": key,
            "timeout": self.timeout,
            "max_connections": self.max_connections,
            "max_response_bytes": self.max_response_bytes,
        }

    def console_url(self, remote_id: str) -> str | None:
        """A page of the provider's web console for one remote job, where the provider has one built from its id
        alone (no secret in it); None for the others."""
        del remote_id
        return None


class HttpJobSettings(_Backend):
    """The tutorial's job API. `cancel: false` for providers without the cancel route (a 404 or 405 from the
    route is taken the same way: that remote job may still run)."""

    kind: Literal["http-job"] = "http-job"
    cancel: bool = True


class OpenAISettings(_Backend):
    kind: Literal["openai"] = "openai"
    base_url: str = OPENAI_BASE
    timeout: float = Field(OPENAI_TIMEOUT, gt=0)
    path: NonEmpty = OPENAI_PATH
    model: NonEmpty | None = Field(None, description="filled into inputs that lack one")
    price_per_million_input_tokens: float | None = Field(None, ge=0)
    price_per_million_output_tokens: float | None = Field(None, ge=0)


class RunPodSettings(_Backend):
    kind: Literal["runpod"] = "runpod"
    base_url: str = RUNPOD_BASE
    endpoint_id: NonEmpty
    webhook_url: str | None = None
    policy: dict[str, Any] | None = Field(None, description="RunPod's policy object (executionTimeout, ttl in ms)")


class ReplicateSettings(_Backend):
    """Exactly one of `version`, `model` (owner/name) and `deployment` (owner/name)."""

    kind: Literal["replicate"] = "replicate"
    base_url: str = REPLICATE_BASE
    version: NonEmpty | None = None
    model: NonEmpty | None = None
    deployment: NonEmpty | None = None
    webhook_url: str | None = None
    tag_input_key: NonEmpty | None = None
    find_pages: int = Field(REPLICATE_FIND_PAGES, ge=1)

    @model_validator(mode="after")
    def _target(self) -> Self:
        targets = [t for t in (self.version, self.model, self.deployment) if t]
        if len(targets) != 1:
            raise ValueError("set exactly one of version, model, deployment for kind replicate")
        for key in ("model", "deployment"):
            value = getattr(self, key)
            if value is not None and value.count("/") != 1:
                raise ValueError(f"{key} must look like owner/name, got {value!r}")
        return self

    def console_url(self, remote_id: str) -> str | None:
        """The prediction's page on replicate.com (its `urls.web`): only for Replicate's own API, not a proxy."""
        return f"https://replicate.com/p/{quote(remote_id, safe='')}" if self.base_url == REPLICATE_BASE else None


class FalSettings(_Backend):
    kind: Literal["fal"] = "fal"
    base_url: str = FAL_BASE
    app: NonEmpty = Field(description="owner/app[/subpath] on the queue host")
    webhook_url: str | None = None


class _BatchBackend(_Backend):
    """A provider batch API (docs/how-to/batch-apis.md): jobs are packed, one provider batch per pack. The
    discount is the backend's own price: set `price_per_job` to the batch price, and spend caps count it."""

    provider: ClassVar[str]
    model: NonEmpty | None = Field(None, description="filled into inputs that lack one")
    max_wait_s: float = Field(
        600.0, gt=0, description="how long the first job of a pack waits for more before the pack goes out"
    )
    max_pack: int | None = Field(
        None,
        ge=1,
        description="jobs per pack (default: the provider's count limit); a pack closes at the size limit first",
    )
    max_in_flight: int = Field(
        10_000,
        ge=1,
        description="jobs of this backend one worker holds in packs and batches at once: a pool of its own, "
        "apart from the queue's `concurrency` slots",
    )
    batch_poll_interval_s: float = Field(
        60.0, gt=0, description="the longest pause between two polls of one batch (they back off up to it)"
    )
    expected_duration_s: float = Field(
        BATCH_DURATION_S, gt=0, description="a batch's run time the router assumes until one is measured"
    )

    @field_validator("max_pack")
    @classmethod
    def _pack(cls, v: int | None) -> int | None:
        limit = BATCH_MAX_REQUESTS[cls.provider]
        if v is not None and v > limit:
            raise ValueError(f"at most {limit} ({cls.provider}'s requests per batch), got {v}")
        return v

    @property
    def pack_limit(self) -> int:
        return self.max_pack or BATCH_MAX_REQUESTS[self.provider]


class OpenAIBatchSettings(_BatchBackend):
    """OpenAI's Batch API: one JSONL file and one batch per pack; each job's input is a request body of `path`."""

    provider: ClassVar[str] = "openai"
    kind: Literal["openai-batch"] = "openai-batch"
    base_url: str = OPENAI_BASE
    path: NonEmpty = Field("/v1/chat/completions", description="the endpoint every line of a batch calls")


class AnthropicBatchSettings(_BatchBackend):
    """Anthropic's Message Batches: one batch per pack; each job's input is a request's `params`."""

    provider: ClassVar[str] = "anthropic"
    kind: Literal["anthropic-batch"] = "anthropic-batch"
    base_url: str = ANTHROPIC_BASE


BatchSettings = OpenAIBatchSettings | AnthropicBatchSettings
KINDS = ("http-job", "openai", "runpod", "replicate", "fal", "openai-batch", "anthropic-batch")
AnyBackendSettings = (
    HttpJobSettings
    | OpenAISettings
    | RunPodSettings
    | ReplicateSettings
    | FalSettings
    | OpenAIBatchSettings
    | AnthropicBatchSettings
)


def _kind(value: Any) -> str | None:
    kind = value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)
    return kind if isinstance(kind, str) else None


BackendSettings = Annotated[
    Annotated[HttpJobSettings, Tag("http-job")]
    | Annotated[OpenAISettings, Tag("openai")]
    | Annotated[RunPodSettings, Tag("runpod")]
    | Annotated[ReplicateSettings, Tag("replicate")]
    | Annotated[FalSettings, Tag("fal")]
    | Annotated[OpenAIBatchSettings, Tag("openai-batch")]
    | Annotated[AnthropicBatchSettings, Tag("anthropic-batch")],
    Discriminator(
        _kind, custom_error_type="unknown_kind", custom_error_message=f"must be one of {', '.join(map(repr, KINDS))}"
    ),
]
