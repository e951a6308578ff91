"""OpenTelemetry traces of a request across its hops: the door, the router, each chain rank,
the KV push and the decode pod (docs/operations.md, "Traces and logs").

Off unless ``--otlp-traces-endpoint`` is given (vLLM's name; ``configure``): then nothing of
the SDK is imported, ``start`` answers None at the cost of one global read, and call sites
skip building attributes when it does. On, each process exports its spans in batches over
OTLP/gRPC under its own service name (``baton-gateway``, ``baton-prefill``, ``baton-decode``).

The context travels as a W3C ``traceparent`` string: from the client (HTTP header or gRPC
metadata), then on whatever goes the request's way next: gRPC metadata on a call of its own
(``Prefill``, ``PushKV``), a field of the message where one call carries many requests
(``Decode.Session``'s commands), and the serialized request a chain broadcasts to its ranks.
Spans may be recorded after the fact with the times they began and ended (``record``): a
decode pod knows a request's first step only once it has happened.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from baton.config import OtlpConfig

TRACEPARENT = "traceparent"  # the W3C header, and the gRPC metadata key (lower case)
_TRACEPARENT_FORMAT = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")

_tracer = None  # an opentelemetry Tracer once configured
_provider = None


def configure(config: OtlpConfig, service_name: str, **resource: Any) -> None:
    """Export this process's spans to ``config.traces_endpoint`` (nothing when it is empty);
    ``resource``: attributes of the process (``baton.rank``, ...)."""
    global _tracer, _provider
    if not config.traces_endpoint:
        return
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise ValueError(f"otlp traces_endpoint {config.traces_endpoint!r} needs the "
                         f"OpenTelemetry SDK: pip install 'baton[tracing]'") from e
    endpoint = config.traces_endpoint
    provider = TracerProvider(resource=Resource.create({"service.name": service_name, **resource}))
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _provider, _tracer = provider, provider.get_tracer("baton")


def enabled() -> bool:
    return _tracer is not None


def shutdown() -> None:
    """Export what is still buffered (a stopping server's last spans) and stop exporting."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def start(name: str, parent: Span | str | None = None, start_s: float | None = None,
          server: bool = False, attributes: dict[str, Any] | None = None) -> Span | None:
    """A span under ``parent`` (a span, a traceparent, or none: a new trace) begun at
    ``start_s`` (``time.monotonic()``; None = now); None when tracing is off. ``server``: the
    span of a call this process serves."""
    if _tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    return _tracer.start_span(name, context=_context(parent),
                              start_time=None if start_s is None else _wall_ns(start_s),
                              kind=SpanKind.SERVER if server else SpanKind.INTERNAL,
                              attributes=attributes)


def end(span: Span | None, end_s: float | None = None, attributes: dict[str, Any] | None = None,
        error: BaseException | None = None) -> None:
    """End ``span`` (None: nothing) at ``end_s`` (monotonic; None = now), adding
    ``attributes`` and the error it ended with."""
    if span is None:
        return
    if attributes:
        span.set_attributes(attributes)
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.end(end_time=None if end_s is None else _wall_ns(end_s))


def record(name: str, parent: Span | str | None, start_s: float, end_s: float,
           attributes: dict[str, Any] | None = None) -> str:
    """A span that already happened (monotonic times); returns its traceparent ("" when
    tracing is off)."""
    span = start(name, parent, start_s, attributes=attributes)
    end(span, end_s)
    return traceparent(span)


def traceparent(span: Span | None) -> str:
    """The W3C traceparent naming ``span`` as the parent ("" for None)."""
    if span is None:
        return ""
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def from_metadata(metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The traceparent among gRPC invocation metadata ("" when absent or malformed)."""
    for key, value in metadata or ():
        if key == TRACEPARENT:
            return checked(value)
    return ""


def checked(value: Any) -> str:
    """``value`` when it is a well-formed W3C traceparent, else "" (a new trace begins)."""
    if isinstance(value, str) and _TRACEPARENT_FORMAT.fullmatch(value.strip().lower()):
        return value.strip().lower()
    return ""


def metadata(parent: str) -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata carrying ``parent`` (None when there is none)."""
    return ((TRACEPARENT, parent),) if parent else None


def _wall_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` reading as wall-clock nanoseconds (what spans carry)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def _context(parent: Span | str | None):
    if parent is None or parent == "":
        return None
    from opentelemetry import trace

    if isinstance(parent, str):
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        return TraceContextTextMapPropagator().extract({TRACEPARENT: parent})
    return trace.set_span_in_context(parent)
