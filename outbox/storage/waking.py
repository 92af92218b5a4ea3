"""Waking: the operations that wait on backoff after refusals that proved nothing ran, made
due now when their downstream is back (``workers.waking``, ``workers.recovery_probe``).

An operation *waits after a refusal* when it is ``planned``, not yet due, not leased, and the
last event it has is a ``defer`` (``submitted`` -> ``planned``: its last try was not sent, or
not executed). Nothing else moves ``submitted`` to ``planned``: an operation held back (a look,
``planned`` -> ``planned``), planned again by the reconciler (from ``unknown``) or never sent
(``created``) has another last event, and is never woken.

A downstream that gave a ``Retry-After`` is not hurried: while any operation of its kinds waits
on a defer whose evidence names a ``retry_after`` (its ``next_attempt_at`` is that time), none
of them is woken. The wake is bounded (``limit``), oldest wait first, and skips rows other
transactions hold (``SKIP LOCKED``); the UPDATE repeats the condition on each row, so a row
claimed or moved meanwhile is left as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Table, and_, bindparam, exists, select, update
from sqlalchemy.orm import Session

from outbox.db import db_now, db_statement_now, in_once
from outbox.models import Operation, OperationEvent
from outbox.states import State
from outbox.storage.connection import Bind, connection_of

ops: Table = Operation.__table__  # type: ignore[assignment]
events: Table = OperationEvent.__table__  # type: ignore[assignment]

_KINDS: Any = bindparam("kinds", expanding=True)


def _waiting_after_refusal(row: Any, now: Any) -> Any:
    """``row`` (the operations table or an alias) waits on backoff after a defer."""
    last = (
        select(events.c.id)
        .where(events.c.operation_id == row.c.id)
        .order_by(events.c.id.desc())
        .limit(1)
        .correlate(row)
        .scalar_subquery()
    )
    deferred = (
        select(events.c.id)
        .where(
            events.c.id == last,
            events.c.from_state == State.SUBMITTED.value,
            events.c.to_state == State.PLANNED.value,
        )
        .correlate(row)
    )
    return and_(
        row.c.state == State.PLANNED.value,
        row.c.kind.in_(_KINDS),
        row.c.next_attempt_at > now(),
        (row.c.lease_until.is_(None)) | (row.c.lease_until < now()),
        exists(deferred),
    ), last


def _retry_after_open(now: Any) -> Any:
    """Some operation of the kinds still waits out a ``Retry-After`` its downstream gave."""
    other = ops.alias("told_to_wait")
    waiting, last = _waiting_after_refusal(other, now)
    told = (
        select(events.c.id)
        .where(events.c.id == last, events.c.evidence["retry_after"].as_float().is_not(None))
        .correlate(other)
    )
    return exists(select(other.c.id).where(waiting, exists(told)))


_candidate = ops.alias("waiting")
_candidate_waits, _ = _waiting_after_refusal(_candidate, db_statement_now)

#: Make due now (database time) up to ``limit`` operations of ``kinds`` that wait after a
#: refusal, oldest ``next_attempt_at`` first; none while the downstream's ``Retry-After``
#: holds. Returns the ids woken.
WAKE_WAITING = (
    update(ops)
    .where(
        in_once(
            ops.c.id,
            select(_candidate.c.id)
            .where(_candidate_waits, ~_retry_after_open(db_statement_now))
            .order_by(_candidate.c.next_attempt_at)
            .limit(bindparam("limit"))
            .with_for_update(skip_locked=True),
        ),
        ops.c.state == State.PLANNED.value,
        ops.c.next_attempt_at > db_now(),
        (ops.c.lease_until.is_(None)) | (ops.c.lease_until < db_now()),
    )
    .values(next_attempt_at=db_now())
    .returning(ops.c.id)
)

_probed = ops.alias("probed")
_probed_waits, _ = _waiting_after_refusal(_probed, db_statement_now)
_in_flight = ops.alias("in_flight")

#: One operation of ``kinds`` that waits after a refusal, to look up (read-only) as a probe of
#: its downstream: only when no operation of those kinds is being sent (``submitted`` under a
#: live lease: its outcome will say whether the downstream is back) and no ``Retry-After`` of
#: the downstream holds.
PROBE_TARGET = (
    select(_probed.c.id, _probed.c.tenant, _probed.c.op_id, _probed.c.kind)
    .add_columns(_probed.c.idempotency_key, _probed.c.params)
    .where(
        _probed_waits,
        ~_retry_after_open(db_statement_now),
        ~exists(
            select(_in_flight.c.id).where(
                _in_flight.c.state == State.SUBMITTED.value,
                _in_flight.c.kind.in_(_KINDS),
                _in_flight.c.lease_until >= db_statement_now(),
            )
        ),
    )
    .order_by(_probed.c.next_attempt_at)
    .limit(1)
)


@dataclass(frozen=True)
class ProbeTarget:
    """An operation a recovery probe looks up (``outbox.downstream.Addressed``)."""

    id: int
    tenant: str
    op_id: str
    kind: str
    idempotency_key: str
    params: dict[str, Any]


def wake_waiting(bind: Bind, *, kinds: Sequence[str], limit: int) -> list[int]:
    """Make due now up to ``limit`` operations of ``kinds`` waiting after a refusal (none while
    a ``Retry-After`` of theirs holds); the ids woken."""
    if not kinds or limit <= 0:
        return []
    rows = connection_of(bind).execute(WAKE_WAITING, {"kinds": list(kinds), "limit": limit})
    return sorted(row.id for row in rows)


def probe_target(session: Session, *, kinds: Sequence[str]) -> ProbeTarget | None:
    """The operation a recovery probe of the downstream serving ``kinds`` looks up, if any
    waits after a refusal and nothing of those kinds is being sent."""
    if not kinds:
        return None
    row = session.execute(PROBE_TARGET, {"kinds": list(kinds)}).mappings().first()
    return None if row is None else ProbeTarget(**row)
