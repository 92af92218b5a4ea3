"""Proposals: what an AI agent asks for becomes an operation only once it is approved.

A model supplies business parameters and a reason; that makes a *proposal*, never an
operation. Approval (the human in the agent's client, a tenant's policy, or staff) turns it
into an operation intent through ``Outbox.enqueue`` under an op_id the app mints, in the same
transaction that marks it approved. The model's tool-call id is kept as correlation only: a
retried turn gets a new call id, so it can never name an operation.

Approval binds the exact parameters (the proposal's keyed fingerprint): a changed amount or
payee is another proposal. A request that repeats a live one (proposed or approved) for the
same order within the repeat window is not made again: the answer is the existing proposal.
A different request for the same order (a second partial refund) is a new proposal, and its
approval shows the earlier ones. A compensation is different: one original is compensated
once (``outbox.proposal_offsets``). An approved compensation gets a run of its own, linked to
the original: stopping either never stops the other. Like intake, nothing here commits. What
a kind means here (the field the server mints, how it is compensated) is its agent profile
(``outbox.kinds.AgentProfile``); the pure rules are ``outbox.proposal_rules``.

A proposal nobody decides within its time to live (``ttl``) expires: approval checks its age
by the database's clock in the same conditional UPDATE that approves it, so an expired
proposal is never approved, whether or not the sweeper has marked it ``expired`` yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy.orm import Session

from outbox.errors import InvalidInput, InvalidParams, NotFound, ProposalConflict
from outbox.fingerprint import canonical_params
from outbox.ids import new_op_id, validate_correlation_id, validate_label, validate_tenant
from outbox.intake import Outbox, order_lock
from outbox.kinds import Intent, Kind
from outbox.models import Operation, Proposal
from outbox.proposal_offsets import operation_to_offset, refuse_if_compensated, undid_nothing
from outbox.proposal_rules import (
    APPROVED,
    DECLINED,
    EXPIRED,
    HANDLE_PREFIX,
    HANDLE_RE,
    MAX_ACTOR,
    MAX_REASON,
    PROPOSED,
    auto_approvable,
    decision_check,
    new_handle,
    on_the_order,
    repeat_of,
    without,
)
from outbox.proposal_states import LIVE, ProposalStatus
from outbox.report import Report
from outbox.runs import open_run, run_report
from outbox.storage import proposals as store
from outbox.storage import storage_for
from outbox.storage.runs import run as run_by_id
from outbox.storage.search import operations_on_orders
from outbox.verdict_due import Cadence

__all__ = [
    "APPROVED",
    "DECLINED",
    "EXPIRED",
    "HANDLE_PREFIX",
    "HANDLE_RE",
    "LIVE",
    "MAX_ACTOR",
    "MAX_REASON",
    "PROPOSED",
    "ProposalStatus",
    "Proposals",
    "Proposed",
    "auto_approvable",
    "decision_check",
    "new_handle",
    "on_the_order",
    "proposal_report",
    "repeat_of",
]


@dataclass(frozen=True)
class Proposed:
    """What a request did: the proposal (new, or the one it repeats) and the other live
    proposals for the same order, which an approval must show."""

    proposal: Proposal
    created: bool
    earlier: tuple[Proposal, ...]
    #: operations of the kind on the order that no proposal made (the app's own), not
    #: rejected or cancelled
    others: tuple[Operation, ...] = ()
    #: the declined (or withdrawn) proposals of the kind on the order, oldest first: a new
    #: request's approval says the person said no before
    declined: tuple[Proposal, ...] = ()


@dataclass(frozen=True)
class Proposals:
    """Making, finding and deciding proposals; built once at the composition root."""

    outbox: Outbox
    window: timedelta = timedelta(hours=24)
    #: how long a proposal waits for a decision before it expires
    ttl: timedelta = timedelta(hours=24)

    def propose(
        self,
        session: Session,
        *,
        tenant: str,
        kind: str,
        params: Mapping[str, Any],
        reason: str,
        correlation_id: str | None = None,
    ) -> Proposed:
        """A new proposal in ``session`` (flushed, never committed), or the live one it
        repeats. Bad input raises an InvalidInput subclass before anything is written."""
        tenant = validate_tenant(tenant)
        spec = self.outbox.registry.get(kind)
        minted = spec.agent.minted
        if minted is not None and isinstance(params, Mapping) and minted not in params:
            params = {**params, minted: spec.agent.mint()}
        intent = spec.parse(params)
        reason = validate_label(reason, field="reason", max_length=MAX_REASON)
        if correlation_id is not None:
            correlation_id = validate_correlation_id(correlation_id)
        order_ref = spec.order_of(intent)
        if order_ref is None:
            raise InvalidParams("an agent may propose only operations on an order", field="kind")
        return self._add_unless_repeat(
            session, tenant, spec, intent, order_ref, reason, correlation_id
        )

    def propose_compensation(
        self,
        session: Session,
        *,
        tenant: str,
        handle: str,
        cause: str,
        reason: str,
        correlation_id: str | None = None,
    ) -> Proposed:
        """A proposal to compensate what approved proposal ``handle`` did: a new operation
        (for a ticket, its cancellation with ``cause``) that waits for approval like any other
        request; approved, it is enqueued in a run of its own, linked to the original, and
        reported by its own receipt. Any live request to compensate the same original is the
        repeat (whatever its cause or age): the answer is that one. Bad input, or an original
        with nothing to offset, raises an InvalidInput subclass; nothing is written."""
        tenant = validate_tenant(tenant)
        reason = validate_label(reason, field="reason", max_length=MAX_REASON)
        if correlation_id is not None:
            correlation_id = validate_correlation_id(correlation_id)
        original = self.find(session, tenant, handle)
        how = self.outbox.registry.get(original.kind).agent.compensation
        if how is None:
            raise InvalidInput(
                f"a {original.kind} cannot be compensated through a request",
                code="not_compensable",
                field="handle",
            )
        operation_to_offset(session, original)
        spec = self.outbox.registry.get(how.kind)
        intent = spec.parse(how.params(original.params, cause))
        return self._add_unless_repeat(
            session,
            tenant,
            spec,
            intent,
            original.order_ref,
            reason,
            correlation_id,
            compensates=original,
        )

    def _add_unless_repeat(
        self,
        session: Session,
        tenant: str,
        spec: Kind,
        intent: Intent,
        order_ref: str,
        reason: str,
        correlation_id: str | None,
        compensates: Proposal | None = None,
    ) -> Proposed:
        """The live proposal ``intent`` repeats, or a new one (flushed)."""
        minted = spec.agent.minted
        fp = self.outbox.fingerprinter
        # One request for an order at a time: two identical requests at the same instant must
        # not both find no repeat and both be added (and then both auto-approved). Every
        # intake on the order takes this lock too (shared), so the policy below waits for an
        # app's transaction still open on the order and sees its operation once committed.
        storage_for(session).lock_order(session, order_lock(tenant, spec.name, order_ref))
        # An expired proposal is no longer live: a repeat of it is a new request.
        store.expire_waiting(session, self.ttl, tenant=tenant, kind=spec.name, order_ref=order_ref)
        earlier = store.recent_for_order(
            session, tenant=tenant, kind=spec.name, order_ref=order_ref, window=self.window
        )
        asked = without(canonical_params(intent), minted)

        def same_params(p: Proposal) -> bool:
            if minted is not None:
                return without(p.params, minted) == asked
            return fp.matches(spec.name, intent, p.fingerprint_key_version, p.fingerprint)

        if compensates is None:
            repeated = repeat_of(earlier, same_params)
        else:
            # One original is compensated once: any live request to compensate it is the
            # repeat, whatever its cause, however long ago it was made.
            # (An approved one whose operation was rejected or cancelled undid nothing.)
            repeated = repeat_of(
                store.compensating(session, compensates.id),
                lambda p: not undid_nothing(session, p),
            )
        # What an approval must show, and what keeps the policy from approving by itself:
        # every live proposal on the order however old (the window only bounds repeats), and
        # the operations of the kind the app made on it itself.
        ever = store.recent_for_order(
            session, tenant=tenant, kind=spec.name, order_ref=order_ref, window=None
        )
        on_order = operations_on_orders(session, [(tenant, order_ref)], kinds=self.outbox.registry)
        live, others = on_the_order(ever, on_order, spec.name, repeated)
        declined = tuple(p for p in ever if p.status == DECLINED)
        if repeated is not None:
            return Proposed(repeated, False, live, others, declined)
        row = store.add_proposal(
            session,
            {
                "tenant": tenant,
                "handle": new_handle(),
                "kind": spec.name,
                "order_ref": order_ref,
                "params": canonical_params(intent),
                "fingerprint": fp.fingerprint(spec.name, intent),
                "fingerprint_key_version": fp.current,
                "reason": reason,
                "correlation_id": correlation_id,
                "compensates_id": compensates.id if compensates is not None else None,
            },
        )
        return Proposed(row, True, live, others, declined)

    def find(self, session: Session, tenant: str, handle: str) -> Proposal:
        """Proposal ``handle`` of ``tenant``; NotFound (the same error) for any other."""
        tenant = validate_tenant(tenant)
        found = None
        if isinstance(handle, str) and HANDLE_RE.fullmatch(handle) is not None:
            found = store.find_proposal(session, tenant, handle)
        if found is None:
            raise NotFound("no such proposal", code="proposal_not_found")
        return found

    def approve(self, session: Session, tenant: str, handle: str, *, by: str) -> Proposal:
        """Approve a proposal: enqueue its exact parameters under a new app-minted op_id, in a
        run of its own, and mark it approved, all in ``session`` (never committed).

        Approving an approved proposal returns it unchanged; a declined one raises
        ProposalConflict, and so does one past its time to live (code ``proposal_expired``),
        marked or not. The caller rolls back on any error: nothing is then written.
        """
        by = validate_label(by, field="actor", max_length=MAX_ACTOR)
        proposal = self.find(session, tenant, handle)
        check = decision_check(proposal.status, self.expired(session, proposal), APPROVED)
        if check == APPROVED:
            return proposal
        self._refuse(check, proposal)
        self._check_bound(proposal)
        # The one lock order: the order's lock before a compensation's (``_enqueue``).
        lock = order_lock(proposal.tenant, proposal.kind, proposal.order_ref)
        storage_for(session).lock_order(session, lock)
        op_id = new_op_id()
        run_id = self._enqueue(session, proposal, op_id)
        cutoff = store.expiry_cutoff(session, self.ttl)
        if not store.decide(
            session,
            proposal.id,
            status=APPROVED,
            by=by,
            op_id=op_id,
            run_id=run_id,
            made_after=cutoff,
        ):
            # Expired in between, or decided by somebody else first.
            self._refuse("proposal_expired" if self.expired(session, proposal) else None, proposal)
            raise ProposalConflict("the proposal was decided by somebody else first")
        session.expire(proposal)
        return proposal

    def _enqueue(self, session: Session, proposal: Proposal, op_id: str) -> int:
        """Enqueue an approved proposal's exact parameters under ``op_id`` in a run of its own
        (a compensation: linked to the original operation, which must have no compensation
        that could still undo it); that run's id."""
        offsets: Operation | None = None
        if proposal.compensates_id is not None:
            original = session.get(Proposal, proposal.compensates_id)
            assert original is not None  # a foreign key holds it
            offsets = operation_to_offset(session, original)
            refuse_if_compensated(session, offsets)
        run = open_run(session, tenant=proposal.tenant, title=f"agent proposal {proposal.handle}")
        self.outbox.enqueue(
            session,
            tenant=proposal.tenant,
            op_id=op_id,
            kind=proposal.kind,
            params=proposal.params,
            run=run,
            correlation_id=proposal.correlation_id,
            compensates=offsets,
        )
        return run.id

    def decline(self, session: Session, tenant: str, handle: str, *, by: str) -> Proposal:
        """Decline a proposal still waiting (never committed); declining a declined one is
        harmless; an approved or expired one raises ProposalConflict."""
        by = validate_label(by, field="actor", max_length=MAX_ACTOR)
        proposal = self.find(session, tenant, handle)
        check = decision_check(proposal.status, self.expired(session, proposal), DECLINED)
        if check == DECLINED:
            return proposal
        self._refuse(check, proposal)
        if not store.decide(session, proposal.id, status=DECLINED, by=by):
            raise ProposalConflict(code="proposal_decided", status=proposal.status)
        session.expire(proposal)
        return proposal

    def waiting(self, session: Session, tenant: str | None = None) -> list[Proposal]:
        """The proposals waiting for a decision (of one tenant, or all), oldest first; an
        expired one is not waiting, marked or not."""
        return store.waiting(
            session,
            validate_tenant(tenant) if tenant is not None else None,
            made_after=store.expiry_cutoff(session, self.ttl),
        )

    def expired(self, session: Session, proposal: Proposal) -> bool:
        """Whether ``proposal`` has expired: marked so, or undecided past its time to live
        by the database's clock (not yet marked by the sweeper)."""
        if proposal.status == EXPIRED:
            return True
        return proposal.status == PROPOSED and store.is_past(session, proposal.id, self.ttl)

    def status_of(self, session: Session, proposal: Proposal) -> str:
        """The proposal's status as it truly is now (``expired`` once past its time to live)."""
        return EXPIRED if self.expired(session, proposal) else proposal.status

    @staticmethod
    def _refuse(check: str | None, proposal: Proposal) -> None:
        """ProposalConflict for a ``decision_check`` that refused (None: nothing)."""
        if check == "proposal_expired":
            raise ProposalConflict(
                "the proposal expired without a decision; nothing was sent",
                code="proposal_expired",
                status=EXPIRED,
            )
        if check == "proposal_decided":
            raise ProposalConflict(code="proposal_decided", status=proposal.status)

    def _check_bound(self, proposal: Proposal) -> None:
        """The stored parameters still match the fingerprint they were proposed with."""
        spec = self.outbox.registry.get(proposal.kind)
        intent = spec.parse(proposal.params)
        fp = self.outbox.fingerprinter
        if not fp.matches(
            spec.name, intent, proposal.fingerprint_key_version, proposal.fingerprint
        ):
            raise InvalidInput(
                "the proposal's parameters no longer match what was proposed",
                code="proposal_tampered",
            )


def proposal_report(
    session: Session, proposal: Proposal, *, cadence: Cadence | None = None
) -> Report | None:
    """The run report of an approved proposal's operation (None before approval); with
    ``cadence``, an uncertain line says when it is decided at the latest."""
    if proposal.run_id is None:
        return None
    run = run_by_id(session, proposal.run_id)
    if run is None:  # pragma: no cover - a foreign key holds it
        return None
    return run_report(session, proposal.tenant, run.handle, cadence=cadence)
