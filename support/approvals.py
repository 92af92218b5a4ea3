"""Staff deciding what AI agents proposed (the console's Proposals page): the proposals that
wait, one proposal with everything else on its order, approve and decline.

The decisions are ``outbox.proposals.Proposals``' (the ones ``settled proposals`` makes):
approval re-checks the proposal's fingerprint and enqueues its exact parameters under a new
op id, in the transaction that marks it approved. What this adds is the staff's side: a
member limited to some tenants sees and decides only theirs (the limit is in the SQL;
another tenant's proposal is NotFound, exactly like a missing one); a viewer may look but not
decide (Forbidden); every decision is recorded as ``staff:<id>`` and in ``settled.audit``. A
proposal somebody decided first is not an error: the answer says who decided it and when. One
past its time to live is not listed and shows as expired, marked by the sweeper or not (its
approval is refused by ``Proposals``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from outbox.errors import NotFound, ProposalConflict, SettledError
from outbox.kinds import KindRegistry
from outbox.models import Operation, Proposal
from outbox.proposals import APPROVED, DECLINED, PROPOSED, Proposals, ProposalStatus
from outbox.storage.proposals import expiry_cutoff
from outbox.storage.search import on_orders, proposal_by_id, waiting_proposals
from support.staff import Staff, require_acting

audit = logging.getLogger("settled.audit")

MAX_LISTED = 100


@dataclass(frozen=True)
class Decision:
    """What a decision did: the proposal as it now stands, and whether this member of staff
    decided it (False: somebody else decided it first, and nothing was written)."""

    proposal: dict[str, Any]
    won: bool


@dataclass
class Approvals:
    sessions: sessionmaker[Session]
    proposals: Proposals

    @property
    def kinds(self) -> KindRegistry:
        """The kinds the proposals are of (where each operation's order is)."""
        return self.proposals.outbox.registry

    def waiting(self, staff: Staff) -> dict[str, Any]:
        """The oldest ``MAX_LISTED`` proposals waiting (of the tenants ``staff`` may see), each
        with what else is on its order, and how many wait in all."""
        audit.info("proposals list", extra={"staff": staff.id})
        with self.sessions() as session:
            rows, total = waiting_proposals(
                session, tenants=staff.tenants, limit=MAX_LISTED,
                made_after=expiry_cutoff(session, self.proposals.ttl),
            )  # fmt: skip
            others, operations = on_orders(
                session, [(p.tenant, p.order_ref) for p in rows], kinds=self.kinds
            )
            items = [
                {**proposal_row(p), **_on_order(p, others, operations, self.kinds)} for p in rows
            ]  # fmt: skip
            return {"items": items, "total": total}

    def show(self, staff: Staff, proposal_id: int) -> dict[str, Any]:
        """One proposal and the other proposals and the operations on its order."""
        audit.info("proposal show", extra={"staff": staff.id, "proposal": proposal_id})
        with self.sessions() as session:
            p = self._load(session, staff, proposal_id)
            others, operations = on_orders(session, [(p.tenant, p.order_ref)], kinds=self.kinds)
            status = self.proposals.status_of(session, p)  # expired once past its time
            return {**proposal_row(p), "status": status,
                    **_on_order(p, others, operations, self.kinds)}  # fmt: skip

    def approve(self, staff: Staff, proposal_id: int) -> Decision:
        """Approve: its exact parameters become an operation under a new op id."""
        return self._decide(staff, proposal_id, APPROVED)

    def decline(self, staff: Staff, proposal_id: int) -> Decision:
        """Decline: nothing is sent."""
        return self._decide(staff, proposal_id, DECLINED)

    def _decide(self, staff: Staff, proposal_id: int, status: ProposalStatus) -> Decision:
        verb = "approve" if status == APPROVED else "decline"
        try:
            require_acting(staff)
            decided = self._write(staff, proposal_id, status)
        except ProposalConflict as exc:
            # decided by somebody else between our read and our write: rolled back
            with self.sessions() as session:
                decided = proposal_row(self._load(session, staff, proposal_id))
            if decided["status"] == PROPOSED:  # refused for another reason: say it
                self._refused(staff, proposal_id, verb, exc)
                raise
        except SettledError as exc:
            self._refused(staff, proposal_id, verb, exc)
            raise
        won = decided["status"] == status and decided["decided_by"] == staff.actor
        audit.info(
            f"proposal {verb}" if won else f"proposal {verb} lost",
            extra={"staff": staff.id, "proposal": proposal_id, "tenant": decided["tenant"],
                   "op_id": decided["op_id"], "decided_by": decided["decided_by"]},
        )  # fmt: skip
        return Decision(decided, won)

    @staticmethod
    def _refused(staff: Staff, proposal_id: int, verb: str, exc: SettledError) -> None:
        audit.info(
            f"proposal {verb} refused",
            extra={"staff": staff.id, "proposal": proposal_id, "code": exc.code},
        )

    def _write(self, staff: Staff, proposal_id: int, status: ProposalStatus) -> dict[str, Any]:
        with self.sessions.begin() as session:
            p = self._load(session, staff, proposal_id)
            if p.status != PROPOSED:
                return proposal_row(p)
            decide = self.proposals.approve if status == APPROVED else self.proposals.decline
            return proposal_row(decide(session, p.tenant, p.handle, by=staff.actor))

    @staticmethod
    def _load(session: Session, staff: Staff, proposal_id: int) -> Proposal:
        found = proposal_by_id(session, proposal_id, tenants=staff.tenants)
        if found is None:
            raise NotFound("no such proposal", code="proposal_not_found")
        return found


def proposal_row(p: Proposal) -> dict[str, Any]:
    """A proposal as the pages show it."""
    params = p.params
    return {
        "id": p.id,
        "tenant": p.tenant,
        "handle": p.handle,
        "kind": p.kind,
        "order_ref": p.order_ref,
        "params": params,
        "amount_minor": params.get("amount_minor"),
        "currency": params.get("currency"),
        "payee": params.get("payee"),
        "reason": p.reason,
        "correlation_id": p.correlation_id,
        "status": p.status,
        "decided_by": p.decided_by,
        "decided_at": p.decided_at.isoformat() if p.decided_at is not None else None,
        "op_id": p.op_id,
        "created_at": p.created_at.isoformat(),
    }


def _operation_row(op: Operation) -> dict[str, Any]:
    params = op.params
    return {
        "tenant": op.tenant,
        "op_id": op.op_id,
        "kind": op.kind,
        "state": op.state,
        "amount_minor": params.get("amount_minor"),
        "currency": params.get("currency"),
        "payee": params.get("payee"),
        "created_at": op.created_at.isoformat(),
    }


def _on_order(
    p: Proposal,
    proposals: Iterable[Proposal],
    operations: Iterable[Operation],
    kinds: KindRegistry,
) -> dict[str, Any]:
    """What else is on ``p``'s order: the other proposals and every operation."""
    same = (p.tenant, p.order_ref)
    return {
        "other_proposals": [
            proposal_row(o) for o in proposals if (o.tenant, o.order_ref) == same and o.id != p.id
        ],
        "operations": [
            _operation_row(op)
            for op in operations
            if (op.tenant, kinds.order_of(op.kind, op.params)) == same
        ],
    }
