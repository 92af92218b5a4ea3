"""Runs: the operations one user task creates, under an opaque random handle.

The app opens a run in its own transaction and enqueues operations into it
(``Outbox.enqueue(..., run=run)``); like intake, nothing here commits. Every read by handle is
authorised by tenant: another tenant's handle is "not found", exactly like a made-up one.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from outbox.errors import IdempotencyConflict, InvalidIdentifier, InvalidInput, NotFound
from outbox.ids import validate_label, validate_op_id, validate_tenant
from outbox.intake import Enqueued, Outbox
from outbox.models import Operation, Run
from outbox.report import Report, RunFacts, build_report, render_line
from outbox.report_lines import OpFacts, Stopped, build_line
from outbox.report_text import check_lang
from outbox.states import State
from outbox.storage import runs as storage_runs
from outbox.storage import storage_for
from outbox.storage.attempts import operation_facts
from outbox.storage.clock_steps import clock_doubt_until
from outbox.storage.events import (
    give_ups,
    not_found_assumptions,
    rejection_codes,
    rejection_faults,
)
from outbox.storage.operations import compensations_of, db_time, find_operation, op_ids_of
from outbox.storage.reviews import in_review
from outbox.storage.runs import cancel_planned, request_run_cancel
from outbox.verdict_due import Cadence, Uncertain, VerdictDue, verdict_due

HANDLE_PREFIX = "run_"
HANDLE_RE = re.compile(r"run_[A-Za-z0-9_-]{32}")
MAX_TITLE = 200
MAX_ACTOR = 100


def new_handle() -> str:
    """An opaque, unguessable handle (192 random bits)."""
    return HANDLE_PREFIX + secrets.token_urlsafe(24)


def open_run(session: Session, *, tenant: str, title: str | None = None) -> Run:
    """Create a run in ``session`` (flushed, never committed)."""
    tenant = validate_tenant(tenant)
    if title is not None:
        title = validate_label(title, field="title", max_length=MAX_TITLE)
    return storage_runs.add_run(session, tenant=tenant, handle=new_handle(), title=title)


def find_run(session: Session, tenant: str, handle: str) -> Run:
    """The run ``handle`` of ``tenant``; NotFound (the same error) for any other handle."""
    tenant = validate_tenant(tenant)
    if not isinstance(handle, str) or HANDLE_RE.fullmatch(handle) is None:
        raise NotFound("no such run", code="run_not_found")
    run = storage_runs.find_run(session, tenant, handle)
    if run is None:
        raise NotFound("no such run", code="run_not_found")
    return run


@dataclass(frozen=True)
class Cancelled:
    """What a cancel did: the operations it stopped, and whether the run was already stopped."""

    run: Run
    cancelled_ids: Sequence[int]
    already_requested: bool


def cancel_run(session: Session, tenant: str, handle: str, *, actor: str) -> Cancelled:
    """Stop a run: set its flag and cancel its planned operations (nothing sent for them).

    Operations already sent stay as they are until a lookup settles them; the executor
    re-checks the flag before every send. Cancelling twice is harmless. Never commits.
    """
    actor = validate_label(actor, field="actor", max_length=MAX_ACTOR)
    run = find_run(session, tenant, handle)
    first = request_run_cancel(session, run.id, actor=actor)
    ids = cancel_planned(storage_for(session), session, run.id, actor=actor)
    session.expire(run)
    return Cancelled(run, ids, already_requested=not first)


_NOTHING_TO_OFFSET = frozenset({State.REJECTED.value, State.CANCELLED.value})


def compensate(
    outbox: Outbox,
    session: Session,
    original: Operation,
    *,
    op_id: str,
    kind: str,
    params: Mapping[str, Any],
    correlation_id: str | None = None,
) -> Enqueued:
    """Enqueue a new operation that offsets ``original``, in the same run and tenant.

    It has its own op_id and fingerprint and goes through the same pipeline (it can fail, end
    unknown, land in review). A replay with the same op_id returns the stored compensation.
    ``original`` is compensated once: while it has a compensation that was not rejected or
    cancelled (the app's or an agent's approved request, committed or still in its
    transaction: intake waits for it), another op_id raises InvalidInput
    (``already_compensated``, ``data["compensation"]`` its op_id).
    """
    if original.state in _NOTHING_TO_OFFSET:
        raise InvalidInput(
            "a rejected or cancelled operation had no effect to compensate",
            code="nothing_to_compensate",
        )
    run: Run | None = None
    if original.run_id is not None:
        run = storage_runs.run(session, original.run_id)
        if run is not None and run.cancel_requested_at is not None:
            # The executor sends nothing in a cancelled run: the compensation would only be
            # cancelled. Refuse now, writing nothing, rather than pretend it will run.
            raise InvalidInput(
                "the run was cancelled; nothing more is sent in it", code="run_cancelled"
            )
    got = outbox.enqueue(
        session,
        tenant=original.tenant,
        op_id=op_id,
        kind=kind,
        params=params,
        run=run,
        correlation_id=correlation_id,
        compensates=original,
    )
    if not got.created and got.compensates_id != original.id:
        raise IdempotencyConflict(
            "op_id already names an operation that does not compensate this one",
            code="idempotency_conflict",
            op_id=op_id,
        )
    return got


# -- reading for reports -------------------------------------------------------------------


def run_facts(session: Session, run: Run, *, cadence: Cadence | None = None) -> RunFacts:
    """Snapshots of a run's operations, and of compensations enqueued for them elsewhere;
    with ``cadence`` (the reconciler's numbers, ``Runtime.cadence``), each uncertain one says
    what it waits for and the latest it is decided by (``outbox.verdict_due``)."""
    ops = storage_runs.run_operations(session, run)
    return RunFacts(
        handle=run.handle,
        cancelled=run.cancel_requested_at is not None,
        operations=_facts(session, ops, cadence),
        title=run.title,
        cancel_requested_at=run.cancel_requested_at,
    )


def run_report(
    session: Session, tenant: str, handle: str, *, cadence: Cadence | None = None
) -> Report:
    """The report of run ``handle`` (NotFound for another tenant's or a made-up handle); with
    ``cadence``, an uncertain line says when it is decided at the latest (``run_facts``)."""
    return build_report(run_facts(session, find_run(session, tenant, handle), cadence=cadence))


def operation_status(
    session: Session,
    tenant: str,
    op_id: str,
    *,
    cadence: Cadence | None = None,
    lang: str | None = None,
) -> dict[str, Any]:
    """One operation of ``tenant`` as the status API shows it (NotFound otherwise); with
    ``cadence``, an uncertain one's evidence says what it waits for and by when at the latest
    (``waits_for``, ``verdict_by``: ``outbox.verdict_due``); with ``lang``, its sentence
    (``text``, as the run report words it).

    An op_id that could never have been stored (NUL, non-ASCII, overlong: anything from a URL)
    is "not found" before any SQL, exactly like an unknown one: no database error, no oracle.
    """
    tenant = validate_tenant(tenant)
    try:
        op_id = validate_op_id(op_id)
    except InvalidIdentifier:
        raise NotFound("no such operation", code="operation_not_found") from None
    op = find_operation(session, tenant, op_id)
    if op is None:
        raise NotFound("no such operation", code="operation_not_found")
    comps = compensations_of(session, tenant, op.id)
    facts = _facts(session, [op, *comps], cadence)
    run = storage_runs.run(session, op.run_id) if op.run_id is not None else None
    cancelled = run is not None and run.cancel_requested_at is not None
    line = build_line(facts[0], facts[1:], cancelled=cancelled)
    text = {} if lang is None else {"text": render_line(line, cancelled, check_lang(lang))}
    return {
        **line.as_dict(),
        **text,
        "run": run.handle if run is not None else None,
        "compensated_by": [f.op_id for f in facts[1:]],
        "created_at": op.created_at.isoformat(),
        "updated_at": op.updated_at.isoformat(),
    }


def _facts(
    session: Session, ops: Sequence[Operation], cadence: Cadence | None = None
) -> list[OpFacts]:
    ids = [op.id for op in ops]
    codes: dict[int, str] = {}
    reviewed: set[int] = set()
    assumed: dict[int, dict[str, Any]] = {}
    faults: dict[int, str] = {}
    stopped: dict[int, dict[str, Any]] = {}
    if ids:
        codes = rejection_codes(session, ids)
        faults = rejection_faults(session, ids)
        reviewed = in_review(session, ids)
        assumed = not_found_assumptions(session, ids)
        given_up = [op.id for op in ops if op.reason == "not_executed"]
        stopped = give_ups(session, given_up) if given_up else {}
    due = _verdicts_due(session, ops, reviewed, cadence) if cadence is not None else {}
    op_ids = {op.id: op.op_id for op in ops}
    missing = {op.compensates_id for op in ops if op.compensates_id is not None} - set(op_ids)
    if missing:
        op_ids.update(op_ids_of(session, missing))
    return [
        OpFacts(
            op_id=op.op_id,
            kind=op.kind,
            state=State(op.state),
            reason=op.reason,
            code=codes.get(op.id),
            fault=faults.get(op.id),
            reference=op.downstream_ref,
            receipt_status=_receipt_status(op.receipt),
            in_review=op.id in reviewed,
            compensates=op_ids.get(op.compensates_id) if op.compensates_id else None,
            sent=op.attempts > 0,
            by_staff=(op.receipt or {}).get("source") == "staff",
            differs=bool((op.receipt or {}).get("differs_from_intent")),
            rests_on=assumed.get(op.id, {}).get("rests_on"),
            max_request_delay_seconds=assumed.get(op.id, {}).get("max_request_delay_seconds"),
            **_amount(op.params),
            stopped=Stopped(**stopped[op.id]) if op.id in stopped else None,
            due=due.get(op.id),
        )
        for op in ops
    ]


_UNCERTAIN = frozenset({State.SUBMITTED.value, State.UNKNOWN.value})


def verdicts_due(
    session: Session, ops: Sequence[Operation], cadence: Cadence
) -> dict[int, VerdictDue]:
    """Per uncertain operation of ``ops`` (by row id), what it waits for and the latest it is
    decided by (``outbox.verdict_due``), as the report's lines say it: for lists of
    operations (the console's search and find rows)."""
    ids = [op.id for op in ops if op.state in _UNCERTAIN]
    reviewed = in_review(session, ids) if ids else set()
    return _verdicts_due(session, ops, reviewed, cadence)


def _verdicts_due(
    session: Session, ops: Sequence[Operation], reviewed: set[int], cadence: Cadence
) -> dict[int, VerdictDue]:
    """Per uncertain operation, what it waits for and the latest it is decided by, from the
    facts the reconciler weighs (``operation_facts``) and database time. A kind this process
    has no contract for says nothing rather than guess."""
    uncertain = [op for op in ops if op.state in _UNCERTAIN and op.kind in cadence.contracts]
    if not uncertain:
        return {}
    now, doubt = db_time(session), clock_doubt_until(session)
    due: dict[int, VerdictDue] = {}
    for op in uncertain:
        facts = operation_facts(session, op.id)
        due[op.id] = verdict_due(
            Uncertain(
                state=State(op.state),
                contract=cadence.contracts[op.kind],
                now=now,
                deadline=op.deadline,
                next_look_at=op.next_attempt_at,
                in_review=op.id in reviewed,
                unknown_since=facts.unknown_since,
                last_sent_at=facts.last_sent_at,
                lease_until=op.lease_until,
                sends=facts.sends,
                lease_ends=facts.lease_ends,
                clock_doubt_until=doubt,
            ),
            cadence,
        )
    return due


def _amount(params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The intent's amount and currency, where its kind has them (a refund)."""
    minor, currency = (params or {}).get("amount_minor"), (params or {}).get("currency")
    if isinstance(minor, int) and not isinstance(minor, bool) and isinstance(currency, str):
        return {"amount_minor": minor, "currency": currency}
    return {}


def _receipt_status(receipt: Mapping[str, Any] | None) -> str | None:
    status = (receipt or {}).get("status")
    return status if isinstance(status, str) else None
