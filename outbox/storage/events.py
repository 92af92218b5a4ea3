"""Reads of the audit trail: an operation's event rows (written by ``Storage.write_transitions``
only), oldest first."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from outbox.models import Attempt, OperationEvent
from outbox.states import ConfigFault, State

EVENTS_OF = (
    select(OperationEvent)
    .where(OperationEvent.operation_id == bindparam("operation_id"))
    .order_by(OperationEvent.id)
)
STATES_OF = (
    select(OperationEvent.from_state, OperationEvent.to_state)
    .where(OperationEvent.operation_id == bindparam("operation_id"))
    .order_by(OperationEvent.id)
)


REJECTIONS_OF = (
    select(OperationEvent.operation_id, OperationEvent.evidence)
    .where(
        OperationEvent.operation_id.in_(bindparam("ids", expanding=True)),
        OperationEvent.to_state == State.REJECTED.value,
    )
    .order_by(OperationEvent.id)
)


def rejection_codes(session: Session, ids: Collection[int]) -> dict[int, str]:
    """The downstream's refusal code each of these operations was rejected with (those
    whose rejection event has one)."""
    codes: dict[int, str] = {}
    for operation_id, evidence in session.execute(REJECTIONS_OF, {"ids": sorted(ids)}):
        code = (evidence or {}).get("code")
        if isinstance(code, str):
            codes[operation_id] = code
    return codes


#: The rejection events that name a fault of our own configuration as their reason.
FAULTS_OF = select(OperationEvent.operation_id, OperationEvent.reason).where(
    OperationEvent.operation_id.in_(bindparam("ids", expanding=True)),
    OperationEvent.to_state == State.REJECTED.value,
    OperationEvent.reason.in_([f.value for f in ConfigFault]),
)


def rejection_faults(session: Session, ids: Collection[int]) -> dict[int, str]:
    """The fault of our own configuration each of these operations was rejected for
    (``outbox.states.ConfigFault``: those rejected for one)."""
    rows = session.execute(FAULTS_OF, {"ids": sorted(ids)})
    return {op: reason for op, reason in rows if reason is not None}


#: the events whose evidence may say what a "not done" rests on: a requeue on "not found"
#: (to ``planned``), staff's "rejected" proven by one
PROOF_EVENTS_OF = (
    select(OperationEvent.operation_id, OperationEvent.evidence)
    .where(
        OperationEvent.operation_id.in_(bindparam("ids", expanding=True)),
        OperationEvent.to_state.in_([State.PLANNED.value, State.REJECTED.value]),
    )
    .order_by(OperationEvent.id)
)


def not_found_assumptions(session: Session, ids: Collection[int]) -> dict[int, dict[str, Any]]:
    """Per operation, what the latest "not found" that proved an attempt had no effect rested
    on (``rests_on``, and ``max_request_delay_seconds`` for a delay bound), for those with
    one."""
    found: dict[int, dict[str, Any]] = {}
    for operation_id, evidence in session.execute(PROOF_EVENTS_OF, {"ids": sorted(ids)}):
        rests_on = (evidence or {}).get("rests_on")
        if isinstance(rests_on, str):
            delay = (evidence or {}).get("max_request_delay_seconds")
            found[operation_id] = {"rests_on": rests_on, "max_request_delay_seconds": delay}
    return found


#: the give-up events of a retry budget: to ``rejected``, their evidence naming the stop
GIVE_UPS_OF = (
    select(OperationEvent.operation_id, OperationEvent.evidence, OperationEvent.at)
    .where(
        OperationEvent.operation_id.in_(bindparam("ids", expanding=True)),
        OperationEvent.to_state == State.REJECTED.value,
        OperationEvent.reason == "not_executed",
    )
    .order_by(OperationEvent.id)
)
TRIES_OF = (
    select(
        Attempt.operation_id,
        Attempt.started_at,
        Attempt.proof,
        Attempt.status_code,
        Attempt.detail,
    )
    .where(Attempt.operation_id.in_(bindparam("ids", expanding=True)))
    .order_by(Attempt.operation_id, Attempt.number)
)


def give_ups(session: Session, ids: Collection[int]) -> dict[int, dict[str, Any]]:
    """Per operation given up as ``not_executed`` (of ``ids``), where its tries stopped: the
    ``stop``, the ``tries`` made and those that ``reached`` the downstream (from the give-up's
    evidence, else counted from the attempt rows), the ``seconds`` from its first try to the
    give-up, and its last try's ``last_proof``, ``last_status``, ``last_phase`` and
    ``last_detail``. Operations with no try are left out."""
    stops: dict[int, tuple[dict[str, Any], Any]] = {}
    for operation_id, evidence, at in session.execute(GIVE_UPS_OF, {"ids": sorted(ids)}):
        if isinstance((evidence or {}).get("stop"), str):
            stops[operation_id] = (evidence, at)
    if not stops:
        return {}
    tries: dict[int, list[Any]] = {}
    for row in session.execute(TRIES_OF, {"ids": sorted(stops)}):
        tries.setdefault(row.operation_id, []).append(row)
    found: dict[int, dict[str, Any]] = {}
    for operation_id, (evidence, at) in stops.items():
        rows = tries.get(operation_id)
        if not rows:
            continue
        last = rows[-1]
        detail = last.detail if isinstance(last.detail, dict) else {}
        reached = sum(1 for r in rows if r.proof != "not_sent")
        found[operation_id] = {
            "stop": evidence["stop"],
            "tries": _count(evidence.get("tries"), len(rows)),
            "reached": _count(evidence.get("reached"), reached),
            "seconds": max(0.0, (at - rows[0].started_at).total_seconds()),
            "last_proof": last.proof,
            "last_status": last.status_code,
            "last_phase": _text(detail.get("phase")),
            "last_detail": _text(detail.get("detail")),
        }
    return found


def _count(value: object, otherwise: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else otherwise


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def events_of(session: Session, operation_id: int) -> list[OperationEvent]:
    """Every event row of an operation, oldest first."""
    return list(session.scalars(EVENTS_OF, {"operation_id": operation_id}))


def states_passed(session: Session, operation_id: int) -> list[str]:
    """The states an operation went through, from its creation on (looks left out)."""
    rows = session.execute(STATES_OF, {"operation_id": operation_id})
    return [to for frm, to in rows if frm != to]
