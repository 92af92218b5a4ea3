"""The manual review queue that support staff work.

Staff can only *resolve*: settle an undeterminable operation as ``succeeded`` (with the
downstream's reference, verified by a lookup where the downstream has one) or ``rejected``
(with a written justification). No parameter of the operation can be changed. A resolution
that contradicts the downstream's lookup is refused; two staff racing on one item: one wins,
the other gets ReviewConflict.
"""

from __future__ import annotations

import enum
import logging
import re
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from outbox.clock import DbClock
from outbox.downstream import (
    Found,
    Gateway,
    LookupOutcome,
    lookup_name,
    settlement,
    valid_reference,
)
from outbox.downstream import NotFound as LookupNotFound
from outbox.errors import Forbidden, InvalidInput, NotFound, ReviewConflict, SettledError
from outbox.kinds import DownstreamContract, KindRegistry
from outbox.models import Operation, ReviewItem
from outbox.states import Event, RejectReason, State
from outbox.storage import Storage, storage_for
from outbox.storage.attempts import OperationFacts, attempts_of, operation_facts
from outbox.storage.events import events_of
from outbox.storage.operations import db_time, operation
from outbox.storage.reviews import (
    list_review_items,
    note_staff_action,
    resolve_review,
    review_item,
    settle_unknown,
)
from reconciler.decide import Situation, not_found_doubt
from reconciler.evidence import weigh

audit = logging.getLogger("settled.audit")
log = logging.getLogger(__name__)

STAFF_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
MIN_JUSTIFICATION = 10
MAX_JUSTIFICATION = 2000


#: Every reason an operation is put in review, and how staff resolve it (README, "The review
#: queue"). What a resolution may store is weighed by ``reconciler.evidence``.
REASONS: dict[str, str] = {
    "lookup_unavailable": "requery once the lookup is back; resolve as its record says",
    "ambiguous_without_idempotency": "resolve as the lookup shows once it is quiet",
    "receipt_mismatch": (
        "the downstream did something else under this key: resolve as its record says (its "
        "reference); stored as its record, marked as differing; then correct it"
    ),
    "lookup_mismatch": "as receipt_mismatch",
    "receipt_key_mismatch": "requery; a supervisor may override after checking",
    "receipt_unreadable": "requery; a supervisor may override after checking",
    "idempotency_error": "resolve as the lookup shows (not found, once quiet: rejected)",
    "unexpected_response": "resolve as the lookup shows (not found, once quiet: rejected)",
    "outcome_not_recorded": "requery, or resolve as the lookup shows",
    "reconcile_failed": "requery, or resolve as the lookup shows",
    "past_key_retention": "a supervisor resolves with --override and a justification",
    "no_lookup_replay_cannot_settle": "no lookup: resolve on your own evidence (a statement)",
    "no_lookup_without_idempotency": "no lookup: resolve on your own evidence (a statement)",
    "ambiguous_without_idempotency_or_lookup": (
        "no lookup: resolve on your own evidence (a statement)"
    ),
}


class Role(enum.StrEnum):
    VIEWER = "viewer"  # may list and show
    SUPPORT = "support"  # may also requery and resolve
    SUPERVISOR = "supervisor"


ACTING = frozenset({Role.SUPPORT, Role.SUPERVISOR})


@dataclass(frozen=True)
class Staff:
    id: str
    role: Role

    @classmethod
    def parse(cls, staff_id: object, role: object) -> Staff:
        if not isinstance(staff_id, str) or STAFF_ID.fullmatch(staff_id) is None:
            raise InvalidInput("a staff id is required", code="invalid_staff", field="staff")
        try:
            return cls(staff_id, Role(str(role)))
        except ValueError:
            raise InvalidInput(
                f"role must be one of {[r.value for r in Role]}", code="invalid_role", field="role"
            ) from None

    @property
    def actor(self) -> str:
        return f"staff:{self.id}"


@dataclass
class ReviewQueue:
    sessions: sessionmaker[Session]
    gateway: Gateway
    registry: KindRegistry
    lookup_timeout: float = 10.0

    @property
    def storage(self) -> Storage:
        """The database's Storage."""
        return storage_for(self.sessions)

    def list(
        self,
        staff: Staff,
        *,
        tenant: str | None = None,
        reason: str | None = None,
        older_than: timedelta | None = None,
        include_resolved: bool = False,
        limit: int = 100,
    ) -> list[dict[str, Any]]:
        """Review items, oldest first."""
        audit.info("review list", extra={"staff": staff.id, "role": staff.role.value})
        with self.sessions() as session:
            cutoff = db_time(session) - older_than if older_than is not None else None
            items = list_review_items(
                session,
                tenant=tenant,
                reason=reason,
                created_before=cutoff,
                include_resolved=include_resolved,
                limit=limit,
            )
            return [
                {**_item(item), "op_id": op_id, "kind": kind, "state": state}
                for item, op_id, kind, state in items
            ]

    def show(self, staff: Staff, item_id: int) -> dict[str, Any]:
        """The item, its operation, the attempt timeline, lookups and events."""
        audit.info("review show", extra={"staff": staff.id, "item": item_id})
        with self.sessions() as session:
            item, op = self._load(session, item_id)
            attempts = attempts_of(session, op.id)
            events = events_of(session, op.id)
            return {
                "item": _item(item),
                "operation": {
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
                },
                "attempts": [
                    {
                        "number": a.number,
                        "started_at": a.started_at.isoformat(),
                        "proof": a.proof,
                        "status_code": a.status_code,
                        "detail": a.detail,
                    }
                    for a in attempts
                ],
                "events": [
                    {
                        "at": e.at.isoformat(),
                        "from": e.from_state,
                        "to": e.to_state,
                        "actor": e.actor,
                        "reason": e.reason,
                        "evidence": e.evidence,
                    }
                    for e in events
                ],
            }

    def requery(self, staff: Staff, item_id: int) -> dict[str, Any]:
        """Ask the downstream again now; settle the operation if the lookup finds it."""
        try:
            return self._requery(staff, item_id)
        except SettledError as exc:
            self._refused(staff, item_id, "requery", exc)
            raise

    def _requery(self, staff: Staff, item_id: int) -> dict[str, Any]:
        _require(staff)
        with self.sessions() as session:
            _, op = self._load(session, item_id, open_only=True)
            snapshot = _snapshot(op)
            clock = self._clock(session)
        lookup = self._lookup(snapshot, clock)
        result: dict[str, Any] = {"item": item_id, "lookup": lookup_name(lookup)}
        with self.sessions.begin() as session:
            if isinstance(lookup, Found):
                settled = settlement(lookup)
                evidence = {"lookup": "found", "by": staff.actor, "role": staff.role.value}
                if not settle_unknown(
                    self.storage, session, snapshot["id"], Event.FIND, settled.state,
                    actor=staff.actor, reason=settled.reason, receipt=settled.receipt,
                    evidence=evidence,
                ):  # fmt: skip
                    raise ReviewConflict("the operation is no longer unknown", code="settled")
                result["state"] = settled.state.value
            else:
                note_staff_action(
                    self.storage,
                    session,
                    snapshot["id"],
                    actor=staff.actor,
                    note="staff_requery",
                    evidence={"lookup": result["lookup"], "role": staff.role.value},
                )
                result["state"] = State.UNKNOWN.value
        audit.info("review requery", extra={"staff": staff.id, "item": item_id, **result})
        return result

    def resolve(
        self,
        staff: Staff,
        item_id: int,
        *,
        outcome: str,
        version: int,
        reference: str | None = None,
        justification: str | None = None,
        override: bool = False,
    ) -> dict[str, Any]:
        """Settle the item's operation as ``succeeded`` or ``rejected``, with evidence.

        What may be stored is weighed against the downstream's lookup
        (``reconciler.evidence``): "rejected" on a "not found" needs the proof the reconciler
        needs (asked after quiescence, inside the key retention less its margin); where the
        lookup cannot tell, ``override`` (a supervisor, with the written justification)
        records the resolution as their statement, and says so in the audit trail. A refused
        resolution is recorded too.
        """
        try:
            return self._resolve(
                staff, item_id, outcome=outcome, version=version, reference=reference,
                justification=justification, override=override,
            )  # fmt: skip
        except SettledError as exc:
            self._refused(staff, item_id, "resolve", exc, outcome=outcome, override=override)
            raise

    def _resolve(
        self,
        staff: Staff,
        item_id: int,
        *,
        outcome: str,
        version: int,
        reference: str | None,
        justification: str | None,
        override: bool,
    ) -> dict[str, Any]:
        _require(staff)
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
        if override and staff.role is not Role.SUPERVISOR:
            raise Forbidden("only a supervisor may override the evidence rule", code="forbidden")
        with self.sessions() as session:
            item, op = self._load(session, item_id)
            if item.resolved_at is not None:
                raise _already_resolved(item)
            if item.version != version:
                raise ReviewConflict(
                    "this item changed since you read it; show it again", code="stale_version"
                )
            snapshot = _snapshot(op)
            facts = operation_facts(session, op.id)
            clock = self._clock(session)
        kind = self.registry.get(snapshot["kind"])
        lookup = self._lookup(snapshot, clock)
        doubt = None
        if isinstance(lookup, LookupNotFound):
            doubt = not_found_doubt(self._situation(snapshot, kind.contract, facts, clock))
        weighed = weigh(lookup, to, reference, doubt=doubt, override=override)
        evidence = {
            "by": staff.actor,
            "role": staff.role.value,
            "reference": reference,
            "justification": justification,
            "lookup": lookup_name(lookup),
            "review_item": item_id,
        }
        if weighed.unproven is not None:  # accepted only through the override
            evidence.update(override=True, unproven=weighed.unproven)
        receipt = weighed.record
        reason = RejectReason.NOT_EXECUTED if to is State.REJECTED else None
        if weighed.settles is not None:  # the downstream's own record, and its reason
            reason = weighed.settles.reason
        if receipt is None and (lookup is None or weighed.unproven is not None):
            # A person's statement, recorded as one (never as the downstream's receipt).
            receipt = {"source": "staff", "staff": staff.id, "status": to.value}
            if reference is not None:
                receipt["reference"] = reference
        with self.sessions.begin() as session:
            # The operation row first, then the item: the lock order of every writer.
            if not settle_unknown(
                self.storage,
                session,
                snapshot["id"],
                Event.RESOLVE,
                to,
                actor=staff.actor,
                reason=reason,
                receipt=receipt,
                evidence=evidence,
                close_review=False,
            ):
                raise self._conflict(session, item_id)
            if not resolve_review(
                session,
                item_id,
                version=version,
                by=staff.actor,
                resolution={"state": to.value, "reference": reference, "override": override},
                note=justification,
            ):
                raise self._conflict(session, item_id)
        audit.info("review resolve", extra={"staff": staff.id, "item": item_id, "state": to.value})
        return {"item": item_id, "state": to.value, "operation": snapshot["op_id"]}

    def _refused(
        self, staff: Staff, item_id: int, action: str, exc: SettledError, **detail: Any
    ) -> None:
        """Record a refused staff action in the operation's events: who tried what, and why
        it was refused (lost race, contradiction, role, bad input). Nothing else changes."""
        evidence = {"action": action, "code": exc.code, "role": staff.role.value, **detail}
        audit.warning("review refused", extra={"staff": staff.id, "item": item_id, **evidence})
        try:
            with self.sessions.begin() as session:
                item = review_item(session, item_id)
                if item is None:
                    return  # no such item: nothing to attach the attempt to
                note_staff_action(
                    self.storage,
                    session,
                    item.operation_id,
                    actor=staff.actor,
                    note="staff_refused",
                    evidence={**evidence, "item": item_id},
                )
        except Exception:  # the refusal itself must still reach the caller
            log.exception("could not record a refused staff action")

    def _conflict(self, session: Session, item_id: int) -> ReviewConflict:
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

    def _clock(self, session: Session) -> DbClock:
        mono = time.monotonic()
        return DbClock(db_time(session), mono)

    def _situation(
        self,
        snapshot: dict[str, Any],
        contract: DownstreamContract,
        facts: OperationFacts,
        clock: DbClock,
    ) -> Situation:
        return Situation(
            state=State.UNKNOWN,
            contract=contract,
            now=clock.now(),
            deadline=snapshot["deadline"],
            first_sent_at=snapshot["first_sent_at"],
            last_sent_at=facts.last_sent_at,
            unknown_since=facts.unknown_since,
            lookups=facts.lookups,
            client_timeout=timedelta(seconds=self.lookup_timeout),
            review_after=timedelta(0),
            in_review=True,
            asked_at=clock.db_at,
            sends=facts.sends,
        )

    def _load(
        self, session: Session, item_id: int, *, open_only: bool = False
    ) -> tuple[ReviewItem, Operation]:
        item = review_item(session, item_id)
        if item is None:
            raise NotFound("no such review item", code="review_item_not_found")
        if open_only and item.resolved_at is not None:
            raise _already_resolved(item)
        op = operation(session, item.operation_id)
        assert op is not None
        return item, op

    def _lookup(self, snapshot: dict[str, Any], clock: DbClock) -> LookupOutcome | None:
        kind = self.registry.get(snapshot["kind"])
        if not kind.contract.queryable:
            return None
        result: LookupOutcome = self.gateway.lookup(
            tenant=snapshot["tenant"],
            kind=kind,
            idempotency_key=snapshot["idempotency_key"],
            params=snapshot["params"],
            deadline=clock.after(self.lookup_timeout),
        )
        return result


def _require(staff: Staff) -> None:
    if staff.role not in ACTING:
        raise Forbidden(f"role {staff.role.value!r} may only list and show", code="forbidden")


def _outcome(outcome: str) -> State:
    if outcome == "succeeded":
        return State.SUCCEEDED
    if outcome == "rejected":
        return State.REJECTED
    raise InvalidInput("outcome must be 'succeeded' or 'rejected'", code="invalid_outcome")


def _already_resolved(item: ReviewItem) -> ReviewConflict:
    return ReviewConflict(
        f"this item was already resolved by {item.resolved_by}",
        code="already_resolved",
        resolved_by=item.resolved_by,
    )


def _snapshot(op: Operation) -> dict[str, Any]:
    return {
        "id": op.id,
        "tenant": op.tenant,
        "op_id": op.op_id,
        "kind": op.kind,
        "params": op.params,
        "idempotency_key": op.idempotency_key,
        "deadline": op.deadline,
        "first_sent_at": op.first_sent_at,
    }


def _item(item: ReviewItem) -> dict[str, Any]:
    return {
        "id": item.id,
        "tenant": item.tenant,
        "reason": item.reason,
        "version": item.version,
        "created_at": item.created_at.isoformat(),
        "resolved_at": item.resolved_at.isoformat() if item.resolved_at else None,
        "resolved_by": item.resolved_by,
        "evidence": item.evidence,
    }
