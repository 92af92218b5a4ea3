"""Intake: the call a backend app makes inside its own transaction.

``Outbox.enqueue`` writes the operation intent into the caller's session and never commits:
the business row and the intent commit together, or neither does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session
from sqlalchemy.orm.util import has_identity

from outbox.errors import IdempotencyConflict, InvalidIdentifier, InvalidInput, NotFound
from outbox.fingerprint import Fingerprinter, canonical_params
from outbox.ids import (
    derive_idempotency_key,
    validate_correlation_id,
    validate_op_id,
    validate_tenant,
)
from outbox.kinds import KindRegistry, default_registry
from outbox.models import Operation, Run
from outbox.settings import Settings
from outbox.storage import storage_for
from outbox.storage.operations import find_operation

#: ``Session.info`` key listing the operations created in the session's transaction.
CREATED_KEY = "settled.created"
MAX_ATTEMPTS_LIMIT = 100


@dataclass(frozen=True)
class Enqueued:
    """What intake did: the operation (new or existing) and whether this call created it."""

    operation: Operation
    created: bool


@dataclass(frozen=True)
class Outbox:
    """The intake API, built once from settings at the app's composition root."""

    registry: KindRegistry
    fingerprinter: Fingerprinter
    idempotency_secret: bytes
    max_attempts: int = 5
    deadline: timedelta = timedelta(hours=1)

    @classmethod
    def from_settings(cls, settings: Settings, registry: KindRegistry | None = None) -> Outbox:
        return cls(
            registry=registry or default_registry(),
            fingerprinter=Fingerprinter(
                settings.fingerprint_key_bytes(), settings.fingerprint_key_version
            ),
            idempotency_secret=settings.idempotency_secret.get_secret_value().encode(),
            max_attempts=settings.max_attempts,
            deadline=timedelta(seconds=settings.deadline_seconds),
        )

    def enqueue(
        self,
        session: Session,
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

        A replay of ``(tenant, op_id)`` with the same intent returns the stored operation and
        writes nothing; with another intent it raises IdempotencyConflict. Bad input raises an
        InvalidInput subclass before anything is written.
        """
        tenant = validate_tenant(tenant)
        op_id = validate_op_id(op_id)
        spec = self.registry.get(kind)
        intent = spec.parse(params)
        if correlation_id is not None:
            correlation_id = validate_correlation_id(correlation_id)
            if correlation_id == op_id:
                # A tool-call id names one model turn, not one business intent: a retried
                # turn gets a new call id, so using it as op_id would send the intent twice.
                raise InvalidIdentifier(
                    "op_id must be minted by the app (new_op_id()), not taken from a tool-call id",
                    code="op_id_is_correlation_id",
                    field="op_id",
                )
        attempts = self.max_attempts if max_attempts is None else max_attempts
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
        deadline = _checked_deadline(deadline)
        run_id = _stored_id(run, Run, tenant, field="run", code="run_not_found")
        compensates_id = _stored_id(
            compensates, Operation, tenant, field="compensates", code="operation_not_found"
        )

        version = self.fingerprinter.current
        values: dict[str, Any] = {
            "tenant": tenant,
            "op_id": op_id,
            "kind": spec.name,
            "params": canonical_params(intent),
            "fingerprint": self.fingerprinter.fingerprint(spec.name, intent, version),
            "fingerprint_key_version": version,
            "idempotency_key": derive_idempotency_key(self.idempotency_secret, tenant, op_id),
            "max_attempts": attempts,
            "deadline": deadline,  # None: the default deadline, in database time
            "run_id": run_id,
            "correlation_id": correlation_id,
            "compensates_id": compensates_id,
        }
        # Insert first, ON CONFLICT DO NOTHING: a concurrent intake of the same (tenant, op_id)
        # waits for the other transaction and then inserts nothing instead of raising; on
        # SQLite the write lock is taken before any read, so no lock upgrade can fail.
        op = storage_for(session).create_operation(
            session,
            values,
            default_deadline_seconds=self.deadline.total_seconds(),
            evidence={"correlation_id": correlation_id} if correlation_id else None,
        )
        if op is not None:
            # Hints go out after commit, if the app installed the relay (outbox.relay).
            session.info.setdefault(CREATED_KEY, []).append(op.id)
            return Enqueued(op, created=True)
        existing = find_operation(session, tenant, op_id)
        if existing is None:  # only under REPEATABLE READ or SERIALIZABLE isolation
            raise IdempotencyConflict(
                "a concurrent transaction holds this op_id; retry the transaction",
                code="concurrent_intake",
            )
        if existing.kind != spec.name or not self.fingerprinter.matches(
            spec.name, intent, existing.fingerprint_key_version, existing.fingerprint
        ):
            raise IdempotencyConflict(
                "op_id already names a different intent for this tenant; "
                "mint a new op_id for a new operation",
                tenant=tenant,
                op_id=op_id,
            )
        return Enqueued(existing, created=False)


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
