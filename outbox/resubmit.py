"""Re-submitting an intent that was proven not carried out, under a new op id
(``settled ops resubmit``): the audited way to try a refund again after its cause is fixed
(a payment service that was down past the deadline, our own credentials).

A terminal operation never changes (a correction is a new operation), so a resubmission is a
new operation through the normal intake: the original's kind, params and order, its run
unless that run was cancelled (a cancelled run sends nothing more), its original if it is a
compensation, a fresh budget and deadline, and the idempotency key derived from the new op
id. Both operations get an event that links them, with who asked and why (``RESUBMITTED`` on
the original, ``RESUBMISSION`` on the new one), written by the one writer of events.

Only an operation proven not carried out may be resubmitted (``refusal``): rejected on the
downstream's answer or on the proof that nothing was executed, or cancelled. Anything else
(live, in review, succeeded, rejected on staff's own statement) is refused with InvalidInput,
and so is a second resubmission of the same original under another op id, before anything is
written. The same command run again (same new op id) answers with the operation it made.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from outbox.errors import IdempotencyConflict, InvalidIdentifier, InvalidInput, NotFound
from outbox.ids import validate_label, validate_op_id, validate_tenant
from outbox.intake import Outbox, order_lock
from outbox.models import Operation, Run
from outbox.states import State
from outbox.storage import storage_for, tombstones
from outbox.storage.events import events_of
from outbox.storage.operations import find_operation, operation
from outbox.storage.reviews import in_review
from outbox.storage.runs import run as stored_run
from outbox.storage.transitions import Note

#: the note on the original, naming its resubmission
RESUBMITTED = "resubmitted"
#: the note on the resubmission, naming its original
RESUBMISSION = "resubmission"
MAX_BY = 64
MAX_WHY = 500


@dataclass(frozen=True)
class Resubmitted:
    """What a resubmission did: the original, the new operation, and whether this call made
    it (False: the same resubmission was made before; nothing was written)."""

    original: Operation
    operation: Operation
    created: bool
    #: the run the new operation joined (None: none, or the original's run was cancelled)
    run: Run | None


def refusal(state: str, *, by_staff: bool, in_review: bool) -> tuple[str, str] | None:
    """Why an operation in ``state`` may not be resubmitted, as ``(code, message)``; None:
    it may (its outcome is final and proves it was not carried out). Pure."""
    if in_review:
        return "in_review", "the operation is in review; support staff settle it first"
    if state not in (State.REJECTED, State.CANCELLED):
        if state == State.SUCCEEDED:
            return "done", "the operation was done; a resubmission would do it twice"
        return "not_settled", f"the operation is {state}, not settled: it may still be carried out"
    if by_staff:
        return (
            "unproven",
            "the operation is recorded as not done on support staff's statement, not on a "
            "record of the service: nothing proves it was not carried out",
        )
    return None


def resubmit(
    outbox: Outbox,
    session: Session,
    *,
    tenant: str,
    op_id: str,
    new_op_id: str,
    by: str,
    why: str,
) -> Resubmitted:
    """Enqueue operation ``op_id``'s intent again as ``new_op_id``, linking the two with
    ``by`` and ``why`` (in ``session``, never committed). InvalidInput (or NotFound,
    IdempotencyConflict) before anything is written when it may not be."""
    tenant = validate_tenant(tenant)
    op_id = validate_op_id(op_id)
    try:
        new_op_id = validate_op_id(new_op_id)
    except InvalidIdentifier as exc:
        raise InvalidIdentifier(
            "new_" + exc.message, code="invalid_new_op_id", field="new_op_id"
        ) from None
    # blank is not a name nor a reason: the audit trail must say who and why
    by = validate_label(_stripped(by), field="by", max_length=MAX_BY)
    why = validate_label(_stripped(why), field="reason", max_length=MAX_WHY)
    if new_op_id == op_id:
        raise InvalidInput("a resubmission has an op id of its own", code="same_op_id",
                           field="new_op_id")  # fmt: skip
    original = find_operation(session, tenant, op_id)
    if original is None:
        raise NotFound("no such operation", code="operation_not_found")
    _lock(session, original, outbox.registry.order_of(original.kind, original.params))
    refused = refusal(
        original.state,
        by_staff=(original.receipt or {}).get("source") == "staff",
        in_review=bool(in_review(session, [original.id])),
    )
    if refused is not None:
        code, message = refused
        raise InvalidInput(message, code=code, field="op_id")
    earlier = resubmission_of(session, original)
    existing = find_operation(session, tenant, new_op_id)
    if earlier is not None:
        if earlier == new_op_id and existing is not None:  # the same command, run again
            return Resubmitted(original, existing, created=False, run=_run_of(session, existing))
        raise InvalidInput(
            "the operation was resubmitted already; resubmit that one if it was not done",
            code="already_resubmitted",
            field="op_id",
            resubmitted_as=earlier,
        )
    if existing is not None or tombstones.find(session, tenant, new_op_id) is not None:
        raise IdempotencyConflict(
            "the new op id already names an operation (or a pruned one); mint a new one",
            code="op_id_taken",
            op_id=new_op_id,
        )  # fmt: skip
    run = _live_run(session, original)
    compensates = operation(session, original.compensates_id) if original.compensates_id else None
    got = outbox.enqueue(
        session,
        tenant=tenant,
        op_id=new_op_id,
        kind=original.kind,
        params=original.params,
        run=run,
        compensates=compensates,
    )
    created = got.operation
    actor = f"staff:{by}"
    storage_for(session).write_transitions(
        session,
        [
            Note(
                original.id,
                note=RESUBMITTED,
                evidence={"resubmitted_as": new_op_id, "by": by, "why": why},
            ),
            Note(
                created.id,
                note=RESUBMISSION,
                evidence={"resubmits": op_id, "by": by, "why": why},
            ),
        ],
        actor=actor,
    )
    return Resubmitted(original, created, created=True, run=run)


def resubmission_of(session: Session, original: Operation) -> str | None:
    """The op id ``original`` was resubmitted as (None: it was not)."""
    for event in events_of(session, original.id):
        if event.reason == RESUBMITTED:
            named = (event.evidence or {}).get("resubmitted_as")
            if isinstance(named, str):
                return named
    return None


def _stripped(value: object) -> object:
    return value.strip() if isinstance(value, str) else value


def _lock(session: Session, original: Operation, order_ref: str | None) -> None:
    """Hold the locks a resubmission of ``original`` (on order ``order_ref``, None: on none)
    is taken under, in the one lock order: its order's (shared, as intake takes it), then its
    own, so that two resubmissions of one original are taken in turn and the second sees the
    first."""
    storage = storage_for(session)
    if order_ref is not None:
        storage.lock_order(session, order_lock(original.tenant, original.kind, order_ref),
                           shared=True)  # fmt: skip
    storage.serialize(session, f"resubmit:{original.tenant}:{original.id}")


def _live_run(session: Session, original: Operation) -> Run | None:
    """The original's run, if it has one that was not cancelled."""
    if original.run_id is None:
        return None
    found = stored_run(session, original.run_id)
    return found if found is not None and found.cancel_requested_at is None else None


def _run_of(session: Session, op: Operation) -> Run | None:
    return stored_run(session, op.run_id) if op.run_id is not None else None
