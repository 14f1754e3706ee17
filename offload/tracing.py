"""OpenTelemetry traces, opt-in: one trace per job, from its enqueue through each attempt's provider calls to the
stored result (docs/how-to/tracing.md).

Off unless asked for (OFFLOAD_TRACING=1, or offload.yaml's `tracing: {enabled: true}`): offload then imports
nothing of OpenTelemetry, and every helper here answers with a shared no-op, so the hot path pays one attribute
test. On, it speaks only the OpenTelemetry API and uses the global TracerProvider (the application's, or the one
`opentelemetry-instrument` built from the OTEL_* variables); only `exporter: otlp` or `console` makes offload
install an SDK provider itself, and only where nobody installed one.

The enqueue span's W3C context (`traceparent`) rides in the job record (RECORD_FIELD); each attempt starts a span
under it. A record's value is written by whoever enqueued, so it is read as untrusted: anything that does not
parse (or is too long to be one) starts a fresh trace. Attributes are the fixed set below, never an input, a
URL or a key; error text goes through offload.redact first.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

from offload.env import env_str
from offload.errors import ConfigError
from offload.redact import excerpt

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("offload.tracing")
RECORD_FIELD = "traceparent"  # the job record's field (written by enqueue.lua)
MAX_TRACEPARENT = 128  # a W3C traceparent is 55 characters; a longer value is not read at all
Exporter = Literal["none", "otlp", "console"]
EXPORTERS: tuple[Exporter, ...] = ("none", "otlp", "console")
_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no", "")

# The attribute keys offload sets: a fixed list, so nothing else (an input, a URL, a key) can become one.
QUEUE, JOB_ID, ATTEMPT, BACKEND = "offload.queue", "offload.job.id", "offload.job.attempt", "offload.backend"
REMOTE_ID, OUTCOME, SUBMISSION = "offload.remote_id", "offload.outcome", "offload.submission"
DUPLICATE, LOCATION = "offload.enqueue.duplicate", "offload.result.location"
ATTRIBUTES = frozenset((QUEUE, JOB_ID, ATTEMPT, BACKEND, REMOTE_ID, OUTCOME, SUBMISSION, DUPLICATE, LOCATION))
Value = str | int | bool


class _State:
    """This process's decision (None: not made yet; the first `active()` reads the environment)."""

    on: bool | None = None
    tracer: Tracer | None = None
    propagator: TraceContextTextMapPropagator | None = None
    installed = False


_state = _State()


def _flag(raw: str | None, default: bool) -> bool:
    if raw is None:
        return default
    word = raw.strip().lower()
    if word not in _TRUE + _FALSE:
        raise ConfigError(f"OFFLOAD_TRACING: expected 1 or 0, got {raw!r}")
    return word in _TRUE


def configure(enabled: bool = False, exporter: Exporter = "none") -> bool:
    """Decide whether this process traces: OFFLOAD_TRACING (1/0) over `enabled` (offload.yaml's), and
    OFFLOAD_TRACING_EXPORTER over `exporter`. Returns the decision. Called by the worker and the server at start;
    a producer that never calls it decides on its first enqueue, from the environment alone."""
    on = _flag(env_str("OFFLOAD_TRACING"), enabled)
    chosen = env_str("OFFLOAD_TRACING_EXPORTER", exporter).strip().lower() or "none"
    if chosen not in EXPORTERS:
        raise ConfigError(f"OFFLOAD_TRACING_EXPORTER: expected one of {', '.join(EXPORTERS)}, got {chosen!r}")
    if on:
        from offload.extras import require

        require("otel", "opentelemetry.trace", "tracing")
        from opentelemetry import trace

        if chosen != "none":
            _install(chosen)
        elif isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            log.warning(
                "tracing is on but no TracerProvider is installed: spans are dropped (set tracing.exporter, install "
                "one in the application, or run under opentelemetry-instrument)"
            )
        _state.tracer = trace.get_tracer("offload")
    _state.on = on
    return on


def _install(exporter: str) -> None:
    """An SDK TracerProvider with the exporter, unless one is installed already (the application's wins)."""
    from offload.extras import require

    require("otel", "opentelemetry.sdk", f"tracing.exporter {exporter}")
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    if _state.installed or not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        log.info("tracing: a TracerProvider is installed already; offload uses it as it is")
        return
    chosen: SpanExporter = ConsoleSpanExporter() if exporter == "console" else _otlp()
    provider = TracerProvider()  # resource, sampler and limits from the OTEL_* variables, as the SDK reads them
    provider.add_span_processor(BatchSpanProcessor(chosen))
    trace.set_tracer_provider(provider)
    _state.installed = True


def _otlp() -> Any:
    """The OTLP exporter over HTTP, configured by the OTEL_EXPORTER_OTLP_* variables (endpoint, headers, ...)."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise ConfigError(
            "tracing.exporter otlp needs the OTLP exporter: pip install opentelemetry-exporter-otlp-proto-http"
        ) from None
    return OTLPSpanExporter()


def active() -> bool:
    """Whether this process traces (decided once; see `configure`)."""
    if _state.on is None:
        configure()
    return bool(_state.on)


def _tracer() -> Tracer:
    assert _state.tracer is not None
    return _state.tracer


def _propagator() -> TraceContextTextMapPropagator:
    if _state.propagator is None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        _state.propagator = TraceContextTextMapPropagator()
    return _state.propagator


class _Noop:
    """The face of every span helper while tracing is off: does nothing, costs one call."""

    __slots__ = ()

    def __enter__(self) -> _Noop:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set(self, key: str, value: Value | None) -> None:
        return None


NOOP = _Noop()


class Call:
    """One child span of an attempt (a provider call, the result store); `set` one of ATTRIBUTES. An exception
    leaving the block is recorded on it (its type and redacted text) and passes on."""

    __slots__ = ("_span",)

    def __init__(self, span: Span) -> None:
        self._span = span

    def __enter__(self) -> Call:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is not None and isinstance(exc, Exception):
            _error(self._span, f"{type(exc).__name__}: {exc}", type(exc).__name__)
        self._span.end()

    def set(self, key: str, value: Value | None) -> None:
        _set(self._span, key, value)


def _set(span: Span, key: str, value: Value | None) -> None:
    if key not in ATTRIBUTES:
        raise ValueError(f"{key!r} is not an attribute offload sets")
    if value is not None:
        span.set_attribute(key, value)


def _error(span: Span, text: str, kind: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("error.type", kind)
    span.set_status(Status(StatusCode.ERROR, excerpt(text, limit=200)))


class Attempt:
    """The span of one attempt of a job in a worker, parent of its provider calls (`call`), of the webhook that
    completed it (`mark`) and of the result store. Ended by `end`, with the outcome `outcome` recorded."""

    __slots__ = ("_context", "_outcome", "_recording", "span")

    def __init__(self, span: Span, context: Context) -> None:
        self.span, self._context, self._outcome = span, context, ""
        self._recording = span.is_recording()

    def call(self, name: str, **attributes: Value | None) -> Call | _Noop:
        """A child span, `offload.<name>`, from now until its block ends; none under an attempt the sampler
        dropped (its children would be dropped too, after costing as much to make)."""
        if not self._recording:
            return NOOP
        from opentelemetry.trace import SpanKind

        kind = SpanKind.INTERNAL if name in ("store", "webhook") else SpanKind.CLIENT
        given = {_KEYS[key]: value for key, value in attributes.items() if value is not None}  # (at the start: cheaper)
        return Call(_tracer().start_span(f"offload.{name}", context=self._context, kind=kind, attributes=given))

    def mark(self, name: str, **attributes: Value | None) -> None:
        """A child span of no length: something heard of now (the webhook that carried the result)."""
        with self.call(name, **attributes):
            pass

    def outcome(self, outcome: str, error: str | None = None) -> None:
        """How the attempt ended (`succeeded`, `retry`, `dead`, `cancelled`, ...); an error marks the span."""
        self._outcome = outcome
        self.span.set_attribute(OUTCOME, outcome)
        if error is not None:
            _error(self.span, error, outcome)

    def end(self, backend: str | None, remote_id: str | None, exc: BaseException | None = None) -> None:
        _set(self.span, BACKEND, backend)
        _set(self.span, REMOTE_ID, remote_id)
        if not self._outcome:
            self.span.set_attribute(OUTCOME, "interrupted" if exc is not None else "left")
        self.span.end()


# keyword -> attribute key, for `Attempt.call`'s short names
_KEYS = {"backend": BACKEND, "remote_id": REMOTE_ID, "submission": SUBMISSION, "location": LOCATION}


def call(attempt: Attempt | None, name: str, **attributes: Value | None) -> Call | _Noop:
    """`attempt.call(...)`, or the no-op when the run is not traced."""
    return NOOP if attempt is None else attempt.call(name, **attributes)


def parent_of(traceparent: str | None) -> Context | None:
    """The context a job record's `traceparent` names, or None (none, too long, malformed, all zeros): a record
    is written by whoever enqueued, so its value is parsed, never trusted."""
    if not traceparent or not isinstance(traceparent, str) or len(traceparent) > MAX_TRACEPARENT:
        return None
    from opentelemetry import trace

    try:
        context = _propagator().extract({"traceparent": traceparent})
    except Exception:  # a propagator must not raise; if one does, the job still runs, in a fresh trace
        return None
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def start_attempt(queue: str, job_id: str, attempt: int, traceparent: str | None) -> Attempt:
    """The span of one attempt, a child of the enqueue span its record names (else the root of a fresh trace)."""
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind

    parent = parent_of(traceparent)
    if parent is None:
        parent = otel_context.Context()  # an empty context: a new trace, never the caller's current span
    span = _tracer().start_span(
        "offload.attempt",
        context=parent,
        kind=SpanKind.CONSUMER,
        attributes={QUEUE: queue, JOB_ID: job_id, ATTEMPT: attempt},
    )
    return Attempt(span, trace.set_span_in_context(span))


class Enqueue:
    """The spans of one enqueue call, one per job: their traceparents go into the records (`traceparents`), the
    ids are set once the store answered (`done`). One job is a child of the caller's current span; each job of a
    bulk enqueue starts a trace of its own, linked to that span (one trace per job, as a job's retries and
    provider calls would otherwise pile up in the caller's one trace)."""

    def __init__(self, queue: str, count: int) -> None:
        from opentelemetry import context as otel_context
        from opentelemetry import trace
        from opentelemetry.trace import Link, SpanKind

        tracer, propagator = _tracer(), _propagator()
        parent: Context | None = None
        links: list[Link] = []
        if count > 1:
            parent = otel_context.Context()  # empty: a root
            caller = trace.get_current_span().get_span_context()
            links = [Link(caller)] if caller.is_valid else []
        self.spans = [
            tracer.start_span(
                "offload.enqueue", context=parent, kind=SpanKind.PRODUCER, attributes={QUEUE: queue}, links=links
            )
            for _ in range(count)
        ]
        self.traceparents: list[str | None] = []
        for span in self.spans:
            carrier: dict[str, str] = {}
            propagator.inject(carrier, trace.set_span_in_context(span))
            self.traceparents.append(carrier.get("traceparent"))

    def done(self, sent_ids: Sequence[str], got_ids: Sequence[str]) -> None:
        """Each span names the job it made; an id other than the one sent is an earlier job (an idempotency key
        seen before), whose record keeps its own trace."""
        for span, sent, got in zip(self.spans, sent_ids, got_ids, strict=True):
            span.set_attribute(JOB_ID, got)
            if got != sent:
                span.set_attribute(DUPLICATE, True)

    def end(self, exc: BaseException | None) -> None:
        for span in self.spans:
            if exc is not None:
                _error(span, f"{type(exc).__name__}: {exc}", type(exc).__name__)
            span.end()


@contextmanager
def enqueue_spans(queue: str, count: int) -> Iterator[Enqueue | None]:
    """`Enqueue` for `count` jobs while tracing is on (else None), children of the caller's current span."""
    if not active() or count == 0:
        yield None
        return
    spans = Enqueue(queue, count)
    try:
        yield spans
    except BaseException as exc:
        spans.end(exc)
        raise
    spans.end(None)


@contextmanager
def request_parent(headers: Mapping[str, str]) -> Iterator[None]:
    """Inside the block, the W3C context a request carried (its `traceparent` header) is the current one, so the
    jobs it enqueues join the producer's trace; a missing or malformed header changes nothing, and neither does
    a header when the request has a span already (an instrumented server made it, under that header)."""
    if not active():
        yield
        return
    from opentelemetry import trace

    current = trace.get_current_span().get_span_context().is_valid
    parent = None if current else parent_of(headers.get("traceparent"))
    if parent is None:
        yield
        return
    from opentelemetry import context as otel_context

    token = otel_context.attach(parent)
    try:
        yield
    finally:
        otel_context.detach(token)
