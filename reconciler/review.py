"""The manual review queue that support staff work: list and show, requery and resolve.

Staff can only settle an undeterminable operation, as ``succeeded`` or ``rejected``, never
change it; two staff racing on one item: one wins, the other gets ReviewConflict. A refused
action is recorded on the operation too. Who staff are, what each role may do and the way out
of each review reason: ``reconciler.staff``; what a resolution asks, stores and writes:
``reconciler.resolve``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from outbox.clock import DbClock
from outbox.downstream import Found, Gateway, LookupOutcome, lookup_name, settlement
from outbox.errors import NotFound, ReviewConflict, SettledError
from outbox.kinds import KindRegistry
from outbox.models import Operation, ReviewItem
from outbox.states import Event, State
from outbox.storage import Storage, storage_for
from outbox.storage.attempts import attempts_of, operation_facts
from outbox.storage.events import events_of
from outbox.storage.operations import db_time, operation
from outbox.storage.reviews import list_review_items, note_staff_action, review_item, settle_unknown
from reconciler.resolve import (
    Resolution,
    already_resolved,
    check_current,
    doubt_of,
    record_of,
    write_resolution,
)
from reconciler.staff import Staff, require_acting

audit = logging.getLogger("settled.audit")
log = logging.getLogger(__name__)


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
        require_acting(staff)
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
            resolution = Resolution.parse(
                staff, item_id, outcome=outcome, version=version, reference=reference,
                justification=justification, override=override,
            )  # fmt: skip
            return self._resolve(resolution)
        except SettledError as exc:
            self._refused(staff, item_id, "resolve", exc, outcome=outcome, override=override)
            raise

    def _resolve(self, resolution: Resolution) -> dict[str, Any]:
        item_id = resolution.item_id
        with self.sessions() as session:
            item, op = self._load(session, item_id)
            check_current(item, resolution.version)
            snapshot = _snapshot(op)
            facts = operation_facts(session, op.id)
            clock = self._clock(session)
        contract = self.registry.get(snapshot["kind"]).contract
        lookup = self._lookup(snapshot, clock)
        doubt = doubt_of(
            lookup, snapshot, contract, facts, clock, lookup_timeout=self.lookup_timeout
        )
        record = record_of(resolution, lookup, doubt=doubt)
        with self.sessions.begin() as session:
            write_resolution(self.storage, session, snapshot["id"], resolution, record)
        state = resolution.to.value
        audit.info(
            "review resolve", extra={"staff": resolution.staff.id, "item": item_id, "state": state}
        )
        return {"item": item_id, "state": state, "operation": snapshot["op_id"]}

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

    def _clock(self, session: Session) -> DbClock:
        mono = time.monotonic()
        return DbClock(db_time(session), mono)

    def _load(
        self, session: Session, item_id: int, *, open_only: bool = False
    ) -> tuple[ReviewItem, Operation]:
        item = review_item(session, item_id)
        if item is None:
            raise NotFound("no such review item", code="review_item_not_found")
        if open_only and item.resolved_at is not None:
            raise already_resolved(item)
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
