"""The operator's reads of operations (``settled ops list``, ``settled ops show``): a list
narrowed by state, reject reason, tenant and age, each operation with its line of the run
report (done / not done / uncertain, in the report's words); and one operation as the
console's operation page shows it (``operation_view.operation_page``). Read-only.

Filters are checked before any SQL: a state or a reason that no operation can have, a
malformed tenant, a limit out of range, a negative age, are InvalidInput.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy.orm import Session

from outbox.errors import InvalidIdentifier, InvalidInput, NotFound
from outbox.ids import validate_op_id, validate_tenant
from outbox.states import RejectReason, State
from outbox.storage import tombstones
from outbox.storage.operations import db_time, find_operation, listed_operations
from support.operation_view import operation_page, report_words

#: the most operations one list shows
MAX_LIMIT = 1000
STATES = tuple(s.value for s in State)
REASONS = tuple(r.value for r in RejectReason)


def list_operations(
    session: Session,
    *,
    state: str | None = None,
    reason: str | None = None,
    tenant: str | None = None,
    older_than: timedelta | None = None,
    limit: int = 50,
) -> list[dict[str, Any]]:
    """The first ``limit`` operations, oldest first, that match every filter given: each with
    its tenant, op id, kind, state, reason, creation, age (in the database's time) and its line
    of the run report (``report``: its group and its sentence in each language)."""
    _check_filters(state, reason, tenant, older_than, limit)
    now = db_time(session)
    before = now - older_than if older_than is not None else None
    found = listed_operations(
        session, state=state, reason=reason, tenant=tenant, created_before=before, limit=limit
    )
    return [
        {
            "tenant": op.tenant,
            "op_id": op.op_id,
            "kind": op.kind,
            "state": op.state,
            "reason": op.reason,
            "created_at": op.created_at.isoformat(),
            "age_seconds": max(0.0, (now - op.created_at).total_seconds()),
            "report": report_words(session, op),
        }
        for op in found
    ]


def show_operation(session: Session, tenant: str, op_id: str) -> dict[str, Any]:
    """One operation as the console's operation page shows it: its facts, attempts, lookups,
    events, run, the report's words and its open review item. NotFound when there is none
    (``operation_pruned``, with what its tombstone keeps, when it was pruned)."""
    try:
        tenant, op_id = validate_tenant(tenant), validate_op_id(op_id)
    except InvalidIdentifier:
        # a name no operation can have: not found, like a missing one
        raise NotFound("no such operation", code="operation_not_found") from None
    op = find_operation(session, tenant, op_id)
    if op is not None:
        return operation_page(session, op)
    tomb = tombstones.find(session, tenant, op_id)
    if tomb is None:
        raise NotFound("no such operation", code="operation_not_found")
    state = tomb.state + (f" ({tomb.reason})" if tomb.reason else "")
    raise NotFound(
        f"pruned on {tomb.pruned_at:%Y-%m-%d}: it was {state}, reference "
        f"{tomb.downstream_ref or 'none'}; a replay of it is answered from its tombstone",
        code="operation_pruned",
    )


def _check_filters(
    state: str | None,
    reason: str | None,
    tenant: str | None,
    older_than: timedelta | None,
    limit: int,
) -> None:
    if state is not None and state not in STATES:
        raise InvalidInput(f"state must be one of {list(STATES)}", code="invalid_state",
                           field="state")  # fmt: skip
    if reason is not None and reason not in REASONS:
        raise InvalidInput(f"reason must be one of {list(REASONS)}", code="invalid_reason",
                           field="reason")  # fmt: skip
    if reason is not None and state not in (None, State.REJECTED.value):
        raise InvalidInput("only a rejected operation has a reason", code="invalid_reason",
                           field="reason")  # fmt: skip
    if tenant is not None:
        validate_tenant(tenant)
    if older_than is not None and older_than < timedelta(0):
        raise InvalidInput("an age is not negative", code="invalid_age", field="older_than")
    if isinstance(limit, bool) or not 1 <= limit <= MAX_LIMIT:
        raise InvalidInput(f"limit must be from 1 to {MAX_LIMIT}", code="invalid_limit",
                           field="limit")  # fmt: skip
