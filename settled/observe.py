"""What an operator sees of each operation: its identity in every log line, and (opt-in)
one OpenTelemetry trace from its intake to its outcome and any reconcile.

Logs: the executor and the reconciler log an operation by its database id; ``install``
makes every such line carry the operation's tenant, op id and kind too
(``outbox.logs.remember``), and the lines written while an operation is being sent or looked
up (the HTTP client's) carry its identity and attempt (``outbox.logs.bound``).

Traces: when the environment turns tracing on, ``install`` starts it, and each step below
makes its span; which spans, when tracing is on and what a span carries (never the
idempotency key): ``settled.tracing``.

How: like OpenTelemetry's own instrumentations, ``install`` wraps the methods that do each
step (``Outbox.enqueue``, ``relay.publish_hints``, ``Executor._claim``, ``_send_one``,
``_record``, ``_recover``, ``Reconciler._reconcile_safely``), so the core modules stay free of
logging and tracing plumbing; ``tests/integration/test_tracing.py`` fails if one of them is
renamed.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy.orm import Session

from outbox import logs, relay
from outbox.intake import Enqueued, Outbox
from reconciler.reconcile import Reconciler
from settled import tracing
from workers.claiming import Claims
from workers.executor import Executor, Sent

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span

    from outbox.storage.claims import Claimed

T = TypeVar("T")

_lock = threading.Lock()
#: the wrapped methods' originals, by owner and name, while they are wrapped
_originals: dict[tuple[Any, str], Any] = {}


# -- installing ------------------------------------------------------------------------------


def install() -> None:
    """Identities in log lines, always; spans when ``tracing.tracing_enabled()`` (an OTLP
    exporter configured from the environment). Idempotent: every Celery app and process calls
    it."""
    _patch()
    if tracing.tracing_enabled() and tracing.tracer() is None:
        instrument(tracing.provider_from_environment())


def instrument(tracer_provider: TracerProvider | None = None) -> None:
    """Make spans with ``tracer_provider`` (default: the global one), Celery's included."""
    _patch()
    tracing.start(tracer_provider)


def uninstrument() -> None:
    """Stop tracing and restore the wrapped methods (tests)."""
    tracing.stop()
    with _lock:
        for (owner, name), original in _originals.items():
            setattr(owner, name, original)
        _originals.clear()


def _patch() -> None:
    with _lock:
        if _originals:
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
            _originals[(owner, name)] = original
            setattr(owner, name, _wrapping(original, wrapper))


def _wrapping(original: Callable[..., T], wrapper: Callable[..., T]) -> Callable[..., T]:
    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> T:
        return wrapper(original, *args, **kwargs)

    return wrapped


# -- an operation's identity -----------------------------------------------------------------


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


@contextmanager
def _operation_span(name: str, claimed: Claimed, **attributes: Any) -> Iterator[Span | None]:
    """A span of one operation, continuing its trace (None while tracing is off), with the
    operation's identity bound to the log lines written inside."""
    with logs.bound(**_log_fields(claimed)):
        tracer = tracing.tracer()
        if tracer is None:
            yield None
            return
        with tracer.start_as_current_span(
            name,
            context=tracing.parent_contexts.get(claimed.id),
            attributes={**_identity(claimed), **attributes},
        ) as span:
            yield span


# -- the wrappers ----------------------------------------------------------------------------


def _enqueue(
    original: Callable[..., Enqueued], self: Outbox, session: Session, **kw: Any
) -> Enqueued:
    tracer = tracing.tracer()
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
            tracing.store_context(session, got.operation.id, span)
            tracing.intake_contexts.put(got.operation.id, tracing.current())
        return got


def _publish_hints(
    original: Callable[..., int], publish: relay.Publish, ids: Iterable[int], **kw: Any
) -> int:
    todo = list(ids)
    contexts = [c for c in (tracing.intake_contexts.pop(i) for i in todo) if c is not None]
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
    result: Claims = original(self, ids, extra)
    claimed = result.claimed
    for c in claimed:
        logs.remember(c.id, tenant=c.tenant, op_id=c.op_id, kind=c.kind)
    tracer = tracing.tracer()
    if tracer is None:
        return result
    here = tracing.current()
    stored = tracing.stored_contexts(self.sessions, [c.id for c in claimed])
    links: list[Any] = []
    for c in claimed:
        parent = stored.get(c.id, here)
        tracing.parent_contexts.put(c.id, parent)
        links += tracing.link_to(parent)
    span = tracer.start_span(
        "settled.claim",
        context=here,
        start_time=started,
        links=links,
        attributes={
            "settled.hinted": len(ids),
            "settled.claimed": len(claimed),
            "settled.to_send": len(result.send),
            "settled.to_recover": len(result.recover),
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
    tracer = tracing.tracer()
    if tracer is None:
        return original(self, batch)
    spans = [
        tracer.start_span(
            "settled.record",
            context=tracing.parent_contexts.get(sent.claimed.id),
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
    tracer = tracing.tracer()
    if tracer is None:
        with logs.bound(**_log_fields(claimed)):
            return original(self, claimed, *args)
    here = tracing.current()
    parent = tracing.stored_contexts(self.sessions, [claimed.id]).get(claimed.id, here)
    with (
        logs.bound(**_log_fields(claimed)),
        tracer.start_as_current_span(
            "settled.reconcile",
            context=parent,
            links=tracing.link_to(here),  # the pass (beat's task) that looked
            attributes=_identity(claimed),
        ) as span,
    ):
        outcome = original(self, claimed, *args)
        span.set_attribute("settled.outcome", outcome)
        return outcome
