"""Resolving a review item: what staff may ask, what the resolution stores, and how it is
written.

Staff can only settle an undeterminable operation as ``succeeded`` (with the downstream's
reference, verified by a lookup where the downstream has one) or ``rejected`` (with a written
justification); no parameter of the operation can be changed. What may be stored is weighed
against the downstream's lookup (``support.evidence``): a resolution that contradicts it is
refused. Two staff racing on one item: one wins, the other gets ReviewConflict. The queue that
calls these, in this order, is ``support.review`` (``ReviewQueue.resolve``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session

from outbox.clock import DbClock
from outbox.downstream import LookupNotFound, LookupOutcome, lookup_name, valid_reference
from outbox.errors import Forbidden, InvalidInput, ReviewConflict
from outbox.kinds import DownstreamContract
from outbox.models import ReviewItem
from outbox.states import Event, RejectReason, State
from outbox.storage import Storage
from outbox.storage.attempts import OperationFacts
from outbox.storage.reviews import (
    note_staff_action,
    resolve_review,
    review_item,
    settle_unknown,
)
from reconciler.decide import Situation, not_found_doubt
from support.evidence import weigh
from support.staff import OVERRIDING, Staff, require_acting

MIN_JUSTIFICATION = 10
MAX_JUSTIFICATION = 2000


@dataclass(frozen=True)
class Resolution:
    """A resolution as staff asked for it, checked before anything is read."""

    staff: Staff
    item_id: int
    to: State
    version: int  # the item's version the staff read
    reference: str | None
    justification: str | None
    override: bool

    @classmethod
    def parse(
        cls,
        staff: Staff,
        item_id: int,
        *,
        outcome: str,
        version: int,
        reference: str | None,
        justification: str | None,
        override: bool,
    ) -> Resolution:
        """The resolution asked for; InvalidInput or Forbidden where it cannot be asked."""
        require_acting(staff)
        to = _outcome(outcome)
        if to is State.SUCCEEDED and not valid_reference(reference):
            raise InvalidInput(
                "resolving as succeeded needs the downstream's reference",
                code="reference_required",
            )
        text = (justification or "").strip()
        if (to is State.REJECTED or override) and not (
            MIN_JUSTIFICATION <= len(text) <= MAX_JUSTIFICATION
        ):
            raise InvalidInput(
                f"resolving as rejected, or overriding, needs a written justification "
                f"({MIN_JUSTIFICATION} to {MAX_JUSTIFICATION} characters)",
                code="justification_required",
            )
        if override and staff.role not in OVERRIDING:
            raise Forbidden(
                "only a supervisor or an admin may override the evidence rule", code="forbidden"
            )
        return cls(staff, item_id, to, version, reference, justification, override)


@dataclass(frozen=True)
class Record:
    """What a resolution writes on the operation: its reason, receipt and evidence."""

    reason: RejectReason | None
    receipt: dict[str, Any] | None
    evidence: dict[str, Any]


def check_current(item: ReviewItem, version: int) -> None:
    """ReviewConflict unless ``item`` is still open at the ``version`` staff read."""
    if item.resolved_at is not None:
        raise already_resolved(item)
    if item.version != version:
        raise ReviewConflict(
            "this item changed since you read it; show it again", code="stale_version"
        )


def doubt_of(
    lookup: LookupOutcome | None,
    snapshot: dict[str, Any],
    contract: DownstreamContract,
    facts: OperationFacts,
    clock: DbClock,
    *,
    lookup_timeout: float,
    clock_doubt_until: datetime | None = None,
    downstream_lag: timedelta | None = None,
    clock_margin: timedelta = timedelta(0),
) -> str | None:
    """Why the lookup's "not found" cannot prove that nothing ran (the reconciler's rule,
    ``reconciler.decide.not_found_doubt``), or None: it can, or it was no "not found".
    ``clock_doubt_until``: after a step of the database's clock (``outbox.clock_steps``);
    ``downstream_lag``: how far the downstream's clock was seen behind the database's
    (``ClockWatch.downstream_lag``), beyond ``clock_margin`` its fence holds later."""
    if not isinstance(lookup, LookupNotFound):
        return None
    return not_found_doubt(
        Situation(
            state=State.UNKNOWN,
            contract=contract,
            now=clock.now(),
            deadline=snapshot["deadline"],
            first_sent_at=snapshot["first_sent_at"],
            last_sent_at=facts.last_sent_at,
            unknown_since=facts.unknown_since,
            lookups=facts.lookups,
            client_timeout=timedelta(seconds=lookup_timeout),
            review_after=timedelta(0),
            in_review=True,
            asked_at=clock.db_at,
            sends=facts.sends,
            lease_ends=facts.lease_ends,
            clock_doubt_until=clock_doubt_until,
            downstream_lag=downstream_lag,
            clock_margin=clock_margin,
        )
    )


def record_of(
    resolution: Resolution,
    lookup: LookupOutcome | None,
    *,
    doubt: str | None,
    contract: DownstreamContract | None = None,
) -> Record:
    """What ``resolution`` stores, weighed against ``lookup``; ReviewConflict when refused.

    ``contract``: the kind's; what its trusted "not found" rests on
    (``DownstreamContract.assumption``) is recorded with the "rejected" it proves."""
    r = resolution
    weighed = weigh(lookup, r.to, r.reference, doubt=doubt, override=r.override)
    evidence = {
        "by": r.staff.actor,
        "role": r.staff.role.value,
        "reference": r.reference,
        "justification": r.justification,
        "lookup": lookup_name(lookup),
        "review_item": r.item_id,
    }
    if weighed.unproven is not None:  # accepted only through the override
        evidence.update(override=True, unproven=weighed.unproven)
    elif isinstance(lookup, LookupNotFound) and contract is not None:
        evidence.update(contract.assumption())  # the "not found" proved it, on this assumption
    receipt = weighed.record
    reason = RejectReason.NOT_EXECUTED if r.to is State.REJECTED else None
    if weighed.settles is not None:  # the downstream's own record, and its reason
        reason = weighed.settles.reason
    if receipt is None and (lookup is None or weighed.unproven is not None):
        # A person's statement, recorded as one (never as the downstream's receipt).
        receipt = {"source": "staff", "staff": r.staff.id, "status": r.to.value}
        if r.reference is not None:
            receipt["reference"] = r.reference
    return Record(reason, receipt, evidence)


def write_resolution(
    storage: Storage, session: Session, operation_id: int, resolution: Resolution, record: Record
) -> None:
    """Settle the operation and close the item, in ``session``; ReviewConflict when either
    was changed by somebody else first."""
    r = resolution
    # The operation row first, then the item: the lock order of every writer.
    if not settle_unknown(
        storage,
        session,
        operation_id,
        Event.RESOLVE,
        r.to,
        actor=r.staff.actor,
        reason=record.reason,
        receipt=record.receipt,
        evidence=record.evidence,
        close_review=False,
    ):
        raise conflict(session, r.item_id)
    if not resolve_review(
        session,
        r.item_id,
        version=r.version,
        by=r.staff.actor,
        resolution={"state": r.to.value, "reference": r.reference, "override": r.override},
        note=r.justification,
    ):
        raise conflict(session, r.item_id)


def confirm_terminal(
    storage: Storage,
    session: Session,
    operation_id: int,
    state: State,
    resolution: Resolution,
) -> None:
    """Close an item whose operation already ended (``state``, terminal: a fingerprint
    mismatch is rejected when it is found, never sent) as staff confirmed it, with their
    justification; the operation does not change (a terminal state never does: a correction is
    a new operation). ReviewConflict when staff asked for another outcome, or lost a race."""
    r = resolution
    if r.to is not state:
        raise ReviewConflict(
            f"the operation is already {state.value} and cannot change; a correction is a new "
            "operation",
            code="terminal",
            state=state.value,
        )
    note_staff_action(
        storage,
        session,
        operation_id,
        actor=r.staff.actor,
        note="staff_confirmed",
        evidence={"review_item": r.item_id, "role": r.staff.role.value, "state": state.value},
    )
    if not resolve_review(
        session,
        r.item_id,
        version=r.version,
        by=r.staff.actor,
        resolution={"state": state.value, "confirmed": True, "override": r.override},
        note=r.justification,
    ):
        raise conflict(session, r.item_id)


def conflict(session: Session, item_id: int) -> ReviewConflict:
    """Why a resolve lost: the item was resolved by somebody else, or the operation was
    settled by an automatic path first."""
    item = review_item(session, item_id, fresh=True)
    if item is not None and item.resolved_at is not None:
        return ReviewConflict(
            f"somebody else resolved this item first: {item.resolved_by}",
            code="lost_race",
            resolved_by=item.resolved_by,
        )
    if item is not None:
        return ReviewConflict(
            "this item changed since you read it; show it again", code="stale_version"
        )
    return ReviewConflict("the operation is no longer unknown", code="settled")


def already_resolved(item: ReviewItem) -> ReviewConflict:
    return ReviewConflict(
        f"this item was already resolved by {item.resolved_by}",
        code="already_resolved",
        resolved_by=item.resolved_by,
    )


def _outcome(outcome: str) -> State:
    if outcome == "succeeded":
        return State.SUCCEEDED
    if outcome == "rejected":
        return State.REJECTED
    raise InvalidInput("outcome must be 'succeeded' or 'rejected'", code="invalid_outcome")
