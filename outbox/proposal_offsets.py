"""What an agent's request to compensate may offset (``Proposals.propose_compensation`` and
the approval of a compensation).

A compensation is a new operation, never an edit. One original is compensated once: any live
request to compensate it (whatever its cause, however old; not one whose operation was
rejected or cancelled) is the repeat, and approval refuses when the original already has a
compensation that was not rejected or cancelled. An original that did nothing (declined,
waiting, not sent, refused) has nothing to offset. Like intake, nothing here commits.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from outbox.errors import InvalidInput
from outbox.intake import compensation_lock
from outbox.models import Operation, Proposal
from outbox.proposal_rules import APPROVED, NOTHING_DONE, UNDID_NOTHING
from outbox.storage import storage_for
from outbox.storage.operations import compensations_of, find_operation


def undid_nothing(session: Session, proposal: Proposal) -> bool:
    """Whether approved ``proposal``'s operation ended rejected or cancelled."""
    if proposal.status != APPROVED or proposal.op_id is None:
        return False
    op = find_operation(session, proposal.tenant, proposal.op_id)
    return op is not None and op.state in UNDID_NOTHING


def operation_to_offset(session: Session, original: Proposal) -> Operation:
    """The operation of approved proposal ``original``, if it may have done something to
    offset; else InvalidInput (``nothing_to_compensate``, naming the handle)."""
    op = None
    if original.status == APPROVED and original.op_id is not None:
        op = find_operation(session, original.tenant, original.op_id)
    if op is None or op.state in NOTHING_DONE:
        raise InvalidInput(
            "nothing was done by this request, so there is nothing to compensate "
            "(a request not sent yet is stopped with a cancel instead)",
            code="nothing_to_compensate",
            field="handle",
        )
    return op


def refuse_if_compensated(session: Session, op: Operation) -> None:
    """InvalidInput (``already_compensated``) when ``op`` already has a compensation that
    was not rejected or cancelled. Two approvals at once, or an approval and the app's
    ``compensate``, take turns on a lock (intake takes it too), so the second sees the
    first's compensation."""
    storage_for(session).serialize(session, compensation_lock(op.tenant, op.id))
    if any(c.state not in UNDID_NOTHING for c in compensations_of(session, op.tenant, op.id)):
        raise InvalidInput(
            "this request already has a compensation; it is compensated once "
            "(follow the earlier compensation with request_status)",
            code="already_compensated",
            field="handle",
        )
