"""Finding an operation the way a customer or a colleague names it: one free text that may be
an order id, an op id, an idempotency key, a run handle, a payee or the downstream's
reference (``Finder.search``, the console's search box); by one named key (``Finder.find``:
tenant and op id, order id, idempotency key, run handle); and one operation's page.

A search answers in the run report's words: each operation's group (done / not done /
uncertain) is ``outbox.report_lines.group_of`` of its state, the report's own classification.

Staff limited to some tenants find only those tenants' operations: another tenant's
operation is NotFound, exactly like a missing one. Every search is audited with the staff id
(``settled.audit``); the key or text searched for is not logged (it may be a customer's order).
"""

from __future__ import annotations

import logging
import unicodedata
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from outbox.currencies import format_amount
from outbox.errors import InvalidInput, NotFound
from outbox.kinds import KindRegistry, default_registry
from outbox.models import Operation
from outbox.report_lines import group_of
from outbox.runs import verdicts_due
from outbox.states import State
from outbox.storage.search import MAX_FOUND, operations_by, operations_matching
from outbox.verdict_due import Cadence, VerdictDue
from support.operation_view import operation_page
from support.staff import Staff

audit = logging.getLogger("settled.audit")

#: what staff may search by
KEYS = ("op_id", "order_id", "idempotency_key", "run")
MAX_VALUE = 200
#: the shortest text an order id or op id is found by the beginning of
MIN_PREFIX = 3


@dataclass
class Finder:
    sessions: sessionmaker[Session]
    #: the reconciler's numbers: an uncertain operation's page says when it is decided
    cadence: Cadence | None = None
    #: the kinds, which say where each operation's order is (``Kind.order_field``)
    kinds: KindRegistry = field(default_factory=default_registry)

    def find(
        self, staff: Staff, key: str, value: str, *, tenant: str | None = None
    ) -> list[dict[str, Any]]:
        """Operations of the tenants ``staff`` may see whose ``key`` is ``value``, oldest
        first; InvalidInput for an unknown key, an empty or overlong value, or an op id
        without its tenant."""
        value = _checked(key, value, tenant)
        audit.info("console find", extra={"staff": staff.id, "key": key})
        with self.sessions() as session:
            found = operations_by(
                session, key, value, kinds=self.kinds, tenants=staff.tenants, tenant=tenant
            )
            due = self._due(session, found)
            return [
                {"tenant": op.tenant, "op_id": op.op_id, "kind": op.kind, "state": op.state,
                 "created_at": op.created_at.isoformat(), **_due_of(due.get(op.id))}
                for op in found
            ]  # fmt: skip

    def _due(self, session: Session, ops: list[Operation]) -> dict[int, VerdictDue]:
        """What each uncertain one of ``ops`` waits for, and by when (``outbox.verdict_due``)."""
        return verdicts_due(session, ops, self.cadence) if self.cadence is not None else {}

    def search(self, staff: Staff, q: str) -> dict[str, Any]:
        """The operations of the tenants ``staff`` may see that ``q`` names (``results``,
        newest first, at most ``MAX_FOUND``; ``more``: more match), each with its group in
        the report's words, amount, payee, order, age and what ``q`` matched. An order id or
        op id is also found by its first ``MIN_PREFIX`` or more characters. InvalidInput
        (field ``q``) for an empty or overlong text, or one holding a control character."""
        q = _query(q)
        audit.info("console search", extra={"staff": staff.id})
        with self.sessions() as session:
            found, more = operations_matching(
                session, q, kinds=self.kinds, tenants=staff.tenants,
                prefix=len(q) >= MIN_PREFIX, limit=MAX_FOUND,
            )  # fmt: skip
            due = self._due(session, [op for op, _ in found])
            results = [
                {**_result(op, on, self.kinds), **_due_of(due.get(op.id))} for op, on in found
            ]
            return {"q": q, "results": results, "more": more}

    def operation(self, staff: Staff, tenant: str, op_id: str) -> dict[str, Any]:
        """One operation: its facts, timeline and run (``operation_view``), its open review
        item, and its line of the run report in en and zh. NotFound for another tenant's."""
        audit.info("console operation", extra={"staff": staff.id})
        if not staff.sees(tenant) or not 0 < len(op_id) <= MAX_VALUE:
            raise NotFound("no such operation", code="operation_not_found")
        with self.sessions() as session:
            found = operations_by(
                session, "op_id", op_id, kinds=self.kinds, tenants=staff.tenants, tenant=tenant
            )
            if not found:
                raise NotFound("no such operation", code="operation_not_found")
            return operation_page(session, found[0], cadence=self.cadence)


def _query(q: str) -> str:
    q = q.strip()
    if not 0 < len(q) <= MAX_VALUE:
        raise InvalidInput(
            f"a search of 1 to {MAX_VALUE} characters is required", code="invalid_query",
            field="q",
        )  # fmt: skip
    if any(unicodedata.category(c) == "Cc" for c in q):  # NUL: PostgreSQL text holds none
        raise InvalidInput("a search holds no NUL or control character", code="invalid_query",
                           field="q")  # fmt: skip
    return q


def _due_of(due: VerdictDue | None) -> dict[str, Any]:
    """An uncertain row's ``waits_for`` and ``verdict_by`` (ISO; None: staff decide, no time
    promised); nothing where not said."""
    return due.as_evidence() if due is not None else {}


def _result(op: Operation, matched: list[str], kinds: KindRegistry) -> dict[str, Any]:
    params = op.params or {}
    return {
        "tenant": op.tenant,
        "op_id": op.op_id,
        "kind": op.kind,
        "state": op.state,
        "group": group_of(State(op.state)).value,
        "amount": format_amount(params.get("amount_minor"), params.get("currency")),
        "payee": _text(params.get("payee")),
        "order_id": kinds.order_of(op.kind, params),
        "reference": op.downstream_ref,
        "created_at": op.created_at.isoformat(),
        "matched": matched,
    }


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


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
