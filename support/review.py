"""The manual review queue that support staff work: list and show, requery and resolve.

Staff can only settle an undeterminable operation, as ``succeeded`` or ``rejected``, never
change it; two staff racing on one item: one wins, the other gets ReviewConflict. A refused
action is recorded on the operation too. Who staff are, what each role may do and the way out
of each review reason: ``support.staff``; what a resolution asks, stores and writes:
``support.resolve``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from outbox.clock import DbClock
from outbox.clock_steps import ClockWatch
from outbox.downstream import (
    DownstreamRequest,
    Found,
    Gateway,
    LookupMisuse,
    LookupOutcome,
    lookup_name,
    mismatch_evidence,
    settlement,
)
from outbox.errors import InvalidInput, NotFound, ReviewConflict, SettledError
from outbox.kinds import KindRegistry
from outbox.models import Operation, ReviewItem
from outbox.port_shim import as_gateway
from outbox.states import Event, State
from outbox.storage import Storage, storage_for
from outbox.storage.attempts import operation_facts
from outbox.storage.operations import db_time, operation
from outbox.storage.reviews import (
    note_staff_action,
    resolve_review,
    review_item,
    settle_unknown,
)
from outbox.storage.search import review_page
from support.evidence import allowed_choices
from support.operation_view import operation_view
from support.resolve import (
    MIN_JUSTIFICATION,
    Resolution,
    already_resolved,
    check_current,
    confirm_terminal,
    doubt_of,
    record_of,
    write_resolution,
)
from support.staff import ACTING, OVERRIDING, Staff, require_acting

audit = logging.getLogger("settled.audit")
log = logging.getLogger(__name__)

MAX_PAGE = 500
#: Who saw a step of the database's clock, where staff's review queue saw it.
_WATCHER = "review"


@dataclass(frozen=True)
class Page:
    """One page of a list, and how many items match in all."""

    items: list[dict[str, Any]]
    total: int
    offset: int
    limit: int


@dataclass
class ReviewQueue:
    sessions: sessionmaker[Session]
    gateway: Gateway
    registry: KindRegistry
    lookup_timeout: float = 10.0
    #: this process's watch on the database's clock (shared with its other services)
    clock_watch: ClockWatch = field(default_factory=ClockWatch)

    def __post_init__(self) -> None:
        self.gateway = as_gateway(self.gateway, stacklevel=3)  # an old-style adapter too

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
        """Review items, oldest first (the first ``limit`` of ``page``)."""
        return self.page(
            staff, tenant=tenant, reason=reason, older_than=older_than,
            include_resolved=include_resolved, limit=limit,
        ).items  # fmt: skip

    def page(
        self,
        staff: Staff,
        *,
        tenant: str | None = None,
        reason: str | None = None,
        kind: str | None = None,
        older_than: timedelta | None = None,
        include_resolved: bool = False,
        offset: int = 0,
        limit: int = 50,
    ) -> Page:
        """One page of review items, oldest first, and how many match: only those of the
        tenants ``staff`` may see; each filter given narrows the list."""
        audit.info("review list", extra={"staff": staff.id, "role": staff.role.value})
        if offset < 0 or not 1 <= limit <= MAX_PAGE:
            raise InvalidInput(f"a page is 1 to {MAX_PAGE} items from offset 0", code="bad_page")
        with self.sessions() as session:
            cutoff = db_time(session) - older_than if older_than is not None else None
            rows, total = review_page(
                session, tenants=staff.tenants, tenant=tenant, reason=reason, kind=kind,
                created_before=cutoff, include_resolved=include_resolved, offset=offset,
                limit=limit,
            )  # fmt: skip
            items = [
                {
                    **_item(item),
                    "op_id": op_id,
                    "kind": kind,
                    "state": state,
                    **_listed(params, self.registry.order_of(kind, params)),
                }
                if item.operation_id is not None
                else _orphan_row(item)
                for item, op_id, kind, state, params in rows
            ]
            return Page(items, total, offset, limit)

    def show(self, staff: Staff, item_id: int) -> dict[str, Any]:
        """The item, its operation, the attempt timeline, lookups, events and run, and the
        resolutions the last lookup allows this member of staff."""
        audit.info("review show", extra={"staff": staff.id, "item": item_id})
        with self.sessions() as session:
            item, op = self._load(session, staff, item_id)
            shown = operation_view(session, op)
            kind = self.registry.get(op.kind)
            last = "none" if not kind.contract.queryable else shown["last_lookup"]
            # a lookup that found our record proves its outcome: only that one is offered
            record = shown["lookups"][-1]["record"] if shown["lookups"] else None
            status = record["status"] if record is not None and last != "none" else None
            choices = allowed_choices(last, status, may_override=staff.role in OVERRIDING)
            acting = staff.role in ACTING and item.resolved_at is None
            return {
                "item": _item(item),
                **shown,
                "choices": [asdict(c) for c in choices] if acting else [],
                # what a "rejected" on a "not found" would rest on (None: no lookup to trust)
                "rests_on": kind.contract.assumption() if kind.contract.queryable else None,
            }

    def status(self, staff: Staff, item_id: int) -> dict[str, Any]:
        """What the item page polls: the item (open, or resolved by whom) and its operation's
        identity and state; NotFound like ``show``. Nothing else is read, nor audited beyond
        a debug line (``show`` audits the opening of the page)."""
        audit.debug("review status", extra={"staff": staff.id, "item": item_id})
        with self.sessions() as session:
            item, op = self._load(session, staff, item_id)
            return {
                "item": _item(item),
                "operation": {
                    "tenant": op.tenant, "op_id": op.op_id, "kind": op.kind,
                    "state": op.state, "reason": op.reason,
                },
            }  # fmt: skip

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
            _, op = self._load(session, staff, item_id, open_only=True)
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
                    evidence={
                        "lookup": result["lookup"],
                        "role": staff.role.value,
                        **(mismatch_evidence(lookup) if isinstance(lookup, LookupMisuse) else {}),
                    },
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
        (``support.evidence``): "rejected" on a "not found" needs the proof the reconciler
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
        closed = self._close_orphan(resolution)
        if closed is not None:
            return closed
        with self.sessions() as session:
            item, op = self._load(session, resolution.staff, item_id)
            check_current(item, resolution.version)
            snapshot = _snapshot(op)
            ended = State(op.state)
            facts = operation_facts(session, op.id)
            clock = self._clock(session)
            clock_doubt = self.clock_watch.doubt_until(session)
        if ended.terminal:  # nothing to settle: staff confirm what it ended as
            with self.sessions.begin() as session:
                confirm_terminal(self.storage, session, snapshot["id"], ended, resolution)
            return self._resolved(resolution, snapshot["op_id"])
        contract = self.registry.get(snapshot["kind"]).contract
        lookup = self._lookup(snapshot, clock)
        with self.sessions() as session:  # the lookup's own answer measured among the rest
            lag = self.clock_watch.downstream_lag(session, snapshot["kind"], clock.now())
        doubt = doubt_of(
            lookup, snapshot, contract, facts, clock, lookup_timeout=self.lookup_timeout,
            clock_doubt_until=clock_doubt,
            downstream_lag=None if lag is None else timedelta(seconds=lag),
            clock_margin=timedelta(seconds=self.clock_watch.downstreams.margin),
        )  # fmt: skip
        record = record_of(resolution, lookup, doubt=doubt, contract=contract)
        with self.sessions.begin() as session:
            write_resolution(self.storage, session, snapshot["id"], resolution, record)
        return self._resolved(resolution, snapshot["op_id"])

    def _close_orphan(self, resolution: Resolution) -> dict[str, Any] | None:
        """Close an orphan effect's item (None: the item has an operation): only as succeeded
        (the downstream did it), with the downstream's reference and a statement of what staff
        did about it; nothing else is written (there is no operation to settle)."""
        with self.sessions.begin() as session:
            item = review_item(session, resolution.item_id)
            if item is None or not resolution.staff.sees(item.tenant):
                raise NotFound("no such review item", code="review_item_not_found")
            if item.operation_id is not None:
                return None
            check_current(item, resolution.version)
            text = (resolution.justification or "").strip()
            if resolution.to is not State.SUCCEEDED or len(text) < MIN_JUSTIFICATION:
                raise InvalidInput(ORPHAN_RESOLUTION, code="orphan_resolution")
            if resolution.reference != item.evidence.get("reference"):
                raise InvalidInput(
                    "the reference is not the orphan effect's own", code="reference_mismatch"
                )
            done = resolve_review(
                session, item.id, version=resolution.version, by=resolution.staff.actor,
                resolution={"outcome": "succeeded", "reference": resolution.reference,
                            "orphan_effect": True, "justification": text},
                note=text,
            )  # fmt: skip
            if not done:
                raise already_resolved(item)
        audit.info("review resolve orphan", extra={"staff": resolution.staff.id,
                                                   "item": resolution.item_id})  # fmt: skip
        return {"item": resolution.item_id, "state": "succeeded", "operation": None}

    def _resolved(self, resolution: Resolution, op_id: str) -> dict[str, Any]:
        item_id, state = resolution.item_id, resolution.to.value
        audit.info(
            "review resolve", extra={"staff": resolution.staff.id, "item": item_id, "state": state}
        )
        return {"item": item_id, "state": state, "operation": op_id}

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
                if item is None or not staff.sees(item.tenant) or item.operation_id is None:
                    return  # no such item (for this member), or no operation to attach it to
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
        """The database's time, read now; a step of its clock this shows is logged and
        recorded for every process."""
        mono = time.monotonic()
        clock = DbClock(db_time(session), mono)
        step = self.clock_watch.seen(clock.db_at, mono, time.monotonic(), by=_WATCHER)
        if step is not None:
            self.clock_watch.record_now(self.sessions, step, by=_WATCHER)
        return clock

    def _load(
        self, session: Session, staff: Staff, item_id: int, *, open_only: bool = False
    ) -> tuple[ReviewItem, Operation]:
        """The item and its operation; NotFound also for an item of a tenant ``staff`` may
        not see (the same answer as a missing one: no oracle)."""
        item = review_item(session, item_id)
        if item is None or not staff.sees(item.tenant):
            raise NotFound("no such review item", code="review_item_not_found")
        if item.operation_id is None:
            raise InvalidInput(ORPHAN_ITEM, code="orphan_effect_item")
        if open_only and item.resolved_at is not None:
            raise already_resolved(item)
        op = operation(session, item.operation_id)
        assert op is not None
        return item, op

    def _lookup(self, snapshot: dict[str, Any], clock: DbClock) -> LookupOutcome | None:
        kind = self.registry.get(snapshot["kind"])
        if not kind.contract.queryable:
            return None
        request = DownstreamRequest(
            snapshot["tenant"], snapshot["op_id"], kind, snapshot["idempotency_key"],
            snapshot["params"],
        )  # fmt: skip
        result = self.gateway.lookup(request, deadline=clock.after(self.lookup_timeout))
        return result


#: What an orphan effect's item answers where an operation's item shows its operation.
ORPHAN_ITEM = (
    "this item is an orphan effect: the downstream holds it with no operation here, so there "
    "is nothing here to requery or settle; its evidence is in `settled review list --json` and "
    '`settled ops audit --json` (docs/support.md, "Orphan effects")'
)


#: Why an orphan effect's item cannot be resolved as asked.
ORPHAN_RESOLUTION = (
    "an orphan effect was done at the downstream: resolve it as succeeded, with its reference "
    f"and a justification ({MIN_JUSTIFICATION} characters or more) saying what was done about it"
)


def _orphan_row(item: ReviewItem) -> dict[str, Any]:
    """A queue row of an orphan effect's item: what the downstream's record says of it."""
    evidence = item.evidence
    return {
        **_item(item), "op_id": evidence.get("op_id"), "kind": None, "state": None,
        "order_id": None, "amount_minor": evidence.get("amount_minor"),
        "currency": evidence.get("currency"), "payee": None,
    }  # fmt: skip


def _listed(params: dict[str, Any], order: str | None) -> dict[str, Any]:
    """What a queue row shows of an operation: its order (``Kind.order_of`` its params), and
    the amount and payee of its params, where its kind has them (None where not)."""
    return {
        "order_id": order,
        "amount_minor": params.get("amount_minor"),
        "currency": params.get("currency"),
        "payee": params.get("payee"),
    }


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
