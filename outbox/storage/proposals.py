"""Proposals an AI agent made: adding one, finding one by handle, the recent ones for an
order, deciding one (a conditional UPDATE: only a proposal still ``proposed`` is decided, and
an approval only while it is younger than its time to live), expiring the ones nobody decided
in time, and the ones waiting for staff.

The rules (what a repeat is, who may approve) are ``outbox.proposals``.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Table, bindparam, select, update
from sqlalchemy.orm import Session

from outbox.db import db_now
from outbox.models import Proposal
from outbox.proposal_states import ProposalStatus
from outbox.storage.operations import db_time

proposals: Table = Proposal.__table__  # type: ignore[assignment]

FIND = select(Proposal).where(
    Proposal.tenant == bindparam("tenant"), Proposal.handle == bindparam("handle")
)
#: Before any proposal (``recent_for_order`` with no window).
EVER = datetime(2000, 1, 1, tzinfo=UTC)
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
COMPENSATING = (
    select(Proposal).where(Proposal.compensates_id == bindparam("p_id")).order_by(Proposal.id)
)
_PROPOSED, _EXPIRED = ProposalStatus.PROPOSED.value, ProposalStatus.EXPIRED.value
WAITING = select(Proposal).where(Proposal.status == _PROPOSED).order_by(Proposal.id)
WAITING_OF_TENANT = WAITING.where(Proposal.tenant == bindparam("tenant"))
PAST = select(Proposal.id).where(
    Proposal.id == bindparam("p_id"), Proposal.created_at <= bindparam("cutoff")
)
EXPIRE = (
    update(proposals)
    .where(proposals.c.status == _PROPOSED, proposals.c.created_at <= bindparam("cutoff"))
    .values(status=_EXPIRED, decided_by="expiry", decided_at=db_now())
)
EXPIRE_FOR_ORDER = EXPIRE.where(
    proposals.c.tenant == bindparam("p_tenant"),
    proposals.c.kind == bindparam("p_kind"),
    proposals.c.order_ref == bindparam("p_order_ref"),
)
DECIDE = (
    update(proposals)
    .where(proposals.c.id == bindparam("p_id"), proposals.c.status == _PROPOSED)
    .values(
        status=bindparam("p_status"),
        decided_by=bindparam("p_by"),
        op_id=bindparam("p_op_id"),
        run_id=bindparam("p_run_id"),
        decided_at=db_now(),
    )
)
DECIDE_UNEXPIRED = DECIDE.where(proposals.c.created_at > bindparam("cutoff"))


def add_proposal(session: Session, values: dict[str, Any]) -> Proposal:
    """A new proposal row in ``session`` (flushed: it has its id; never committed)."""
    row = Proposal(**values, status=_PROPOSED)
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
    session: Session, *, tenant: str, kind: str, order_ref: str, window: timedelta | None
) -> list[Proposal]:
    """The proposals of ``tenant`` for ``kind`` on one order made within ``window`` (database
    time; None: ever), oldest first."""
    since = EVER if window is None else db_time(session) - window
    params = {"tenant": tenant, "kind": kind, "order_ref": order_ref, "since": since}
    return list(session.scalars(FOR_ORDER, params))


def compensating(session: Session, proposal_id: int) -> list[Proposal]:
    """Every proposal to compensate proposal ``proposal_id``, whatever its status or age,
    oldest first."""
    return list(session.scalars(COMPENSATING, {"p_id": proposal_id}))


def expiry_cutoff(session: Session, ttl: timedelta) -> datetime:
    """Proposals made at or before this moment (database time) have outlived ``ttl``."""
    return db_time(session) - ttl


def is_past(session: Session, proposal_id: int, ttl: timedelta) -> bool:
    """Whether the proposal has outlived ``ttl`` (by the database's clock)."""
    cutoff = expiry_cutoff(session, ttl)
    return session.scalar(PAST, {"p_id": proposal_id, "cutoff": cutoff}) is not None


def expire_waiting(
    session: Session,
    ttl: timedelta,
    *,
    tenant: str | None = None,
    kind: str | None = None,
    order_ref: str | None = None,
) -> int:
    """Mark ``expired`` the undecided proposals older than ``ttl`` (all, or one order's);
    how many. Conditional: a proposal decided meanwhile is left as it was decided."""
    cutoff = expiry_cutoff(session, ttl)
    if order_ref is None:
        result = session.execute(EXPIRE, {"cutoff": cutoff})
    else:
        params = {"cutoff": cutoff, "p_tenant": tenant, "p_kind": kind, "p_order_ref": order_ref}
        result = session.execute(EXPIRE_FOR_ORDER, params)
    count: int = result.rowcount  # type: ignore[attr-defined]
    return count


def waiting(
    session: Session, tenant: str | None = None, *, made_after: datetime | None = None
) -> list[Proposal]:
    """Proposals nobody has decided yet (of one tenant, or all; with ``made_after``, only the
    ones made after that moment: the others have expired), oldest first."""
    stmt = WAITING if tenant is None else WAITING_OF_TENANT
    if made_after is not None:
        stmt = stmt.where(Proposal.created_at > made_after)
    return list(session.scalars(stmt, {"tenant": tenant} if tenant is not None else {}))


def decide(
    session: Session,
    proposal_id: int,
    *,
    status: ProposalStatus,
    by: str,
    op_id: str | None = None,
    run_id: int | None = None,
    made_after: datetime | None = None,
) -> bool:
    """Decide a proposal still ``proposed`` (and, with ``made_after``, made after that moment)
    ``status`` (the transition table's move: ``outbox.proposal_states``); False (nothing
    written) if it was decided first or is older."""
    values: dict[str, object] = {"p_id": proposal_id, "p_status": status.value, "p_by": by}
    values.update({"p_op_id": op_id, "p_run_id": run_id})
    if made_after is None:
        result = session.execute(DECIDE, values)
    else:
        result = session.execute(DECIDE_UNEXPIRED, {**values, "cutoff": made_after})
    decided: bool = result.rowcount == 1  # type: ignore[attr-defined]
    return decided
