"""One operation as staff read it: the row, every attempt, every lookup with its answer, the
events, the run it belongs to, and its line in the run report's words (done / not done /
uncertain, en and zh). Read-only; shared by the review item and the operation page, so
the console and the CLI show the same facts.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from outbox import runs
from outbox.models import Operation, OperationEvent
from outbox.report import render_line
from outbox.report_lines import Compensation, CompensationNote, Group, Line
from outbox.report_text import LANGS, check_lang
from outbox.states import State
from outbox.storage.attempts import attempt_history
from outbox.storage.events import events_of
from outbox.storage.reviews import open_review_id
from outbox.storage.runs import run
from outbox.verdict_due import Cadence
from support.timeline import timeline


def operation_view(session: Session, op: Operation) -> dict[str, Any]:
    """The operation, its attempts, lookups, events, timeline and run (JSON-safe)."""
    events = events_of(session, op.id)
    lookups = [_lookup(e) for e in events if _lookup_name(e) is not None]
    owner = run(session, op.run_id) if op.run_id is not None else None
    shown = [
        {
            "at": e.at.isoformat(),
            "from": e.from_state,
            "to": e.to_state,
            "actor": e.actor,
            "reason": e.reason,
            "evidence": e.evidence,
        }
        for e in events
    ]
    return {
        "operation": _operation(op),
        "attempts": attempt_history(session, op.id),
        "lookups": lookups,
        "last_lookup": lookups[-1]["answer"] if lookups else None,
        "events": shown,
        # the events as staff read them, repeated looks folded (``support.timeline``)
        "timeline": timeline(shown),
        "run": None if owner is None else {"handle": owner.handle, "title": owner.title},
    }


def operation_page(
    session: Session, op: Operation, *, cadence: Cadence | None = None
) -> dict[str, Any]:
    """Everything the console's operation page shows: ``operation_view``, the report's words
    (``report``; with ``cadence``, an uncertain one's verdict's time) and its open review item
    (``review_item``, None: none)."""
    return {
        **operation_view(session, op),
        "report": report_words(session, op, cadence=cadence),
        "review_item": open_review_id(session, op.id),
    }


def report_words(
    session: Session, op: Operation, *, cadence: Cadence | None = None
) -> dict[str, Any]:
    """The operation's line of the run report: its group, its sentence in each language and,
    for an uncertain one given the reconciler's numbers (``cadence``), what it waits for and
    the latest it is decided by (``due``: ``waits_for``, ``verdict_by``; None: not said)."""
    status = runs.operation_status(session, op.tenant, op.op_id, cadence=cadence)
    line = _line(status)  # its message key already says whether the run was stopped
    evidence = status["evidence"]
    due = None
    if "waits_for" in evidence:
        due = {"waits_for": evidence["waits_for"], "verdict_by": evidence["verdict_by"]}
    return {
        "group": line.group.value,
        "text": {lang: render_line(line, False, check_lang(lang)) for lang in LANGS},
        "due": due,
    }


def _operation(op: Operation) -> dict[str, Any]:
    return {
        "tenant": op.tenant,
        "op_id": op.op_id,
        "kind": op.kind,
        "params": op.params,
        "state": op.state,
        "reason": op.reason,
        "attempts": op.attempts,
        "max_attempts": op.max_attempts,
        "lookups": op.lookups,
        "deadline": op.deadline.isoformat(),
        "unknown_since": op.unknown_since.isoformat() if op.unknown_since else None,
        "downstream_ref": op.downstream_ref,
        "idempotency_key": op.idempotency_key,
        "created_at": op.created_at.isoformat(),
    }


def _lookup_name(event: OperationEvent) -> str | None:
    """The lookup an event records the answer of (None: it records none)."""
    evidence = event.evidence or {}
    if event.reason == "lookup_mismatch" or evidence.get("review") == "lookup_mismatch":
        return "mismatch"  # a reconcile pass's look that found a record unlike the intent
    answer = evidence.get("lookup")
    return answer if isinstance(answer, str) else None


def _lookup(event: OperationEvent) -> dict[str, Any]:
    evidence = event.evidence or {}
    return {
        "at": event.at.isoformat(),
        "by": event.actor,
        "answer": _lookup_name(event),
        "detail": evidence.get("detail") or evidence.get("code"),
        # the downstream's own record it found (reference, status), None: none
        "record": _record(evidence),
    }


def _record(evidence: dict[str, Any]) -> dict[str, str | None] | None:
    """The record a lookup found: a mismatch's ``record``, a find's ``reference``."""
    record = evidence.get("record")
    if isinstance(record, dict) and isinstance(record.get("reference"), str):
        return {"reference": record["reference"], "status": _text(record.get("status"))}
    if evidence.get("lookup") == "found" and isinstance(evidence.get("reference"), str):
        return {"reference": evidence["reference"], "status": _text(evidence.get("status"))}
    return None


def _line(status: dict[str, Any]) -> Line:
    """The report line ``runs.operation_status`` describes, to render in any language."""
    note = status.get("compensation")
    return Line(
        op_id=status["op_id"],
        kind=status["kind"],
        state=State(status["state"]),
        group=Group(status["group"]),
        message=status["message"],
        evidence=status["evidence"],
        compensates=status.get("compensates"),
        amount_minor=status.get("amount_minor"),
        currency=status.get("currency"),
        compensation=None
        if note is None
        else CompensationNote(note["op_id"], Compensation(note["status"]), note["reference"]),
    )


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None
