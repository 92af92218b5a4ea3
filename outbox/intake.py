"""Intake: the call a backend app makes inside its own transaction.

``Outbox.enqueue`` writes the operation intent into the caller's session and never commits:
the business row and the intent commit together, or neither does.

The app's transaction may stay open for a while after ``enqueue``, and a rule that reads
committed rows (the agents' policy: a second refund on an order is never approved by itself;
an original is compensated once) would not see what it wrote. So intake takes the locks those
rules read under, held until the app commits or rolls back: the order's lock, shared (in the
INSERT itself on PostgreSQL: no extra round trip), and for a compensation the original's
compensation lock, under which it refuses a second compensation (``already_compensated``).
A rule that runs meanwhile waits for the app's transaction and reads what it committed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import Any

from sqlalchemy.orm import Session
from sqlalchemy.orm.util import has_identity

from outbox.errors import (
    IdempotencyConflict,
    InvalidIdentifier,
    InvalidInput,
    NotFound,
)
from outbox.fingerprint import Fingerprinter, canonical_params
from outbox.ids import (
    derive_idempotency_key,
    validate_correlation_id,
    validate_op_id,
    validate_tenant,
)
from outbox.kinds import Intent, Kind, KindRegistry, default_registry
from outbox.models import Operation, OperationTombstone, Run
from outbox.observer import NO_OBSERVER, Observer, guarded
from outbox.settings import Settings
from outbox.states import State
from outbox.storage import borrowed, storage_for, tombstones
from outbox.storage.borrowed import Door, session_for
from outbox.storage.operations import INTAKE_RETURNS, compensations_of, find_operation
from outbox.tombstones import Tombstone

#: ``Session.info`` key listing the operations created in the session's transaction.
CREATED_KEY = "settled.created"
MAX_ATTEMPTS_LIMIT = 100
#: a compensation in one of these states undid nothing: another may be enqueued after it
UNDID_NOTHING = frozenset({State.REJECTED.value, State.CANCELLED.value})


def order_lock(tenant: str, kind: str, order_ref: str) -> str:
    """The key of the lock of ``kind``'s operations and proposals on one order
    (``Storage.lock_order``): intake takes it shared, the agents' rules exclusively."""
    return f"order:{tenant}:{kind}:{order_ref}"


def compensation_lock(tenant: str, operation_id: int) -> str:
    """The key of the lock under which operation ``operation_id`` gets a compensation
    (``Storage.serialize``): one at a time, each seeing the one before."""
    return f"compensate:{tenant}:{operation_id}"


@dataclass(frozen=True)
class Enqueued:
    """What intake did: the operation's identity and state at intake, and whether this call
    created it.

    The values are the ones the intake statement returned: a new operation is not loaded into
    the session. ``operation`` is the whole row as an ORM entity: a replay's is the one intake
    read; a new one's is read once, on first use (``Enqueued.operation``).

    ``door``: the app's connection when intake wrote on one (``outbox.borrowed``), else None;
    ``session`` is then the Session intake made over it, closed once ``enqueue`` returned.

    ``pruned``: a replay of an operation that was pruned (``settled ops prune``), answered
    from its tombstone (``outbox.tombstones.Tombstone``: final state, reason, the downstream's
    reference, when it was pruned). Its row is gone, and what only the row held is not made
    up: ``id`` and ``deadline`` are None, ``run_id``, ``compensates_id`` and
    ``correlation_id`` None, and ``operation`` raises NotFound (``operation_pruned``).
    ``state`` is its final state, ``idempotency_key`` the key it was sent with.
    """

    #: None only for a pruned operation (``pruned``)
    id: int | None
    tenant: str
    op_id: str
    kind: str
    state: str
    idempotency_key: str
    #: None only for a pruned operation (``pruned``)
    deadline: datetime | None
    run_id: int | None
    compensates_id: int | None
    correlation_id: str | None
    created: bool
    session: Session = field(repr=False, compare=False)
    door: object = field(default=None, repr=False, compare=False)
    pruned: Tombstone | None = None

    @classmethod
    def of(
        cls, operation: Operation, *, created: bool, session: Session, door: object = None
    ) -> Enqueued:
        """The values of a loaded ``operation``, which ``operation`` then answers with."""
        got = cls(
            **{name: getattr(operation, name) for name in INTAKE_RETURNS},
            created=created,
            session=session,
            door=door,
        )
        got.__dict__["operation"] = operation  # cached_property's slot: no read on first use
        return got

    @classmethod
    def of_tombstone(cls, tomb: Tombstone, *, session: Session, door: object = None) -> Enqueued:
        """The replay answer of a pruned operation, from its tombstone."""
        return cls(
            id=None,
            tenant=tomb.tenant,
            op_id=tomb.op_id,
            kind=tomb.kind,
            state=tomb.state,
            idempotency_key=tomb.idempotency_key,
            deadline=None,
            run_id=None,
            compensates_id=None,
            correlation_id=None,
            created=False,
            session=session,
            door=door,
            pruned=tomb,
        )

    @cached_property
    def operation(self) -> Operation:
        """The operation's row: while the intake's transaction is open, the entity in its
        session (the identity map's, or read once); after it ended, a copy read by a session
        of its own, closed at once (the app's session is left as it is: no transaction begun
        in it, no connection held).

        On a connection door (``door``): read once, detached, in the transaction open on the
        app's connection; once no transaction is open there, InvalidInput
        (``transaction_ended``) unless it was read before: Settled does not begin a
        transaction on the app's connection. A pruned operation's (``pruned``): NotFound
        (``operation_pruned``)."""
        if self.pruned is not None or self.id is None:
            raise NotFound(
                "the operation was pruned: only its tombstone is kept (Enqueued.pruned)",
                code="operation_pruned",
            )
        if self.door is not None:
            loaded = borrowed.read(self.door, Operation, self.id)
        elif self.session.in_transaction():
            loaded = self.session.get(Operation, self.id)
        else:
            with Session(self.session.get_bind(), expire_on_commit=False) as own:
                loaded = own.get(Operation, self.id)
                if loaded is not None:
                    own.expunge(loaded)
        if loaded is None:
            raise NotFound(
                "the operation is not stored: its transaction was rolled back",
                code="operation_not_found",
            )
        return loaded


@dataclass(frozen=True)
class Outbox:
    """The intake API, built once from settings at the app's composition root."""

    registry: KindRegistry
    fingerprinter: Fingerprinter
    idempotency_secret: bytes
    max_attempts: int = 5
    deadline: timedelta = timedelta(hours=1)
    #: told of each enqueue (``outbox.observer``; ``settled.observe.observer()`` traces it)
    observer: Observer = NO_OBSERVER

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        registry: KindRegistry | None = None,
        *,
        observer: Observer = NO_OBSERVER,
    ) -> Outbox:
        """The outbox the settings describe, telling ``observer`` of each enqueue.

        Raises InvalidSetting (``development_secrets``) for the development fingerprint key or
        idempotency secret against PostgreSQL (``Settings.development_secrets``): the worker,
        configured with the real ones, would refuse every operation this app wrote.
        """
        settings.refuse_development_secrets()
        return cls(
            registry=registry or default_registry(),
            fingerprinter=Fingerprinter(
                settings.fingerprint_key_bytes(), settings.fingerprint_key_version
            ),
            idempotency_secret=settings.idempotency_secret.get_secret_value().encode(),
            max_attempts=settings.max_attempts,
            deadline=timedelta(seconds=settings.deadline_seconds),
            observer=observer,
        )

    def enqueue(
        self,
        session: Door,
        *,
        tenant: str,
        op_id: str,
        kind: str,
        params: Mapping[str, Any],
        run: Run | None = None,
        correlation_id: str | None = None,
        compensates: Operation | None = None,
        max_attempts: int | None = None,
        deadline: datetime | None = None,
    ) -> Enqueued:
        """Record an operation intent in ``session`` (flushed, never committed).

        ``session``: the app's ``Session``, or its SQLAlchemy ``Connection``, or its psycopg 3
        or sqlite3 connection (``outbox.borrowed``), in the transaction the app commits. On a
        ``Session`` the relay (``outbox.relay.install``) hints the new operation after the
        commit; on a connection the app does (``outbox.relay.publish_hints``). A connection
        that cannot hold the app's transaction is refused before anything is sent
        (InvalidInput: ``no_transaction``, ``transaction_aborted``, ``connection_closed``,
        ``unsupported_connection``).

        A replay of ``(tenant, op_id)`` with the same intent returns the stored operation and
        writes nothing; with another intent it raises IdempotencyConflict. The same holds once
        the operation was pruned: a replay is answered from its tombstone (``Enqueued.pruned``,
        no operation id), never by a new operation. Bad input raises an InvalidInput subclass
        before anything is written.
        """
        door = None if isinstance(session, Session) else session
        with session_for(session) as own:
            watch = guarded(self.observer).enqueuing(own, tenant=tenant, op_id=op_id, kind=kind)
            with watch as seen:
                got = self._enqueue(
                    own,
                    door,
                    tenant=tenant,
                    op_id=op_id,
                    kind=kind,
                    params=params,
                    run=run,
                    correlation_id=correlation_id,
                    compensates=compensates,
                    max_attempts=max_attempts,
                    deadline=deadline,
                )
                seen(got)
                return got

    def _enqueue(
        self,
        session: Session,
        door: object,
        *,
        tenant: str,
        op_id: str,
        kind: str,
        params: Mapping[str, Any],
        run: Run | None,
        correlation_id: str | None,
        compensates: Operation | None,
        max_attempts: int | None,
        deadline: datetime | None,
    ) -> Enqueued:
        request = self._validate(
            tenant=tenant,
            op_id=op_id,
            kind=kind,
            params=params,
            run=run,
            correlation_id=correlation_id,
            compensates=compensates,
            max_attempts=max_attempts,
            deadline=deadline,
        )
        row = self._insert(session, request)
        if row is None:
            return self._replayed(session, door, request)
        values = {name: row[name] for name in INTAKE_RETURNS}
        got = Enqueued(**values, created=True, session=session, door=door)
        _hint_after_commit(session, row["id"])
        return got

    def _validate(
        self,
        *,
        tenant: str,
        op_id: str,
        kind: str,
        params: Mapping[str, Any],
        run: Run | None,
        correlation_id: str | None,
        compensates: Operation | None,
        max_attempts: int | None,
        deadline: datetime | None,
    ) -> _Request:
        """``enqueue``'s arguments checked, in this order: the first bad one is raised,
        before anything is written."""
        tenant = validate_tenant(tenant)
        op_id = validate_op_id(op_id)
        spec = self.registry.get(kind)
        intent = spec.parse(params)
        correlation_id = _checked_correlation_id(correlation_id, op_id)
        attempts = _checked_attempts(self.max_attempts if max_attempts is None else max_attempts)
        checked_deadline = _checked_deadline(deadline)
        run_id = _stored_id(run, Run, tenant, field="run", code="run_not_found")
        compensates_id = _stored_id(
            compensates, Operation, tenant, field="compensates", code="operation_not_found"
        )
        return _Request(
            tenant=tenant,
            op_id=op_id,
            spec=spec,
            intent=intent,
            correlation_id=correlation_id,
            max_attempts=attempts,
            deadline=checked_deadline,
            run_id=run_id,
            compensates_id=compensates_id,
        )

    def _insert(self, session: Session, request: _Request) -> Mapping[str, Any] | None:
        """Insert the operation with its ``created`` event row, one statement; the new row's
        values (``INTAKE_RETURNS``), or None (nothing written) if ``(tenant, op_id)`` is
        already taken.

        Insert first, ON CONFLICT DO NOTHING: a concurrent intake of the same (tenant, op_id)
        waits for the other transaction and then inserts nothing instead of raising; on
        SQLite the write lock is taken before any read, so no lock upgrade can fail.

        The INSERT takes the order's lock, shared, for a kind with an order
        (``Kind.order_field``). A compensation first takes that lock, then the original's, in
        the one lock order, and is refused when the original already has a compensation that
        may have undone something.
        """
        storage = storage_for(session)
        order_ref = request.spec.order_of(request.intent)
        lock = None
        if order_ref is not None:
            lock = order_lock(request.tenant, request.spec.name, order_ref)
        if request.compensates_id is not None:
            if lock is not None:
                storage.lock_order(session, lock, shared=True)
            storage.serialize(session, compensation_lock(request.tenant, request.compensates_id))
            _refuse_second_compensation(session, request)
        return storage.create_operation(
            session,
            self._row_values(request),
            default_deadline_seconds=self.deadline.total_seconds(),
            order_lock=lock,
        )

    def _row_values(self, request: _Request) -> dict[str, Any]:
        """The operation row's values: the request, its fingerprint and idempotency key."""
        version = self.fingerprinter.current
        kind, tenant, op_id = request.spec.name, request.tenant, request.op_id
        return {
            "tenant": tenant,
            "op_id": op_id,
            "kind": kind,
            "params": canonical_params(request.intent),
            "fingerprint": self.fingerprinter.fingerprint(kind, request.intent, version),
            "fingerprint_key_version": version,
            "idempotency_key": derive_idempotency_key(self.idempotency_secret, tenant, op_id),
            "max_attempts": request.max_attempts,
            "deadline": request.deadline,  # None: the default deadline, in database time
            "run_id": request.run_id,
            "correlation_id": request.correlation_id,
            "compensates_id": request.compensates_id,
        }

    def _replayed(self, session: Session, door: object, request: _Request) -> Enqueued:
        """The answer to a replay of ``(tenant, op_id)``: the stored operation, or the
        tombstone of the pruned one, if it is the same intent; IdempotencyConflict
        otherwise."""
        existing: Operation | OperationTombstone | None
        existing = find_operation(session, request.tenant, request.op_id)
        if existing is None:  # pruned (maybe meanwhile: the prune wrote its tombstone first)
            existing = tombstones.find(session, request.tenant, request.op_id)
        if existing is None:  # only under REPEATABLE READ or SERIALIZABLE isolation
            raise IdempotencyConflict(
                "a concurrent transaction holds this op_id; retry the transaction",
                code="concurrent_intake",
            )
        name = request.spec.name
        if existing.kind != name or not self.fingerprinter.matches(
            name, request.intent, existing.fingerprint_key_version, existing.fingerprint
        ):
            raise IdempotencyConflict(
                "op_id already names a different intent for this tenant; "
                "mint a new op_id for a new operation",
                tenant=request.tenant,
                op_id=request.op_id,
            )
        if isinstance(existing, OperationTombstone):
            return Enqueued.of_tombstone(Tombstone.of(existing), session=session, door=door)
        return Enqueued.of(existing, created=False, session=session, door=door)


@dataclass(frozen=True)
class _Request:
    """An ``enqueue`` call's arguments, validated: what is inserted, or compared on a replay."""

    tenant: str
    op_id: str
    spec: Kind
    intent: Intent
    correlation_id: str | None
    max_attempts: int
    deadline: datetime | None  # None: the default deadline, in database time
    run_id: int | None
    compensates_id: int | None


def _refuse_second_compensation(session: Session, request: _Request) -> None:
    """InvalidInput (``already_compensated``, naming it) when the original already has a
    compensation that was not rejected or cancelled, and ``request``'s op_id is new (a taken
    one is a replay, or a conflict: ``Outbox._replayed`` answers)."""
    assert request.compensates_id is not None
    if find_operation(session, request.tenant, request.op_id) is not None:
        return
    for earlier in compensations_of(session, request.tenant, request.compensates_id):
        if earlier.state not in UNDID_NOTHING:
            raise InvalidInput(
                "this operation already has a compensation that was not rejected or "
                "cancelled; it is compensated once (follow that one)",
                code="already_compensated",
                field="compensates",
                compensation=earlier.op_id,
            )


def _hint_after_commit(session: Session, operation_id: int) -> None:
    """List the new operation in the session: its hint goes out after commit, if the app
    installed the relay (``outbox.relay``)."""
    session.info.setdefault(CREATED_KEY, []).append(operation_id)


def _checked_correlation_id(correlation_id: str | None, op_id: str) -> str | None:
    """``correlation_id`` if valid and not the op_id itself; else InvalidIdentifier."""
    if correlation_id is None:
        return None
    correlation_id = validate_correlation_id(correlation_id)
    if correlation_id == op_id:
        # A tool-call id names one model turn, not one business intent: a retried turn gets
        # a new call id, so using it as op_id would send the intent twice.
        raise InvalidIdentifier(
            "op_id must be minted by the app (new_op_id()), not taken from a tool-call id",
            code="op_id_is_correlation_id",
            field="op_id",
        )
    return correlation_id


def _checked_attempts(attempts: object) -> int:
    """``attempts`` if it is an integer from 1 to ``MAX_ATTEMPTS_LIMIT``; else InvalidInput."""
    if (
        not isinstance(attempts, int)
        or isinstance(attempts, bool)
        or not 1 <= attempts <= MAX_ATTEMPTS_LIMIT
    ):
        raise InvalidInput(
            f"max_attempts must be an integer from 1 to {MAX_ATTEMPTS_LIMIT}",
            code="invalid_budget",
            field="max_attempts",
        )
    return attempts


def _checked_deadline(deadline: object) -> datetime | None:
    """``deadline`` in UTC if it is an aware datetime in the future; else InvalidInput."""
    if deadline is None:
        return None
    bad = InvalidInput(
        "deadline must be an aware datetime in the future",
        code="invalid_budget",
        field="deadline",
    )
    if not isinstance(deadline, datetime):
        raise bad
    try:
        # Aware means utcoffset() is not None (a tzinfo may return None, or nonsense: its
        # errors, and an offset that leaves datetime's range, are the caller's bad input).
        utc = deadline.astimezone(UTC) if deadline.utcoffset() is not None else None
    except (TypeError, ValueError, OverflowError):
        raise bad from None
    if utc is None or utc <= datetime.now(UTC):
        raise bad
    return utc


def _stored_id(
    row: object, model: type[Run | Operation], tenant: str, *, field: str, code: str
) -> int | None:
    """The id of ``row``, a stored run or operation of ``tenant`` (or None for no row).

    A row that was never stored, or whose insert was rolled back, has no identity: the insert
    would fail on the foreign key, with the statement's parameters in the error's text.
    """
    if row is None:
        return None
    if not isinstance(row, model) or not has_identity(row):
        raise InvalidInput(
            f"{field} must be a {model.__name__} that was stored (flushed), not a new object",
            code=f"invalid_{field}",
            field=field,
        )
    if row.tenant != tenant:
        raise NotFound(f"no such {model.__name__.lower()} for this tenant", code=code)
    return row.id
