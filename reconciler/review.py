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
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from outbox import store
from outbox.errors import Forbidden, InvalidInput, NotFound, ReviewConflict
from outbox.kinds import KindRegistry
from outbox.models import Attempt, Operation, OperationEvent, ReviewItem
from outbox.states import Event, RejectReason, State
from workers.gateway import Found, Gateway, LookupOutcome, Unavailable
from workers.gateway import NotFound as LookupNotFound

audit = logging.getLogger("settled.audit")

STAFF_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
REFERENCE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
MIN_JUSTIFICATION = 10
MAX_JUSTIFICATION = 2000


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
        stmt = (
            select(ReviewItem, Operation.op_id, Operation.kind, Operation.state)
            .join(Operation, Operation.id == ReviewItem.operation_id)
            .order_by(ReviewItem.created_at, ReviewItem.id)
            .limit(limit)
        )
        if not include_resolved:
            stmt = stmt.where(ReviewItem.resolved_at.is_(None))
        if tenant is not None:
            stmt = stmt.where(ReviewItem.tenant == tenant)
        if reason is not None:
            stmt = stmt.where(ReviewItem.reason == reason)
        with self.sessions() as session:
            if older_than is not None:
                cutoff = store.db_time(session) - older_than
                stmt = stmt.where(ReviewItem.created_at <= cutoff)
            return [
                {**_item(item), "op_id": op_id, "kind": kind, "state": state}
                for item, op_id, kind, state in session.execute(stmt)
            ]

    def show(self, staff: Staff, item_id: int) -> dict[str, Any]:
        """The item, its operation, the attempt timeline, lookups and events."""
        audit.info("review show", extra={"staff": staff.id, "item": item_id})
        with self.sessions() as session:
            item, op = self._load(session, item_id)
            attempts = session.scalars(
                select(Attempt).where(Attempt.operation_id == op.id).order_by(Attempt.number)
            )
            events = session.scalars(
                select(OperationEvent)
                .where(OperationEvent.operation_id == op.id)
                .order_by(OperationEvent.id)
            )
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
        _require(staff)
        with self.sessions() as session:
            _, op = self._load(session, item_id, open_only=True)
            snapshot = _snapshot(op)
        lookup = self._lookup(snapshot)
        result: dict[str, Any] = {"item": item_id, "lookup": _lookup_name(lookup)}
        with self.sessions.begin() as session:
            if isinstance(lookup, Found):
                to = State.SUCCEEDED if lookup.receipt.status == "succeeded" else State.REJECTED
                reason = (
                    None
                    if to is State.SUCCEEDED
                    else (lookup.reason or RejectReason.BUSINESS_REJECTED)
                )
                evidence = {"lookup": "found", "by": staff.actor, "role": staff.role.value}
                if not store.settle_unknown(
                    session, snapshot["id"], Event.FIND, to, actor=staff.actor, reason=reason,
                    receipt=lookup.receipt.as_dict(), evidence=evidence,
                ):  # fmt: skip
                    raise ReviewConflict("the operation is no longer unknown", code="settled")
                store.close_reviews(
                    session,
                    snapshot["id"],
                    by=staff.actor,
                    resolution={"state": to.value, **evidence},
                )
                result["state"] = to.value
            else:
                store.record_note(
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
    ) -> dict[str, Any]:
        """Settle the item's operation as ``succeeded`` or ``rejected``, with evidence."""
        _require(staff)
        to = _outcome(outcome)
        if to is State.SUCCEEDED and (
            not isinstance(reference, str) or REFERENCE.fullmatch(reference) is None
        ):
            raise InvalidInput(
                "resolving as succeeded needs the downstream's reference",
                code="reference_required",
            )
        if to is State.REJECTED:
            text = (justification or "").strip()
            if not MIN_JUSTIFICATION <= len(text) <= MAX_JUSTIFICATION:
                raise InvalidInput(
                    f"resolving as rejected needs a written justification "
                    f"({MIN_JUSTIFICATION} to {MAX_JUSTIFICATION} characters)",
                    code="justification_required",
                )
        with self.sessions() as session:
            item, op = self._load(session, item_id)
            if item.resolved_at is not None:
                raise ReviewConflict("this item was already resolved", code="already_resolved")
            if item.version != version:
                raise ReviewConflict(
                    "this item changed since you read it; show it again", code="stale_version"
                )
            snapshot = _snapshot(op)
        kind = self.registry.get(snapshot["kind"])
        lookup = self._lookup(snapshot) if kind.contract.queryable else None
        _check_against(lookup, to, reference)
        evidence = {
            "by": staff.actor,
            "role": staff.role.value,
            "reference": reference,
            "justification": justification,
            "lookup": _lookup_name(lookup),
            "review_item": item_id,
        }
        receipt = None
        if to is State.SUCCEEDED:
            receipt = (
                lookup.receipt.as_dict()
                if isinstance(lookup, Found)
                else {"reference": reference, "status": "succeeded", "source": "staff"}
            )
        with self.sessions.begin() as session:
            if not store.resolve_review(
                session,
                item_id,
                version=version,
                by=staff.actor,
                resolution={"state": to.value, "reference": reference},
                note=justification,
            ):
                raise ReviewConflict("somebody else resolved this item first", code="lost_race")
            if not store.settle_unknown(
                session,
                snapshot["id"],
                Event.RESOLVE,
                to,
                actor=staff.actor,
                reason=RejectReason.NOT_EXECUTED if to is State.REJECTED else None,
                receipt=receipt,
                evidence=evidence,
            ):
                raise ReviewConflict("the operation is no longer unknown", code="settled")
        audit.info("review resolve", extra={"staff": staff.id, "item": item_id, "state": to.value})
        return {"item": item_id, "state": to.value, "operation": snapshot["op_id"]}

    def _load(
        self, session: Session, item_id: int, *, open_only: bool = False
    ) -> tuple[ReviewItem, Operation]:
        item = session.get(ReviewItem, item_id)
        if item is None:
            raise NotFound("no such review item", code="review_item_not_found")
        if open_only and item.resolved_at is not None:
            raise ReviewConflict("this item was already resolved", code="already_resolved")
        op = session.get(Operation, item.operation_id)
        assert op is not None
        return item, op

    def _lookup(self, snapshot: dict[str, Any]) -> LookupOutcome | None:
        kind = self.registry.get(snapshot["kind"])
        if not kind.contract.queryable:
            return None
        result: LookupOutcome = self.gateway.lookup(
            tenant=snapshot["tenant"],
            kind=kind,
            idempotency_key=snapshot["idempotency_key"],
            params=snapshot["params"],
            deadline=datetime.now(UTC) + timedelta(seconds=self.lookup_timeout),
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


def _check_against(lookup: LookupOutcome | None, to: State, reference: str | None) -> None:
    """Refuse a resolution the downstream's own record contradicts (or cannot confirm now)."""
    if lookup is None:
        return  # no lookup API: the staff's evidence is all there is
    if isinstance(lookup, Unavailable):
        raise ReviewConflict(
            "the downstream's lookup is unavailable; it must confirm first, try again later",
            code="lookup_unavailable",
        )
    if to is State.SUCCEEDED:
        agrees = (
            isinstance(lookup, Found)
            and lookup.receipt.status == "succeeded"
            and lookup.receipt.reference == reference
        )
    else:
        agrees = isinstance(lookup, LookupNotFound) or (
            isinstance(lookup, Found) and lookup.receipt.status != "succeeded"
        )
    if not agrees:
        raise ReviewConflict(
            f"the downstream's lookup ({_lookup_name(lookup)}) contradicts '{to.value}'",
            code="contradicts_downstream",
            lookup=_lookup_name(lookup),
        )


def _snapshot(op: Operation) -> dict[str, Any]:
    return {
        "id": op.id,
        "tenant": op.tenant,
        "op_id": op.op_id,
        "kind": op.kind,
        "params": op.params,
        "idempotency_key": op.idempotency_key,
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


def _lookup_name(lookup: LookupOutcome | None) -> str:
    if lookup is None:
        return "none"
    return type(lookup).__name__.lower()
