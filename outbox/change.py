"""What a decision says to write about one operation: the one value every pure decision returns.

The executor's verdict on a send (``workers.verdicts.judge_submit``, ``judge_recovery``), its
last checks before a send (``check_before_send``) and the reconcile decision
(``reconciler.decide.decide``) each return a ``Change``. Storage writes it about the operation
the caller holds, fenced by its claim: ``outbox.storage.transitions.Transition.of`` is the one
place a Change becomes a write. No database, clock or network in here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from outbox.states import Event, RejectReason, State


@dataclass(frozen=True)
class Change:
    """A move of the operation by ``event`` to ``to``; or, with ``event`` None, no move: a look
    that says when to look again (``next_attempt_at``).

    The transition table (``outbox.states``) is checked when the change is applied to an
    operation in a known state (``Transition``), and again in SQL.
    """

    event: Event | None
    to: State | None = None
    reason: RejectReason | None = None
    #: the downstream's receipt, stored with its reference
    receipt: dict[str, Any] | None = None
    #: open a review item with this reason code in the same transaction (unless one is open)
    review: str | None = None
    #: when to send or look again (database time); a move to ``planned`` without it is due at
    #: once
    next_attempt_at: datetime | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    #: a stable code for what was decided (the reconciler counts them per pass); a look's
    #: event row carries it as its reason
    code: str | None = None
    #: the event row's reason where it is not the reject reason: a stop of Settled's own
    #: configuration (``outbox.states.ConfigFault``)
    note: str | None = None

    def __post_init__(self) -> None:
        if (self.event is None) != (self.to is None):
            raise ValueError("a change names both its event and its state, or neither")
        if self.event is None and self.next_attempt_at is None:
            raise ValueError("a look says when to look again")

    @classmethod
    def look(
        cls,
        code: str,
        *,
        recheck_at: datetime,
        evidence: dict[str, Any] | None = None,
        review: str | None = None,
    ) -> Change:
        """No move: look again at ``recheck_at``."""
        return cls(
            None, next_attempt_at=recheck_at, evidence=evidence or {}, review=review, code=code
        )

    @property
    def due_now(self) -> bool:
        """A move back to ``planned`` with no later time given: due at once."""
        return self.to is State.PLANNED and self.next_attempt_at is None

    @property
    def stop(self) -> str | None:
        """Why an operation was not sent (any more), where that is what was decided."""
        stop = self.evidence.get("stop")
        return stop if isinstance(stop, str) else None
