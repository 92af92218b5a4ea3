"""OpenTelemetry traces (``settled.tracing``, made by ``settled.observe.Observed``, the
services' observer): one trace per operation, from its intake through the hint (a real Celery
worker, the context in the message headers), the claim and the send to the recorded outcome,
and any later reconcile; the idempotency key is never an attribute."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import select
from sqlalchemy.orm import sessionmaker

from outbox import logs, relay
from outbox.intake import Outbox
from outbox.settings import Settings
from outbox.states import State
from outbox.storage.traces import TRACES
from settled import celery_app, observe, tracing
from settled.observe import Observed
from tests.support.rig import GOOD, HOLD, Rig
from tests.support.simtools import wait_until


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on, into memory, for this test only."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observe.instrument(provider)
    try:
        yield exporter
    finally:
        observe.uninstrument()
        provider.shutdown()


@pytest.fixture
def logging_restored() -> Iterator[None]:
    """An in-process Celery worker sets up logging for the whole process (the root logger's
    level and handlers, a few environment variables): put them back for the tests after."""
    root = logging.getLogger()
    saved = (root.level, root.handlers[:])
    env = {
        k: os.environ.get(k)
        for k in ("_MP_FORK_LOGLEVEL_", "_MP_FORK_LOGFILE_", "_MP_FORK_LOGFORMAT_")
    }
    try:
        yield
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def observed(rig: Rig) -> Observed:
    """The rig's intake observed as an app's is (its executors and reconcilers are given it)."""
    seen = Observed(rig.sessions)
    rig.outbox = replace(rig.outbox, observer=seen)
    return seen


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def attribute_values(span: ReadableSpan) -> list[Any]:
    values = list((span.attributes or {}).values())
    for event in span.events:
        values += list((event.attributes or {}).values())
    for link in span.links:
        values += list((link.attributes or {}).values())
    return values


def assert_key_never_an_attribute(exporter: InMemorySpanExporter, key: str) -> None:
    for span in exporter.get_finished_spans():
        assert key not in span.name
        for value in attribute_values(span):
            assert key not in str(value), (span.name, value)


@pytest.mark.usefixtures("logging_restored")
@pytest.mark.parametrize("engine", ["sqlite"], indirect=True)
def test_one_trace_from_intake_through_a_celery_hint_to_the_outcome(
    rig: Rig, settings: Settings, outbox: Outbox, tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    from celery.contrib.testing.worker import start_worker

    worker_settings = settings.model_copy(
        update={
            "database_url": str(rig.engine.url),
            "broker_url": "filesystem://",
            "broker_folder": str(tmp_path / "broker"),
            "downstream_url": rig.url,
            "downstream_api_keys": {rig.tenant.name: rig.tenant.api_key},
        }
    )
    app = celery_app.create_app(worker_settings)
    sessions = sessionmaker(rig.engine, expire_on_commit=False)
    app_observer = observe.observer()  # what an app passes to its intake and relay
    outbox = replace(outbox, observer=app_observer)
    relay.install(sessions, celery_app.hint_publisher(app), observer=app_observer)
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=30):
            with sessions.begin() as s:
                got = outbox.enqueue(s, tenant="acme", op_id="op-1", kind="refund", params=GOOD)
                operation_id = got.operation.id
            wait_until(
                lambda: rig.op(operation_id).state == State.SUCCEEDED.value,
                30,
                "the worker settles the operation",
            )
            wait_until(lambda: named(spans, "settled.record"), 10, "the outcome's span ends")
    finally:
        celery_app.close_runtimes()  # the worker thread built one in this process

    (enqueue,) = named(spans, "settled.enqueue")
    (publish,) = named(spans, "apply_async/settled.submit")
    (run,) = named(spans, "run/settled.submit")
    (claim,) = named(spans, "settled.claim")
    (send,) = named(spans, "settled.send")
    (record,) = named(spans, "settled.record")
    chain = [enqueue, publish, run, claim, send, record]
    assert {s.context.trace_id for s in chain} == {enqueue.context.trace_id}
    # parent by parent: the hint continues the intake, the worker the hint
    assert publish.parent is not None and publish.parent.span_id == enqueue.context.span_id
    assert run.parent is not None and run.parent.span_id == publish.context.span_id
    assert claim.parent is not None and claim.parent.span_id == run.context.span_id
    assert send.parent is not None and send.parent.span_id == enqueue.context.span_id
    assert (send.attributes or {})["settled.op_id"] == "op-1"
    assert (send.attributes or {})["settled.proof"] == "done"
    assert (record.attributes or {})["settled.state"] == "succeeded"
    assert_key_never_an_attribute(spans, rig.op(operation_id).idempotency_key)


def test_a_reconcile_pass_continues_the_operations_trace(
    rig: Rig, spans: InMemorySpanExporter, observed: Observed
) -> None:
    lost = rig.enqueue("op-lost")
    rig.control.add_rule("commit_then_timeout", hold_seconds=HOLD, times=1)
    assert rig.executor(observer=observed).execute([lost]) == {lost: State.UNKNOWN}
    assert rig.reconciler(observer=observed).run_once().outcomes == {"found": 1}
    assert rig.op(lost).state == State.SUCCEEDED.value

    (enqueue,) = named(spans, "settled.enqueue")
    (send,) = named(spans, "settled.send")
    (reconcile,) = named(spans, "settled.reconcile")
    assert send.context.trace_id == enqueue.context.trace_id
    assert reconcile.context.trace_id == enqueue.context.trace_id
    assert reconcile.parent is not None and reconcile.parent.span_id == enqueue.context.span_id
    assert (send.attributes or {})["settled.proof"] == "unknown"
    assert (reconcile.attributes or {})["settled.outcome"] == "found"
    assert_key_never_an_attribute(spans, rig.op(lost).idempotency_key)


def test_without_tracing_no_trace_context_is_stored(rig: Rig, observed: Observed) -> None:
    observe.start_tracing()  # what every Celery app does; the environment does not ask for it
    op = rig.enqueue("op-1")
    rig.executor(observer=observed).execute([op])
    with rig.sessions() as s:
        stored = s.scalar(select(TRACES.c.trace_context).where(TRACES.c.id == op))
    assert stored is None


def test_the_environment_switches_tracing_on() -> None:
    assert not tracing.tracing_enabled({})
    assert tracing.tracing_enabled({"SETTLED_TRACING": "1"})
    assert tracing.tracing_enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert not tracing.tracing_enabled(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_SDK_DISABLED": "true"}
    )


class Fields(logging.Handler):
    """The allow-listed fields of each line, taken as a handler writing it would take them."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.getMessage(), logs.fields_of(record)))


def test_worker_log_lines_carry_the_operations_identity(rig: Rig, observed: Observed) -> None:
    # tracing off: identities in log lines only
    fields = Fields()
    root = logging.getLogger()
    root.addHandler(fields)
    saved = root.level
    root.setLevel(logging.INFO)
    try:
        op = rig.enqueue("op-7")
        rig.executor(observer=observed).execute([op])
    finally:
        root.removeHandler(fields)
        root.setLevel(saved)
    by_msg = dict(fields.lines)
    recorded = by_msg["attempt recorded"]  # the executor names the operation by its id only
    assert (recorded["tenant"], recorded["op_id"], recorded["kind"]) == ("acme", "op-7", "refund")
    answered = by_msg["submit answered"]  # the HTTP client, while the operation is sent
    assert (answered["op_id"], answered["attempt"], answered["status"]) == ("op-7", 1, 200)
    assert answered["duration_ms"] >= 0
