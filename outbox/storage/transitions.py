"""Transitions and notes: what the one writer of event rows takes.

Every change of an operation's state, and every event row, goes through
``Storage.write_transitions`` (``outbox.storage.database``), implemented once per database:

* a ``Transition`` is a fenced conditional UPDATE of the operation with its event row (from,
  to, actor, lease version, reason, evidence, database time), and the review item it opens,
  the review item it settles, the attempt it starts or finishes. Under a claim (``Claimed``)
  the fence is the claim's lease version and state; outside any claim (``Unclaimed``: staff,
  a run's cancel) the state alone, and the lease version is bumped so that no lease holder
  can write after it. Zero rows updated means the fence failed: nothing of it is written.
* a ``Note`` is an event row that changes nothing: an operation's creation at intake (from
  nothing to ``planned``), or an action that changed no state (a staff requery, a refused
  staff action).

The transition table (``outbox.states``) is checked when a Transition is made, and again in
SQL: the UPDATE names the state the table was checked against. What a pure decision says to
write is a ``Change`` (``outbox.change``); ``Transition.of`` applies one to a claimed
operation, and is the only translation of one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Boolean, Connection, Table, bindparam, case, insert, null, select

from outbox.change import Change
from outbox.db import db_now
from outbox.errors import IllegalTransition
from outbox.models import Operation, OperationEvent
from outbox.states import Event, RejectReason, State, transition
from outbox.storage.claims import Claimed

ops: Table = Operation.__table__  # type: ignore[assignment]
events: Table = OperationEvent.__table__  # type: ignore[assignment]


@dataclass(frozen=True)
class Unclaimed:
    """An operation written outside any claim, known only by its id and the state it must
    still be in (staff settling it, a run's cancel)."""

    id: int
    state: State


@dataclass(frozen=True)
class Transition:
    """One change of an operation, as a value: ``operation`` moves by ``event`` to ``to``.

    ``event`` None is a look that changes no state (``to`` is the state it is in): when to
    look again, and the lookup tried; its event row has from = to.
    """

    operation: Claimed | Unclaimed
    event: Event | None
    to: State
    reason: RejectReason | None = None
    #: the event's evidence, and the review item's
    evidence: dict[str, Any] | None = None
    #: when to send or look again (database time); ``due_now``: at once
    next_attempt_at: datetime | None = None
    due_now: bool = False
    #: open a review item with this reason, unless one is open
    review: str | None = None
    #: end the claim's lease (False only when starting an attempt: the send holds it)
    release: bool = True
    #: the downstream's receipt, stored with its reference
    receipt: dict[str, Any] | None = None
    #: a lookup was made: counted
    looked: bool = False
    #: starts an attempt (to ``submitted``): counts it, stamps the first send, writes the
    #: attempt row (bounded by the claim's lease end)
    start: bool = False
    #: the event's reason; by default the reject reason, else why it stopped, else the review
    note: str | None = None
    #: an operation leaving ``unknown`` takes its open review item with it; False: the
    #: caller resolves the item itself, after this write (staff)
    closes_review: bool = True

    def __post_init__(self) -> None:
        if self.event is None:
            if self.to is not self.operation.state or self.reason is not None:
                raise IllegalTransition("a look changes no state", state=self.from_state.value)
        else:
            transition(self.from_state, self.event, self.to, self.reason)
        if self.start and (
            self.event not in (Event.CLAIM, Event.RESEND) or self.lease_version is None
        ):
            raise IllegalTransition("only a claim's send, or a same-key resend, starts an attempt")

    @classmethod
    def of(cls, claimed: Claimed, change: Change, *, looked: bool = False) -> Transition:
        """``change`` written about ``claimed``, fenced by its claim; ``looked``: a lookup was
        made for it (counted)."""
        evidence = change.evidence or None
        if change.event is None or change.to is None:
            assert change.next_attempt_at is not None and change.code is not None
            return cls.look(
                claimed,
                note=change.code,
                recheck_at=change.next_attempt_at,
                looked=looked,
                evidence=evidence,
                review=change.review,
            )
        return cls(
            claimed,
            change.event,
            change.to,
            reason=change.reason,
            evidence=evidence,
            next_attempt_at=change.next_attempt_at,
            due_now=change.due_now,
            review=change.review,
            receipt=change.receipt,
            looked=looked,
            note=change.note,
        )

    @classmethod
    def look(
        cls,
        claimed: Claimed,
        *,
        note: str,
        recheck_at: datetime,
        looked: bool,
        evidence: dict[str, Any] | None = None,
        review: str | None = None,
    ) -> Transition:
        """A look that changed no state: when to look again, and whether a lookup was made."""
        return cls(
            claimed,
            None,
            claimed.state,
            evidence=evidence,
            next_attempt_at=recheck_at,
            review=review,
            looked=looked,
            note=note,
        )

    @property
    def id(self) -> int:
        return self.operation.id

    @property
    def from_state(self) -> State:
        return self.operation.state

    @property
    def lease_version(self) -> int | None:
        """The claim's lease version the write is fenced by; None outside any claim."""
        return self.operation.lease_version if isinstance(self.operation, Claimed) else None

    @property
    def event_reason(self) -> str | None:
        """The event row's reason."""
        return (
            self.note
            or (self.reason.value if self.reason else None)
            or (self.evidence or {}).get("stop")
            or self.review
        )

    @property
    def settles_review(self) -> bool:
        """Whether the operation's open review item is closed with this write: nobody could
        close an item whose operation is no longer unknown."""
        return (
            self.closes_review and self.from_state is State.UNKNOWN and self.to is not State.UNKNOWN
        )

    @property
    def attempt_number(self) -> int | None:
        """The number of the attempt this transition starts."""
        if not self.start:
            return None
        assert isinstance(self.operation, Claimed)
        return self.operation.attempts + 1

    def resolution(self, actor: str) -> dict[str, Any]:
        """What an open review item settled with this write is closed with."""
        return {"state": self.to.value, "by": actor, "settled_with_operation": True}


@dataclass(frozen=True)
class Finish:
    """What came back for the current attempt of a claimed operation."""

    claimed: Claimed
    proof: str
    status_code: int | None
    detail: dict[str, Any] | None


@dataclass(frozen=True)
class Note:
    """An event row that changes nothing: the operation's creation (``created``: from
    nothing to its state, ``planned``), or an action that changed no state (from = to = the
    state it is in)."""

    operation_id: int
    note: str | None = None
    evidence: dict[str, Any] | None = None
    created: bool = False


#: A note's event row; its states are read from the operation in the same statement.
INSERT_NOTE = insert(events).from_select(
    [
        "operation_id",
        "from_state",
        "to_state",
        "actor",
        "lease_version",
        "reason",
        "evidence",
        "at",
    ],
    select(
        ops.c.id,
        case((bindparam("created", type_=Boolean()), null()), else_=ops.c.state),
        ops.c.state,
        bindparam("actor"),
        null(),
        bindparam("note"),
        bindparam("evidence", type_=JSON()),
        db_now(),
    ).where(ops.c.id == bindparam("operation_id")),
)


def write_notes(conn: Connection, notes: Sequence[Note], *, actor: str) -> None:
    """The event rows of ``notes`` (through ``Storage.write_transitions`` only)."""
    rows = [
        {
            "operation_id": n.operation_id,
            "created": n.created,
            "actor": actor,
            "note": n.note,
            "evidence": n.evidence,
        }
        for n in notes
    ]
    conn.execute(INSERT_NOTE, rows[0] if len(rows) == 1 else rows)  # one: no executemany
