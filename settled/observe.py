"""What an operator sees of each operation: its identity in every log line, and (opt-in)
one OpenTelemetry trace from its intake to its outcome and any reconcile.

Logs: the executor and the reconciler log an operation by its database id; ``install``
makes every such line carry the operation's tenant, op id and kind too
(``outbox.logs.remember``), and the lines written while an operation is being sent or looked
up (the HTTP client's) carry its identity and attempt (``outbox.logs.bound``).

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

How: like OpenTelemetry's own instrumentations, ``install`` wraps the methods that do each
step (``Outbox.enqueue``, ``relay.publish_hints``, ``Executor._claim``, ``_send_one``,
``_record``, ``_recover``, ``Reconciler._reconcile_safely``), so the core modules stay free of
logging and tracing plumbing; ``tests/integration/test_tracing.py`` fails if one of them is
renamed.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import column, select, table, update
from sqlalchemy.orm import Session, sessionmaker

from outbox import logs, relay
from outbox.intake import Enqueued, Outbox
from reconciler.reconcile import Reconciler
from workers.executor import Executor, Sent

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

    from outbox.storage.claims import Claimed

T = TypeVar("T")

TRACER_NAME = "settled"
#: ``operations.trace_context`` (migration 0004), deliberately not on the ORM model: the
#: intake's INSERT ... RETURNING and every other statement stay as they were, tracing or not.
TRACES = table("operations", column("id"), column("trace_context"))


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
        self.originals: dict[tuple[Any, str], Any] = {}
        #: the tracer spans are made with, while tracing is on (no OpenTelemetry call otherwise:
        #: the ``tracing`` extra may be absent)
        self.tracer: Tracer | None = None
        self.celery: Any = None
        #: intake contexts of operations created in this process, until their hint goes out
        self.intake = _Recent()
        #: the context each claimed operation's spans continue (its intake's, or the claim's)
        self.parents = _Recent()


_state = _State()


# -- installing ------------------------------------------------------------------------------


def install() -> None:
    """Identities in log lines, always; spans when ``tracing_enabled()`` (an OTLP exporter
    configured from the environment). Idempotent: every Celery app and process calls it."""
    _patch()
    if tracing_enabled() and _state.tracer is None:
        try:
            provider = _provider_from_environment()
        except ImportError:
            from outbox.errors import InvalidInput

            raise InvalidInput(
                "tracing is on (SETTLED_TRACING or OTEL_EXPORTER_OTLP_ENDPOINT) but OpenTelemetry"
                " is not installed: pip install 'settled[tracing]'",
                code="invalid_setting",
                setting="SETTLED_TRACING",
            ) from None
        instrument(provider)


def instrument(tracer_provider: TracerProvider | None = None) -> None:
    """Make spans with ``tracer_provider`` (default: the global one), Celery's included."""
    from opentelemetry import trace
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    _patch()
    with _state.lock:
        _state.tracer = trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)
        if _state.celery is None:
            _state.celery = CeleryInstrumentor()  # type: ignore[no-untyped-call]
            _state.celery.instrument(tracer_provider=tracer_provider)


def uninstrument() -> None:
    """Stop tracing and restore the wrapped methods (tests)."""
    with _state.lock:
        if _state.celery is not None:
            _state.celery.uninstrument()
            _state.celery = None
        _state.tracer = None
        for (owner, name), original in _state.originals.items():
            setattr(owner, name, original)
        _state.originals.clear()


def _provider_from_environment() -> TracerProvider:
    """The global SDK provider, exporting over OTLP/HTTP as the ``OTEL_*`` variables say."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        return current  # the app configured its own: add to it
    defaults = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: "settled"}
    provider = TracerProvider(resource=Resource.create(defaults))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return provider


def _patch() -> None:
    with _state.lock:
        if _state.originals:
            return
        for owner, name, wrapper in (
            (Outbox, "enqueue", _enqueue),
            (relay, "publish_hints", _publish_hints),
            (Executor, "_claim", _claim),
            (Executor, "_send_one", _send_one),
            (Executor, "_record", _record),
            (Executor, "_recover", _recover),
            (Reconciler, "_reconcile_safely", _reconcile_safely),
        ):
            original = getattr(owner, name)
            _state.originals[(owner, name)] = original
            setattr(owner, name, _wrapping(original, wrapper))


def _wrapping(original: Callable[..., T], wrapper: Callable[..., T]) -> Callable[..., T]:
    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> T:
        return wrapper(original, *args, **kwargs)

    return wrapped


# -- contexts --------------------------------------------------------------------------------


def _identity(claimed: Claimed) -> dict[str, Any]:
    return {
        "settled.operation_id": claimed.id,
        "settled.tenant": claimed.tenant,
        "settled.op_id": claimed.op_id,
        "settled.kind": claimed.kind,
    }


def _log_fields(claimed: Claimed) -> dict[str, Any]:
    return {
        "operation_id": claimed.id,
        "tenant": claimed.tenant,
        "op_id": claimed.op_id,
        "kind": claimed.kind,
    }


def _traceparent(span: Span) -> str | None:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent")


def _stored_contexts(sessions: sessionmaker[Session], ids: Sequence[int]) -> dict[int, Context]:
    """The intake contexts stored on these operations (those enqueued while tracing)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if not ids:
        return {}
    stmt = select(TRACES.c.id, TRACES.c.trace_context).where(
        TRACES.c.id.in_(ids), TRACES.c.trace_context.is_not(None)
    )
    with sessions() as session:
        rows = session.execute(stmt).all()
    propagator = TraceContextTextMapPropagator()
    return {row.id: propagator.extract({"traceparent": row.trace_context}) for row in rows}


def _current() -> Context:
    from opentelemetry import context

    return context.get_current()


def _link_to(ctx: Context) -> list[Any]:
    """A link to the span current in ``ctx``, if there is one."""
    from opentelemetry import trace

    span_context = trace.get_current_span(ctx).get_span_context()
    return [trace.Link(span_context)] if span_context.is_valid else []


@contextmanager
def _operation_span(name: str, claimed: Claimed, **attributes: Any) -> Iterator[Span | None]:
    """A span of one operation, continuing its trace (None while tracing is off), with the
    operation's identity bound to the log lines written inside."""
    with logs.bound(**_log_fields(claimed)):
        if _state.tracer is None:
            yield None
            return
        with _state.tracer.start_as_current_span(
            name,
            context=_state.parents.get(claimed.id),
            attributes={**_identity(claimed), **attributes},
        ) as span:
            yield span


# -- the wrappers ----------------------------------------------------------------------------


def _enqueue(
    original: Callable[..., Enqueued], self: Outbox, session: Session, **kw: Any
) -> Enqueued:
    tracer = _state.tracer
    if tracer is None:
        return original(self, session, **kw)
    named = {
        f"settled.{k}": kw[k] for k in ("tenant", "op_id", "kind") if isinstance(kw.get(k), str)
    }
    with tracer.start_as_current_span("settled.enqueue", attributes=named) as span:
        got = original(self, session, **kw)
        span.set_attribute("settled.created", got.created)
        span.set_attribute("settled.operation_id", got.operation.id)
        if got.created and span.get_span_context().is_valid:
            session.execute(
                update(TRACES)
                .where(TRACES.c.id == got.operation.id)
                .values(trace_context=_traceparent(span))
            )
            _state.intake.put(got.operation.id, _current())
        return got


def _publish_hints(
    original: Callable[..., int], publish: relay.Publish, ids: Iterable[int], **kw: Any
) -> int:
    todo = list(ids)
    contexts = [c for c in (_state.intake.pop(i) for i in todo) if c is not None]
    if not contexts:
        return original(publish, todo, **kw)
    from opentelemetry import context

    token = context.attach(contexts[0])  # the hint continues its first operation's trace
    try:
        return original(publish, todo, **kw)
    finally:
        context.detach(token)


def _claim(original: Callable[..., Any], self: Executor, ids: Sequence[int], extra: int) -> Any:
    started = time.time_ns()
    result = original(self, ids, extra)
    to_send, to_recover, blocked, _written = result
    claimed = [c for c, _ in to_send] + list(to_recover) + [c for c, _ in blocked]
    for c in claimed:
        logs.remember(c.id, tenant=c.tenant, op_id=c.op_id, kind=c.kind)
    tracer = _state.tracer
    if tracer is None:
        return result
    here = _current()
    stored = _stored_contexts(self.sessions, [c.id for c in claimed])
    links: list[Any] = []
    for c in claimed:
        parent = stored.get(c.id, here)
        _state.parents.put(c.id, parent)
        links += _link_to(parent)
    span = tracer.start_span(
        "settled.claim",
        context=here,
        start_time=started,
        links=links,
        attributes={
            "settled.hinted": len(ids),
            "settled.claimed": len(claimed),
            "settled.to_send": len(to_send),
            "settled.to_recover": len(to_recover),
        },
    )
    span.end()
    return result


def _send_one(original: Callable[..., Sent], self: Executor, claimed: Claimed, *args: Any) -> Sent:
    attempt = {"settled.attempt": claimed.attempts}
    with _operation_span("settled.send", claimed, **attempt) as span:
        with logs.bound(attempt=claimed.attempts):
            sent = original(self, claimed, *args)
        if span is not None:
            from opentelemetry.trace import StatusCode

            proof = sent.outcome.proof.value
            span.set_attribute("settled.proof", proof)
            if proof in ("unknown", "misuse"):
                span.set_status(StatusCode.ERROR, proof)
        return sent


def _record(original: Callable[..., Any], self: Executor, batch: list[Sent]) -> Any:
    tracer = _state.tracer
    if tracer is None:
        return original(self, batch)
    spans = [
        tracer.start_span(
            "settled.record",
            context=_state.parents.get(sent.claimed.id),
            attributes={
                **_identity(sent.claimed),
                "settled.attempt": sent.claimed.attempts,
                "settled.proof": sent.outcome.proof.value,
            },
        )
        for sent in batch
    ]
    written: dict[int, Any] = {}
    try:
        written = original(self, batch)
        return written
    finally:
        for sent, span in zip(batch, spans, strict=True):
            state = written.get(sent.claimed.id)
            span.set_attribute("settled.state", str(state) if state is not None else "not_written")
            span.end()


def _recover(original: Callable[..., Any], self: Executor, claimed: Claimed, *args: Any) -> Any:
    with _operation_span("settled.recover", claimed) as span:
        written = original(self, claimed, *args)
        if span is not None and claimed.id in written:
            span.set_attribute("settled.state", str(written[claimed.id]))
        return written


def _reconcile_safely(
    original: Callable[..., str], self: Reconciler, claimed: Claimed, *args: Any
) -> str:
    logs.remember(claimed.id, tenant=claimed.tenant, op_id=claimed.op_id, kind=claimed.kind)
    tracer = _state.tracer
    if tracer is None:
        with logs.bound(**_log_fields(claimed)):
            return original(self, claimed, *args)
    here = _current()
    parent = _stored_contexts(self.sessions, [claimed.id]).get(claimed.id, here)
    with (
        logs.bound(**_log_fields(claimed)),
        tracer.start_as_current_span(
            "settled.reconcile",
            context=parent,
            links=_link_to(here),  # the pass (beat's task) that looked
            attributes=_identity(claimed),
        ) as span,
    ):
        outcome = original(self, claimed, *args)
        span.set_attribute("settled.outcome", outcome)
        return outcome
