"""The trace context an operation carries from its intake to its outcome (a W3C
``traceparent``, ``operations.trace_context``): storing it, reading it back.

The column (migration 0004) is deliberately not on the ORM model: the intake's INSERT ...
RETURNING and every other statement stay as they were, tracing or not.
"""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import bindparam, column, select, table, update
from sqlalchemy.orm import Session

TRACES = table("operations", column("id"), column("trace_context"))

STORE_TRACE_CONTEXT = (
    update(TRACES)
    .where(TRACES.c.id == bindparam("operation_id"))
    .values(trace_context=bindparam("t_context"))
)
TRACE_CONTEXTS = select(TRACES.c.id, TRACES.c.trace_context).where(
    TRACES.c.id.in_(bindparam("ids", expanding=True)), TRACES.c.trace_context.is_not(None)
)


def store_trace_context(session: Session, operation_id: int, traceparent: str | None) -> None:
    """Store ``traceparent`` on the operation's row, in ``session``'s transaction."""
    session.execute(STORE_TRACE_CONTEXT, {"operation_id": operation_id, "t_context": traceparent})


def trace_contexts(session: Session, ids: Collection[int]) -> dict[int, str]:
    """The trace context stored on each of these operations (those that have one)."""
    return {i: context for i, context in session.execute(TRACE_CONTEXTS, {"ids": list(ids)})}
