"""The request tools of ``settled mcp`` (``request_refund``, ``request_after_sales_ticket``,
``request_compensation``): asking for approval, on both protocol revisions.

A request tool runs in two parts, as SDK resolvers (``Resolve``) ahead of its body. The first
part (``*_step``) validates and makes the proposal, or finds the live one it repeats; the
second (``*_question``) puts a waiting proposal to the human. On revisions up to 2025-11-25
the server asks mid-call (``ctx.elicit``, from the body). From 2026-07-28 on, the question
travels in the tool call's answer (``InputRequiredResult``) and the client calls the tool
again with the human's answer and the sealed ``request_state``; both parts run again on that
round. So the first part must be idempotent across rounds: on a continuation it finds the
same proposal, and asks about it again (the SDK then consumes the recorded answer) instead
of answering "repeat". The question names the proposal's handle and exact parameters, and
the SDK takes an answer only for the exact question it recorded as asked: an answer about
another proposal, or other parameters, is never taken for this one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeAlias

from mcp.server.mcpserver import AcceptedElicitation, Context, Elicit, ElicitationResult, Resolve
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult
from mcp_types.version import is_version_at_least
from pydantic import BaseModel
from sqlalchemy.orm import Session

from outbox.errors import InvalidInput, NotFound, ProposalConflict
from outbox.kinds import AgentProfile
from outbox.models import Operation, Proposal
from outbox.proposals import PROPOSED, Proposed, auto_approvable
from settled.mcp_answers import WITHDRAWN_BY, answer, refusal
from settled.mcp_desk import AgentDesk, describe_now, desk_of, guarded, invalid

#: the first protocol revision that carries a question to the human inside the tool call's
#: answer (``InputRequiredResult``) rather than as a request from the server mid-call
INPUT_REQUIRED_REVISION = "2026-07-28"

#: the core's names of a request's own fields, as the tools call them
TOOL_NAMES = {"correlation_id": "call_id"}


class Approval(BaseModel):
    """What the human in the client answers to an approval prompt."""

    approve: bool


@dataclass(frozen=True)
class Ask:
    """A waiting proposal to put to the human in the client, and the prompt that shows it."""

    tenant: str
    handle: str
    kind: str
    prompt: str


#: what a request's first part decided: the answer to give now, or a proposal to ask about
Step: TypeAlias = CallToolResult | Ask


async def refund_step(
    order_id: str,
    amount_minor: int,
    currency: str,
    payee: str,
    reason: str,
    call_id: str | None,
    ctx: Context,
) -> Step:
    """request_refund's first part: refuse, or propose (or find what it repeats)."""
    params = {
        "order_id": order_id,
        "amount_minor": amount_minor,
        "currency": currency,
        "payee": payee,
    }
    return await _first_part(ctx, "refund", params, reason, call_id)


async def ticket_step(
    order_id: str,
    problem: str,
    reason: str,
    call_id: str | None,
    ctx: Context,
) -> Step:
    """request_after_sales_ticket's first part."""
    params = {"order_id": order_id, "reason": problem}
    return await _first_part(ctx, "after_sales_ticket", params, reason, call_id)


async def compensation_step(
    handle: str,
    reason: str,
    cause: str,
    call_id: str | None,
    ctx: Context,
) -> Step:
    """request_compensation's first part."""
    compensation = {"handle": handle, "cause": cause}
    return await _first_part(ctx, "ticket_cancel", compensation, reason, call_id)


async def refund_question(
    step: Annotated[Step, Resolve(refund_step)], ctx: Context
) -> Elicit[Approval] | None:
    """request_refund's question to the human (None: not asked in the call's answer)."""
    return _question(step, ctx)


async def ticket_question(
    step: Annotated[Step, Resolve(ticket_step)], ctx: Context
) -> Elicit[Approval] | None:
    """request_after_sales_ticket's question to the human."""
    return _question(step, ctx)


async def compensation_question(
    step: Annotated[Step, Resolve(compensation_step)], ctx: Context
) -> Elicit[Approval] | None:
    """request_compensation's question to the human."""
    return _question(step, ctx)


def _asks_in_answer(ctx: Context) -> bool:
    """Whether this call's revision carries questions in the tool's answer (2026-07-28 on)."""
    version = ctx.protocol_version
    return version is not None and is_version_at_least(version, INPUT_REQUIRED_REVISION)


def _can_elicit(ctx: Context) -> bool:
    """Whether the client said it can show a form to its human (a bare ``elicitation``, the
    only shape before modes, counts as forms)."""
    capabilities = ctx.client_capabilities
    elicitation = capabilities.elicitation if capabilities is not None else None
    return elicitation is not None and (elicitation.form is not None or elicitation.url is None)


def _question(step: Step, ctx: Context) -> Elicit[Approval] | None:
    if isinstance(step, Ask) and _asks_in_answer(ctx) and _can_elicit(ctx):
        return Elicit(step.prompt, Approval)
    return None


async def _first_part(
    ctx: Context,
    kind: str,
    params: dict[str, Any],
    reason: str,
    call_id: str | None,
) -> Step:
    """Refuse a caller with no tenant; else propose (a compensation: of the request
    ``params["handle"]``), approve by policy where it may, and say what to ask. (An op_id,
    or any argument the tool does not take, was refused before: ``AgentServer.call_tool``.)"""
    desk = desk_of(ctx)
    tenant = desk.caller()
    if tenant is None:
        return refusal("permission", "This connection has no tenant. Stop; do not retry.")

    def make(session: Session) -> Proposed:
        if "handle" in params:  # request_compensation's: the request it compensates
            return desk.proposals.propose_compensation(
                session,
                tenant=tenant,
                handle=params["handle"],
                cause=params["cause"],
                reason=reason,
                correlation_id=call_id,
            )
        return desk.proposals.propose(
            session,
            tenant=tenant,
            kind=kind,
            params=params,
            reason=reason,
            correlation_id=call_id,
        )

    # A sealed request_state (the SDK checked it is ours, for this tool, these arguments and
    # this caller) means this call continues one that asked the human.
    continuing = ctx.request_state is not None
    return await _propose(desk, tenant, kind, make, continuing=continuing)


async def _propose(
    desk: AgentDesk,
    tenant: str,
    kind: str,
    make: Callable[[Session], Proposed],
    *,
    continuing: bool,
) -> Step:
    """Make the proposal (``make``); approve it by policy, or say what to ask the human. A
    repeat answers with the earlier proposal and its status, except on a continuation of the
    call that asked about it while it still waits: that one is asked about again."""

    def propose(session: Session) -> Step:
        got = make(session)
        p = got.proposal
        limit = desk.auto_approve_minor.get(tenant)
        auto = got.created and auto_approvable(
            limit, p.params.get("amount_minor"), got.earlier, got.others
        )
        if auto:
            desk.proposals.approve(session, tenant, p.handle, by="policy:auto_approve")
            return answer(describe_now(desk, session, p, "en"))
        waiting = p.status == PROPOSED and not desk.proposals.expired(session, p)
        if got.created or (continuing and waiting):
            # only those made before it: the same prompt on every round of one call
            earlier = [_summary(e) for e in got.earlier if e.id < p.id]
            # and the app's own (one made between two rounds changes the question: the human
            # is asked again, now shown it)
            earlier += [_made(op) for op in got.others]
            earlier += [_summary(e) for e in got.declined if e.id < p.id]
            return Ask(tenant, p.handle, p.kind, _prompt(p, earlier, desk.profile(p.kind)))
        status = describe_now(desk, session, p, "en")
        status["repeat"] = True
        status["note"] = desk.profile(kind).repeat_note
        return answer(status)

    try:
        return await desk.in_transaction(propose)
    except NotFound:
        return refusal("fixable", "No such request. Check the handle.", field="handle")
    except InvalidInput as exc:
        return invalid(exc, {**desk.profile(kind).tool_fields, **TOOL_NAMES})


async def conclude(
    desk: AgentDesk, ctx: Context, step: Step, approval: ElicitationResult[Any]
) -> CallToolResult:
    """A request tool's body: the first part's answer, or the human's decision carried out."""
    if isinstance(step, CallToolResult):
        return step
    outcome: ElicitationResult[Any] | None = approval
    if isinstance(approval, AcceptedElicitation) and not isinstance(approval.data, Approval):
        # Not asked in the call's answer: before 2026-07-28 ask now, mid-call; a client
        # that cannot be asked leaves the proposal for staff.
        outcome = None if _asks_in_answer(ctx) else await _elicit_now(ctx, step.prompt)
    return await _decided(desk, step, outcome)


async def _elicit_now(ctx: Context, prompt: str) -> ElicitationResult[Approval] | None:
    """Ask the human mid-call (revisions up to 2025-11-25); None when nobody can be asked."""
    try:
        return await ctx.elicit(prompt, Approval)
    except MCPError:
        return None


async def _decided(
    desk: AgentDesk, ask: Ask, outcome: ElicitationResult[Any] | None
) -> CallToolResult:
    """Approve, decline, or leave for staff, as the human answered (None: not asked)."""
    tenant, handle = ask.tenant, ask.handle
    if isinstance(outcome, AcceptedElicitation) and outcome.data.approve:
        return await guarded(
            desk,
            lambda s: answer(
                describe_now(
                    desk, s, desk.proposals.approve(s, tenant, handle, by="user:elicitation"), "en"
                )
            ),
        )
    if outcome is not None and outcome.action in ("accept", "decline"):
        return await guarded(desk, lambda s: _declined(desk, s, ask), noun="request")
    profile = desk.profile(ask.kind)
    return refusal(
        "pending",
        f"The {profile.noun_of(ask.kind)} waits for approval by support staff. Do not retry: "
        f"check {profile.status_tool} with this handle later.",
        handle=handle,
    )


def _declined(desk: AgentDesk, session: Session, ask: Ask) -> CallToolResult:
    """Decline as the human answered; if staff approved it (or it expired) while the question
    was open, the proposal as it now stands instead: the model must not say nothing happens
    when something will."""
    try:
        desk.proposals.decline(session, ask.tenant, ask.handle, by="user:elicitation")
    except ProposalConflict:
        session.expire_all()  # decided by another transaction: read it as it now is
        proposal = desk.proposals.find(session, ask.tenant, ask.handle)
        status = describe_now(desk, session, proposal, "en")
        noun = desk.profile(ask.kind).noun_of(ask.kind)
        status["note"] = (
            f"The user declined, but this {noun} was already {status['status']} "
            f"({proposal.decided_by or 'expiry'}) before the answer arrived. Tell the user "
            "exactly this status."
        )
        return answer(status)
    noun = desk.profile(ask.kind).noun_of(ask.kind)
    return refusal(
        "business_rejected",
        f"The user declined this {noun}. Tell the user; do not ask again unless they do.",
        handle=ask.handle,
    )


def _prompt(proposal: Proposal, earlier: list[dict[str, Any]], profile: AgentProfile) -> str:
    """The approval prompt: what would be done (for a refund: amount, currency, payee and
    order; ``AgentProfile.prompt``), the reason, and the earlier requests of the same kind on
    the order."""
    kind = proposal.kind
    lines = [f"Approve {profile.what(kind, proposal.params)}?"]
    lines.append(f"Request: {proposal.handle}")
    lines.append(f"Reason given: {proposal.reason}")
    for e in earlier:
        what = profile.what(kind, e, short=True)
        if e["status"] == "declined":
            lines.append(f"Declined before on this order: {what} ({_declined_by(e)}).")
        else:
            lines.append(f"Earlier on this order: {what} ({e['status']}).")
    return "\n".join(lines)


def _declined_by(e: dict[str, Any]) -> str:
    """Who said no to an earlier request, in the prompt's words."""
    by = e.get("decided_by") or ""
    if by == WITHDRAWN_BY:
        return "withdrawn by the agent"
    if by.startswith("user:"):
        return "declined by the user"
    if by.startswith("staff:"):
        return "declined by support staff"
    return "declined"


def _summary(p: Proposal) -> dict[str, Any]:
    return {"handle": p.handle, "status": p.status, "decided_by": p.decided_by, **p.params}


def _made(op: Operation) -> dict[str, Any]:
    """An operation the app made itself on the order, as the prompt lists it."""
    return {"status": op.state, **op.params}
