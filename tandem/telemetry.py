"""OpenTelemetry tracing, off by default, configured by the standard OTEL_* environment variables.

Enable with `OTEL_TRACES_EXPORTER=otlp` (plus `OTEL_EXPORTER_OTLP_ENDPOINT`, default http://localhost:4318) or
`console` (JSON lines on stdout, handy for debugging). Trace context travels from the gateway to the services in gRPC
metadata (W3C traceparent), so one request is one trace: a span per speculative round, with Propose and Verify
children, each continued by a server span inside the service.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span

TRACER_NAME = "tandem"
_configured = False


def setup_tracing(service_name: str) -> bool:
    """Install a tracer provider if OTEL_TRACES_EXPORTER asks for one; return whether tracing is on."""
    global _configured
    exporters = [e.strip() for e in os.environ.get("OTEL_TRACES_EXPORTER", "none").split(",") if e.strip()]
    if _configured or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true" or exporters in ([], ["none"]):
        return _configured
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
    provider = TracerProvider(resource=resource)
    for name in exporters:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif name == "console":
            exporter = ConsoleSpanExporter(formatter=lambda span: span.to_json(indent=None) + "\n")
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        elif name != "none":
            raise ValueError(f"OTEL_TRACES_EXPORTER: unsupported exporter {name!r} (use otlp, console or none)")
    trace.set_tracer_provider(provider)
    _configured = True
    return True


@functools.cache
def tracer() -> trace.Tracer:
    """tandem's tracer, looked up once: get_tracer reads the environment on every call (~8% of the gateway's time
    per round, measured with py-spy). Caching is safe: before a provider is installed this is a proxy that
    follows it, and the global provider can be set only once."""
    return trace.get_tracer(TRACER_NAME)


def tracing_on() -> bool:
    """Whether this process has a tracer provider (setup_tracing's, or one a test installs): without one every span
    is a no-op. Cheap enough to ask per call (a global and an environment lookup)."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def carrier_for(span: Span) -> dict[str, str]:
    """W3C trace context making `span` the parent of the server's span (empty when not recording)."""
    carrier: dict[str, str] = {}
    if span.is_recording():
        propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def metadata_for(span: Span) -> Sequence[tuple[str, str]] | None:
    """gRPC metadata carrying `span` as the parent of the server's span (None when not recording)."""
    carrier = carrier_for(span)
    return tuple(carrier.items()) if carrier else None


def context_from_metadata(metadata: Sequence[tuple[str, str | bytes]] | None) -> otel_context.Context:
    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    return propagate.extract(carrier)
