"""What an operator sees of each operation: its identity in every log line, and (opt-in)
one OpenTelemetry trace from its intake to its outcome and any reconcile.

``Observed`` is the services' observer (``outbox.observer``): the runtime builds the executor
and the reconciler with one (``settled.runtime``), and an app passes one to its intake and
relay (``observer()``). Nothing is patched: a service not given it is simply not observed.

Logs: the executor and the reconciler log an operation by its database id; ``Observed``
makes every such line carry the operation's tenant, op id and kind too
(``outbox.logs.remember``), and the lines written while an operation is being sent or looked
up (the HTTP client's) carry its identity and attempt (``outbox.logs.bound``).

Traces: while tracing is on (``start_tracing``: the environment asks for it; ``instrument``:
a provider of your own), each hook makes its span; which spans and what a span carries (never
the idempotency key): ``settled.tracing``. Off, the hooks make no OpenTelemetry call.

Metrics are not made here: ``settled.metrics`` reads them from the database at scrape time, so
that every process serves the same figures.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session, sessionmaker

from outbox import logs
from outbox.observer import ClaimedBatch, Intake, NoObserver, Report
from settled import tracing

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span

    from outbox.downstream import SubmitOutcome
    from outbox.states import State
    from outbox.storage.claims import Claimed


# -- switching tracing on and off ------------------------------------------------------------


def start_tracing() -> None:
    """Spans when ``tracing.tracing_enabled()`` (an OTLP exporter configured from the
    environment), Celery's included. Idempotent: every Celery app and process calls it."""
    if tracing.tracing_enabled() and tracing.tracer() is None:
        instrument(tracing.provider_from_environment())


def instrument(tracer_provider: TracerProvider | None = None) -> None:
    """Make spans with ``tracer_provider`` (default: the global one), Celery's included."""
    tracing.start(tracer_provider)


def uninstrument() -> None:
    """Stop tracing (tests)."""
    tracing.stop()


def observer(sessions: sessionmaker[Session] | None = None) -> Observed:
    """An app's observer: tracing started as the environment asks (``start_tracing``), and the
    ``Observed`` to pass to ``Outbox.from_settings(..., observer=)`` and
    ``install_relay(..., observer=)``."""
    start_tracing()
    return Observed(sessions)


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


def _remember(claimed: Claimed) -> None:
    logs.remember(claimed.id, tenant=claimed.tenant, op_id=claimed.op_id, kind=claimed.kind)


def _ignore(_: object) -> None:
    return None


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


# -- the observer ----------------------------------------------------------------------------


class Observed(NoObserver):
    """Log identities always, spans while tracing is on (module docstring). ``sessions``: the
    database the claimed operations' stored trace contexts are read from (the runtime's);
    without it, a claim's and a reconcile's spans continue the current context only."""

    def __init__(self, sessions: sessionmaker[Session] | None = None) -> None:
        self.sessions = sessions

    def _stored(self, ids: Sequence[int]) -> dict[int, Any]:
        if self.sessions is None:
            return {}
        return tracing.stored_contexts(self.sessions, ids)

    @contextmanager
    def enqueuing(
        self, session: Session, *, tenant: object, op_id: object, kind: object
    ) -> Iterator[Report[Intake]]:
        tracer = tracing.tracer()
        if tracer is None:
            yield _ignore
            return
        given = {"tenant": tenant, "op_id": op_id, "kind": kind}
        named = {f"settled.{k}": v for k, v in given.items() if isinstance(v, str)}
        with tracer.start_as_current_span("settled.enqueue", attributes=named) as span:

            def enqueued(got: Intake) -> None:
                span.set_attribute("settled.created", got.created)
                if got.id is None:  # a replay of a pruned operation: its row is gone
                    span.set_attribute("settled.pruned", True)
                    return
                span.set_attribute("settled.operation_id", got.id)
                if got.created and span.get_span_context().is_valid:
                    tracing.store_context(session, got.id, span)
                    tracing.intake_contexts.put(got.id, tracing.current())

            yield enqueued

    @contextmanager
    def hinting(self, ids: Sequence[int]) -> Iterator[Report[None]]:
        contexts = [c for c in (tracing.intake_contexts.pop(i) for i in ids) if c is not None]
        if not contexts:
            yield _ignore
            return
        from opentelemetry import context

        token = context.attach(contexts[0])  # the hint continues its first operation's trace
        try:
            yield _ignore
        finally:
            context.detach(token)

    @contextmanager
    def claiming(self, hinted: Sequence[int]) -> Iterator[Report[ClaimedBatch]]:
        started = time.time_ns()

        def claimed(batch: ClaimedBatch) -> None:
            for c in batch.claimed:
                _remember(c)
            tracer = tracing.tracer()
            if tracer is None:
                return
            here = tracing.current()
            stored = self._stored([c.id for c in batch.claimed])
            links: list[Any] = []
            for c in batch.claimed:
                parent = stored.get(c.id, here)
                tracing.parent_contexts.put(c.id, parent)
                links += tracing.link_to(parent)
            span = tracer.start_span(
                "settled.claim",
                context=here,
                start_time=started,
                links=links,
                attributes={
                    "settled.hinted": len(batch.hinted),
                    "settled.claimed": len(batch.claimed),
                    "settled.to_send": len(batch.to_send),
                    "settled.to_recover": len(batch.to_recover),
                },
            )
            span.end()

        yield claimed

    @contextmanager
    def sending(self, claimed: Claimed) -> Iterator[Report[SubmitOutcome]]:
        attempt = {"settled.attempt": claimed.attempts}
        with (
            _operation_span("settled.send", claimed, **attempt) as span,
            logs.bound(attempt=claimed.attempts),
        ):

            def sent(outcome: SubmitOutcome) -> None:
                if span is None:
                    return
                from opentelemetry.trace import StatusCode

                proof = outcome.proof.value
                span.set_attribute("settled.proof", proof)
                if proof in ("unknown", "misuse"):
                    span.set_status(StatusCode.ERROR, proof)

            yield sent

    @contextmanager
    def recording(
        self, outcomes: Sequence[tuple[Claimed, SubmitOutcome]]
    ) -> Iterator[Report[Mapping[int, State]]]:
        tracer = tracing.tracer()
        if tracer is None:
            yield _ignore
            return
        spans = [
            tracer.start_span(
                "settled.record",
                context=tracing.parent_contexts.get(claimed.id),
                attributes={
                    **_identity(claimed),
                    "settled.attempt": claimed.attempts,
                    "settled.proof": outcome.proof.value,
                },
            )
            for claimed, outcome in outcomes
        ]
        written: dict[int, State] = {}
        try:
            yield written.update
        finally:
            for (claimed, _), span in zip(outcomes, spans, strict=True):
                state = written.get(claimed.id)
                span.set_attribute(
                    "settled.state", str(state) if state is not None else "not_written"
                )
                span.end()

    @contextmanager
    def recovering(self, claimed: Claimed) -> Iterator[Report[State | None]]:
        with _operation_span("settled.recover", claimed) as span:

            def recovered(state: State | None) -> None:
                if span is not None and state is not None:
                    span.set_attribute("settled.state", str(state))

            yield recovered

    @contextmanager
    def reconciling(self, claimed: Claimed) -> Iterator[Report[str]]:
        _remember(claimed)
        tracer = tracing.tracer()
        if tracer is None:
            with logs.bound(**_log_fields(claimed)):
                yield _ignore
            return
        here = tracing.current()
        parent = self._stored([claimed.id]).get(claimed.id, here)
        with (
            logs.bound(**_log_fields(claimed)),
            tracer.start_as_current_span(
                "settled.reconcile",
                context=parent,
                links=tracing.link_to(here),  # the pass (beat's task) that looked
                attributes=_identity(claimed),
            ) as span,
        ):
            yield lambda outcome: span.set_attribute("settled.outcome", outcome)
