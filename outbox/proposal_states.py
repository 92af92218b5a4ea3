"""The life of an agent's proposal, as one explicit transition table (like ``outbox.states``).

A proposal is made ``proposed``; a decision moves it once, to ``approved`` or ``declined``, and
one nobody decides within its time to live is marked ``expired`` by the sweeper (or found so by
an approval: ``outbox.proposals``). A decided proposal never changes again. The stored values
are these strings (the ``proposals.status`` column and its check constraint).
"""

from __future__ import annotations

import enum

from outbox.errors import IllegalTransition


class ProposalStatus(enum.StrEnum):
    PROPOSED = "proposed"
    APPROVED = "approved"
    DECLINED = "declined"
    EXPIRED = "expired"

    @property
    def decided(self) -> bool:
        """Whether nothing moves the proposal any more."""
        return self in DECIDED


class ProposalEvent(enum.StrEnum):
    APPROVE = "approve"  # a person, or the tenant's policy, approved it
    DECLINE = "decline"  # a person declined it (or the agent withdrew it)
    EXPIRE = "expire"  # nobody decided it within its time to live


_P = ProposalStatus.PROPOSED

#: (status, event) -> the status the event leads to. Anything absent is illegal.
TRANSITIONS: dict[tuple[ProposalStatus, ProposalEvent], ProposalStatus] = {
    (_P, ProposalEvent.APPROVE): ProposalStatus.APPROVED,
    (_P, ProposalEvent.DECLINE): ProposalStatus.DECLINED,
    (_P, ProposalEvent.EXPIRE): ProposalStatus.EXPIRED,
}
#: the statuses nothing moves
DECIDED = frozenset(ProposalStatus) - {status for status, _ in TRANSITIONS}
#: the statuses a repeat is answered from: a declined or expired request may be asked again
LIVE = frozenset({ProposalStatus.PROPOSED, ProposalStatus.APPROVED})
#: the event of a decision to each status
EVENT_TO: dict[ProposalStatus, ProposalEvent] = {to: ev for (_, ev), to in TRANSITIONS.items()}


def proposal_transition(status: str, event: ProposalEvent) -> ProposalStatus:
    """The status after ``event``; raise IllegalTransition where the table forbids it."""
    to = TRANSITIONS.get((ProposalStatus(status), event))
    if to is None:
        raise IllegalTransition(
            f"event {event.value!r} is not allowed on a proposal {status!r}",
            state=str(status),
            event=event.value,
        )
    return to
