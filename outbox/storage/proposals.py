"""Proposals an AI agent made: adding one, finding one by handle, the recent ones for an
order, deciding one (a conditional UPDATE: only a proposal still ``proposed`` is decided),
and the ones waiting for staff.

The rules (what a repeat is, who may approve) are ``outbox.proposals``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import Table, bindparam, select, update
from sqlalchemy.orm import Session

from outbox.db import db_now
from outbox.models import Proposal
from outbox.storage.operations import db_time

proposals: Table = Proposal.__table__  # type: ignore[assignment]

FIND = select(Proposal).where(
    Proposal.tenant == bindparam("tenant"), Proposal.handle == bindparam("handle")
)
FOR_ORDER = (
    select(Proposal)
    .where(
        Proposal.tenant == bindparam("tenant"),
        Proposal.kind == bindparam("kind"),
        Proposal.order_ref == bindparam("order_ref"),
        Proposal.created_at >= bindparam("since"),
    )
    .order_by(Proposal.id)
)
WAITING = select(Proposal).where(Proposal.status == "proposed").order_by(Proposal.id)
WAITING_OF_TENANT = WAITING.where(Proposal.tenant == bindparam("tenant"))
DECIDE = (
    update(proposals)
    .where(proposals.c.id == bindparam("p_id"), proposals.c.status == "proposed")
    .values(
        status=bindparam("p_status"),
        decided_by=bindparam("p_by"),
        op_id=bindparam("p_op_id"),
        run_id=bindparam("p_run_id"),
        decided_at=db_now(),
    )
)


def add_proposal(session: Session, values: dict[str, Any]) -> Proposal:
    """A new proposal row in ``session`` (flushed: it has its id; never committed)."""
    row = Proposal(**values, status="proposed")
    session.add(row)
    session.flush()
    return row


def find_proposal(session: Session, tenant: str, handle: str) -> Proposal | None:
    """Proposal ``handle`` of ``tenant`` (None: no such proposal for this tenant)."""
    found: Proposal | None = session.scalars(
        FIND, {"tenant": tenant, "handle": handle}
    ).one_or_none()
    return found


def recent_for_order(
    session: Session, *, tenant: str, kind: str, order_ref: str, window: timedelta
) -> list[Proposal]:
    """The proposals of ``tenant`` for ``kind`` on one order made within ``window`` (database
    time), oldest first."""
    since = db_time(session) - window
    params = {"tenant": tenant, "kind": kind, "order_ref": order_ref, "since": since}
    return list(session.scalars(FOR_ORDER, params))


def waiting(session: Session, tenant: str | None = None) -> list[Proposal]:
    """Proposals nobody has decided yet (of one tenant, or all), oldest first."""
    if tenant is None:
        return list(session.scalars(WAITING))
    return list(session.scalars(WAITING_OF_TENANT, {"tenant": tenant}))


def decide(
    session: Session,
    proposal_id: int,
    *,
    status: str,
    by: str,
    op_id: str | None = None,
    run_id: int | None = None,
) -> bool:
    """Decide a proposal still ``proposed``; False (nothing written) if it was decided first."""
    values: dict[str, object] = {"p_id": proposal_id, "p_status": status, "p_by": by}
    values.update({"p_op_id": op_id, "p_run_id": run_id})
    result = session.execute(DECIDE, values)
    decided: bool = result.rowcount == 1  # type: ignore[attr-defined]
    return decided
