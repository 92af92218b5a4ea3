"""Finding an operation the way a customer or a colleague names it: tenant and op id, the
order id, the downstream idempotency key, or the run handle; and one operation's page.

Staff limited to some tenants find only those tenants' operations: another tenant's
operation is NotFound, exactly like a missing one. Every search is audited with the staff id
(``settled.audit``); the key searched for is not logged (it may be a customer's order).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from outbox.errors import InvalidInput, NotFound
from outbox.storage.search import operations_by
from support.operation_view import operation_page
from support.staff import Staff

audit = logging.getLogger("settled.audit")

#: what staff may search by
KEYS = ("op_id", "order_id", "idempotency_key", "run")
MAX_VALUE = 200


@dataclass
class Finder:
    sessions: sessionmaker[Session]

    def find(
        self, staff: Staff, key: str, value: str, *, tenant: str | None = None
    ) -> list[dict[str, Any]]:
        """Operations of the tenants ``staff`` may see whose ``key`` is ``value``, oldest
        first; InvalidInput for an unknown key, an empty or overlong value, or an op id
        without its tenant."""
        value = _checked(key, value, tenant)
        audit.info("console find", extra={"staff": staff.id, "key": key})
        with self.sessions() as session:
            found = operations_by(session, key, value, tenants=staff.tenants, tenant=tenant)
            return [
                {"tenant": op.tenant, "op_id": op.op_id, "kind": op.kind, "state": op.state,
                 "created_at": op.created_at.isoformat()}
                for op in found
            ]  # fmt: skip

    def operation(self, staff: Staff, tenant: str, op_id: str) -> dict[str, Any]:
        """One operation: its facts, timeline and run (``operation_view``), its open review
        item, and its line of the run report in en and zh. NotFound for another tenant's."""
        audit.info("console operation", extra={"staff": staff.id})
        if not staff.sees(tenant) or not 0 < len(op_id) <= MAX_VALUE:
            raise NotFound("no such operation", code="operation_not_found")
        with self.sessions() as session:
            found = operations_by(session, "op_id", op_id, tenants=staff.tenants, tenant=tenant)
            if not found:
                raise NotFound("no such operation", code="operation_not_found")
            return operation_page(session, found[0])


def _checked(key: str, value: str, tenant: str | None) -> str:
    if key not in KEYS:
        raise InvalidInput(f"search by one of {list(KEYS)}", code="invalid_key", field="key")
    value = value.strip()
    if not 0 < len(value) <= MAX_VALUE:
        raise InvalidInput(
            f"a value of 1 to {MAX_VALUE} characters is required", code="invalid_value",
            field="value",
        )  # fmt: skip
    if key == "op_id" and not tenant:
        raise InvalidInput("an op id is found with its tenant", code="tenant_required",
                           field="tenant")  # fmt: skip
    return value
