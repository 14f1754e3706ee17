"""The spans of a test process, collected in memory: one SDK TracerProvider per process (the global provider can
be set only once), exporting to `EXPORTER`; `traced()` turns offload's tracing on for a test and off after it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from offload import tracing

EXPORTER = InMemorySpanExporter()


def _install() -> None:
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(EXPORTER))


_install()


@contextmanager
def traced() -> Iterator[None]:
    EXPORTER.clear()
    tracing.configure(enabled=True)
    try:
        yield
    finally:
        tracing.configure(enabled=False)


def spans(name: str | None = None) -> list[ReadableSpan]:
    """The finished spans (of `name`), in the order they ended."""
    return [s for s in EXPORTER.get_finished_spans() if name is None or s.name == name]


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def no_secret(found: list[ReadableSpan], *markers: str) -> None:
    """None of `markers` anywhere in a span (name, attributes, events, status), and no attribute offload does not
    list on one of offload's spans (FastAPI makes its own request spans)."""
    for span in found:
        text = span.to_json()
        assert not [m for m in markers if m in text], text
        if span.name.startswith("offload."):
            assert set(span.attributes or {}) <= tracing.ATTRIBUTES | {"error.type"}, span.attributes
