"""OpenTelemetry (opt-in): whether this process traces, its tracer, and the trace context an
operation carries from its intake to its outcome.

Traces, when enabled (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
or ``SETTLED_TRACING=1``, and not ``OTEL_SDK_DISABLED=true``; the ``tracing`` extra
installed). The OTLP exporter reads the standard ``OTEL_*`` variables. One trace per
operation:

- ``settled.enqueue`` in the app, a child of whatever span the app is in; its context (a W3C
  ``traceparent``, random ids only) is stored on the operation row, in the app's transaction;
- the hint: Celery's ``apply_async``/``run`` spans (opentelemetry-instrumentation-celery),
  the context travelling in the message headers; a hint published by the relay is published
  in the context of its first operation's intake;
- ``settled.claim`` (one per batch, under the task's span), then per operation, as children
  of the stored intake context wherever and whenever they run: ``settled.send``,
  ``settled.record``, ``settled.recover`` (a worker died mid-send), ``settled.reconcile``.

Span attributes name the operation (``settled.tenant``, ``settled.op_id``, ``settled.kind``,
``settled.operation_id``), the attempt, what it proved and the state written. Never the
idempotency key, the params or the payee; Celery's spans carry no task arguments.

The spans are made by the services' observer, ``settled.observe.Observed``, in their hooks
(``outbox.observer``); this module knows OpenTelemetry and where a context is kept, nothing of
the executor or the reconciler. It
imports OpenTelemetry only while tracing is on: the ``tracing`` extra may be absent.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session, sessionmaker

from outbox.storage.traces import store_trace_context, trace_contexts

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

TRACER_NAME = "settled"


def tracing_enabled(environ: dict[str, str] | None = None) -> bool:
    """Whether this process should trace (see the module docstring)."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("SETTLED_TRACING", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    return bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


class _Recent:
    """Values by operation id, the most recent ``size`` of them (thread-safe)."""

    def __init__(self, size: int = 10_000) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._items: OrderedDict[int, Any] = OrderedDict()

    def put(self, key: int, value: Any) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, key: int) -> Any:
        with self._lock:
            return self._items.get(key)

    def pop(self, key: int) -> Any:
        with self._lock:
            return self._items.pop(key, None)


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: the tracer spans are made with, while tracing is on (no OpenTelemetry call otherwise)
        self.tracer: Tracer | None = None
        self.celery: Any = None


_state = _State()

#: intake contexts of operations created in this process, until their hint goes out
intake_contexts = _Recent()
#: the context each claimed operation's spans continue (its intake's, or the claim's)
parent_contexts = _Recent()


# -- on and off ------------------------------------------------------------------------------


def tracer() -> Tracer | None:
    """The tracer to make spans with; None while tracing is off."""
    return _state.tracer


def start(tracer_provider: TracerProvider | None = None) -> None:
    """Trace with ``tracer_provider`` (default: the global one), Celery's spans included."""
    from opentelemetry import trace
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    with _state.lock:
        _state.tracer = trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)
        if _state.celery is None:
            _state.celery = CeleryInstrumentor()  # type: ignore[no-untyped-call]
            _state.celery.instrument(tracer_provider=tracer_provider)


def stop() -> None:
    """Stop tracing, Celery's spans included."""
    with _state.lock:
        if _state.celery is not None:
            _state.celery.uninstrument()
            _state.celery = None
        _state.tracer = None


def provider_from_environment() -> TracerProvider:
    """The global SDK provider, exporting over OTLP/HTTP as the ``OTEL_*`` variables say; one
    ``invalid_setting`` error if OpenTelemetry is not installed."""
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        from outbox.errors import InvalidInput

        raise InvalidInput(
            "tracing is on (SETTLED_TRACING or OTEL_EXPORTER_OTLP_ENDPOINT) but OpenTelemetry"
            " is not installed: pip install 'settled[tracing]'",
            code="invalid_setting",
            setting="SETTLED_TRACING",
        ) from None

    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        return current  # the app configured its own: add to it
    defaults = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: "settled"}
    provider = TracerProvider(resource=Resource.create(defaults))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return provider


# -- contexts --------------------------------------------------------------------------------


def store_context(session: Session, operation_id: int, span: Span) -> None:
    """Store ``span``'s context on the operation's row, in ``session``'s transaction."""
    store_trace_context(session, operation_id, _traceparent(span))


def _traceparent(span: Span) -> str | None:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent")


def stored_contexts(sessions: sessionmaker[Session], ids: Sequence[int]) -> dict[int, Context]:
    """The intake contexts stored on these operations (those enqueued while tracing)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if not ids:
        return {}
    with sessions() as session:
        stored = trace_contexts(session, ids)
    propagator = TraceContextTextMapPropagator()
    return {i: propagator.extract({"traceparent": parent}) for i, parent in stored.items()}


def current() -> Context:
    """The context current in this thread."""
    from opentelemetry import context

    return context.get_current()


def link_to(ctx: Context) -> list[Any]:
    """A link to the span current in ``ctx``, if there is one."""
    from opentelemetry import trace

    span_context = trace.get_current_span(ctx).get_span_context()
    return [trace.Link(span_context)] if span_context.is_valid else []
