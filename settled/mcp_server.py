"""``settled mcp``: a Model Context Protocol server whose tools make the safe path the only one.

A model may *ask* for a refund; only the app makes it real, once. ``request_refund`` makes a
proposal (``outbox.proposals``), never an operation: the human approves it in the client (MCP
elicitation, showing amount, currency, payee and order), or the tenant's policy does (up to
an amount), or staff do (``settled proposals approve``). Only then is an operation enqueued,
under an op_id the app mints. The model's tool-call id is stored as correlation only, and the
model never passes an op_id: a regenerated call can never become a second refund.

Errors are tool results with a ``kind`` the model can act on: ``fixable`` (names the field),
``permission`` (stop), ``business_rejected`` (tell the user), ``pending`` (do not retry;
check the status later), ``conflict``. There is no "retryable" for a write.

A stdio server speaks for one configured tenant; over streamable HTTP the bearer token is a
tenant's API key (``outbox.apikeys``). Another tenant's handle answers exactly like a made-up one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, TypeAlias, TypeVar

import anyio
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import (
    AcceptedElicitation,
    Context,
    Elicit,
    ElicitationResult,
    MCPServer,
    Resolve,
)
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, ToolAnnotations
from mcp_types.version import is_version_at_least
from pydantic import BaseModel
from sqlalchemy.orm import Session, sessionmaker

from outbox.apikeys import authenticate
from outbox.errors import (
    IdempotencyConflict,
    InvalidInput,
    InvalidParams,
    NotFound,
    ProposalConflict,
)
from outbox.kinds import AgentProfile
from outbox.models import Operation, Proposal
from outbox.proposals import (
    APPROVED,
    PROPOSED,
    Proposals,
    Proposed,
    auto_approvable,
    proposal_report,
)
from outbox.report_text import Lang, check_lang
from outbox.runs import cancel_run
from outbox.settings import Settings
from settled.mcp_answers import answer, describe, refusal

T = TypeVar("T")

#: the first protocol revision that carries a question to the human inside the tool call's
#: answer (``InputRequiredResult``) rather than as a request from the server mid-call
INPUT_REQUIRED_REVISION = "2026-07-28"

WRITE_RULES = (
    "Never call this again to 'retry' after a timeout or an error: a repeat of the same "
    "request answers with the earlier one, and the refund is tracked by its handle. Check "
    "refund_status instead. Errors have a kind: fixable (correct the named field and call "
    "again), permission (stop; do not retry), business_rejected (explain to the user), "
    "pending (do not retry; check refund_status later), conflict."
)


#: bad input no other value of a field fixes: explained to the user, not corrected
NOTHING_TO_DO = frozenset(
    {"not_compensable", "nothing_to_compensate", "run_cancelled", "already_compensated"}
)


class Approval(BaseModel):
    """What the human in the client answers to an approval prompt."""

    approve: bool


@dataclass(frozen=True)
class AgentDesk:
    """What the tools work with: the database, the proposals service, the policy."""

    sessions: sessionmaker[Session]
    proposals: Proposals
    #: per tenant, the largest amount (minor units) its policy approves by itself
    auto_approve_minor: Mapping[str, int]
    #: the one tenant a stdio server speaks for (None: the HTTP transport's API key says)
    tenant: str | None = None

    @classmethod
    def from_settings(cls, settings: Settings, sessions: sessionmaker[Session]) -> AgentDesk:
        return cls(
            sessions=sessions,
            proposals=Proposals.from_settings(settings),
            auto_approve_minor=dict(settings.agent_auto_approve_minor),
            tenant=settings.agent_tenant,
        )

    def profile(self, kind: str) -> AgentProfile:
        """What requests of ``kind`` mean to an agent (``outbox.kinds.AgentProfile``)."""
        return self.proposals.outbox.registry.get(kind).agent

    def caller(self) -> str | None:
        """The tenant of this call: the bound one, or the API key's (None: nobody)."""
        if self.tenant is not None:
            return self.tenant
        token = get_access_token()
        return token.client_id if token is not None else None

    async def in_transaction(self, action: Callable[[Session], T]) -> T:
        """``action(session)`` in one transaction, off the event loop."""

        def run() -> T:
            with self.sessions.begin() as session:
                return action(session)

        return await anyio.to_thread.run_sync(run)


class ApiKeyVerifier:
    """The HTTP transport's bearer token: a tenant's API key, checked as the status API does."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    async def verify_token(self, token: str) -> AccessToken | None:
        def check() -> AccessToken | None:
            with self.sessions() as session:
                principal = authenticate(session, token)
            if principal is None:
                return None
            return AccessToken(token=token, client_id=principal.tenant, scopes=[])

        return await anyio.to_thread.run_sync(check)


class AgentServer(MCPServer[Any]):
    """The MCP server, holding the desk its tools work with (their resolvers reach it
    through the call's context)."""

    def __init__(self, desk: AgentDesk, **kwargs: Any) -> None:
        super().__init__("settled", **kwargs)
        self.desk = desk


def build_server(desk: AgentDesk, *, http_url: str | None = None) -> MCPServer:
    """The MCP server with its tools; with ``http_url``, it takes API keys as bearer
    tokens (for the streamable-HTTP transport at that URL)."""
    auth = None
    verifier = None
    if http_url is not None:
        verifier = ApiKeyVerifier(desk.sessions)
        auth = AuthSettings(
            issuer_url=http_url, resource_server_url=http_url, validate_token_resource=False
        )
    server = AgentServer(
        desk,
        instructions=(
            "Refunds are proposals until approved by the user, the shop's policy or staff. "
            + WRITE_RULES
        ),
        token_verifier=verifier,
        auth=auth,
    )
    _register(server, desk)
    return server


def _register(server: MCPServer, desk: AgentDesk) -> None:
    @server.tool(
        description=(
            "Ask for a refund on an order. The refund happens only after approval (the user is "
            "asked, or the shop's policy or staff approve it). Give the business details and "
            "the reason; never an op id: the server mints it. " + WRITE_RULES
        ),
        annotations=ToolAnnotations(
            readOnlyHint=False, destructiveHint=False, idempotentHint=False, openWorldHint=True
        ),
    )
    async def request_refund(
        order_id: str,
        amount_minor: int,
        currency: str,
        payee: str,
        reason: str,
        ctx: Context,
        step: Annotated[Step, Resolve(refund_step)],
        approval: Annotated[ElicitationResult[Any], Resolve(refund_question)],
        call_id: str | None = None,
        op_id: str | None = None,
    ) -> CallToolResult:
        return await _conclude(desk, ctx, step, approval)

    @server.tool(
        description=(
            "Ask for an after-sales ticket on an order (a return or repair for a damaged, wrong "
            "or not-as-described item). problem is one of: damaged, wrong_item, "
            "not_as_described, other. The ticket is opened only after approval (the user is "
            "asked, or staff approve it); the server chooses the ticket id. Give the order, the "
            "problem and the reason; never an op id or a ticket id. " + WRITE_RULES
        ),
        annotations=ToolAnnotations(
            readOnlyHint=False, destructiveHint=False, idempotentHint=False, openWorldHint=True
        ),
    )
    async def request_after_sales_ticket(
        order_id: str,
        problem: str,
        reason: str,
        ctx: Context,
        step: Annotated[Step, Resolve(ticket_step)],
        approval: Annotated[ElicitationResult[Any], Resolve(ticket_question)],
        call_id: str | None = None,
        op_id: str | None = None,
    ) -> CallToolResult:
        return await _conclude(desk, ctx, step, approval)

    @server.tool(
        description=(
            "Ask to compensate (undo) what an approved request did: for an after-sales ticket, "
            "cancelling it. handle is the original request's; cause is one of: "
            "customer_request, pickup_failed, duplicate. This is a new operation: it happens "
            "only after approval (the user is asked, or staff approve it), it can fail too, "
            "and it is reported by its own receipt: nothing is reversed until request_status "
            "says so. A request is compensated once: asking again, with any cause, answers "
            "with the first compensation. It works on a cancelled request too. A refund cannot "
            "be compensated here. " + WRITE_RULES
        ),
        annotations=ToolAnnotations(
            readOnlyHint=False, destructiveHint=True, idempotentHint=False, openWorldHint=True
        ),
    )
    async def request_compensation(
        handle: str,
        reason: str,
        ctx: Context,
        step: Annotated[Step, Resolve(compensation_step)],
        approval: Annotated[ElicitationResult[Any], Resolve(compensation_question)],
        cause: str = "customer_request",
        call_id: str | None = None,
        op_id: str | None = None,
    ) -> CallToolResult:
        return await _conclude(desk, ctx, step, approval)

    status_rules = (
        "waiting for approval, declined, expired, or done / not done / uncertain with "
        "evidence. Uncertain means pending confirmation. Read-only; safe to call again."
    )

    async def status(handle: str, lang: str, noun: str) -> CallToolResult:
        asked = _caller_and_lang(desk, lang)
        if isinstance(asked, CallToolResult):
            return asked
        tenant, language = asked
        return await _guarded(
            desk,
            lambda s: answer(_describe(desk, s, desk.proposals.find(s, tenant, handle), language)),
            noun=noun,
        )

    async def cancel(handle: str, lang: str, noun: str) -> CallToolResult:
        asked = _caller_and_lang(desk, lang)
        if isinstance(asked, CallToolResult):
            return asked
        tenant, language = asked
        return await _guarded(
            desk, lambda s: answer(_cancel(desk, s, tenant, handle, language)), noun=noun
        )

    @server.tool(
        description="The status of a refund request by its handle: " + status_rules,
        annotations=ToolAnnotations(readOnlyHint=True, idempotentHint=True, openWorldHint=False),
    )
    async def refund_status(handle: str, lang: str = "en") -> CallToolResult:
        return await status(handle, lang, "refund request")

    @server.tool(
        description=(
            "The status of any request by its handle (a refund, an after-sales ticket, a "
            "compensation): " + status_rules
        ),
        annotations=ToolAnnotations(readOnlyHint=True, idempotentHint=True, openWorldHint=False),
    )
    async def request_status(handle: str, lang: str = "en") -> CallToolResult:
        return await status(handle, lang, "request")

    cancel_rules = (
        "one waiting for approval is withdrawn; for an approved one, nothing more is sent, "
        "and the answer says what was already sent and is pending confirmation. This never "
        "reverses what was done (ask for a compensation for that). Safe to call again."
    )
    cancel_annotations = ToolAnnotations(
        readOnlyHint=False, destructiveHint=True, idempotentHint=True, openWorldHint=True
    )

    @server.tool(
        description="Stop a refund request: " + cancel_rules, annotations=cancel_annotations
    )
    async def cancel_refund(handle: str, lang: str = "en") -> CallToolResult:
        return await cancel(handle, lang, "refund request")

    @server.tool(
        description="Stop any request by its handle (a refund, a ticket, a compensation): "
        + cancel_rules,
        annotations=cancel_annotations,
    )
    async def cancel_request(handle: str, lang: str = "en") -> CallToolResult:
        return await cancel(handle, lang, "request")


def _caller_and_lang(desk: AgentDesk, lang: str) -> tuple[str, Lang] | CallToolResult:
    """The caller's tenant and the answer's language, or the refusal to give instead."""
    tenant = desk.caller()
    if tenant is None:
        return refusal("permission", "This connection has no tenant. Stop; do not retry.")
    try:
        return tenant, check_lang(lang)
    except InvalidInput:
        return refusal("fixable", "lang must be 'en' or 'zh'.", field="lang")


def _cancel(
    desk: AgentDesk, session: Session, tenant: str, handle: str, lang: str
) -> dict[str, Any]:
    """Withdraw a waiting proposal, or stop the run of an approved one; the status after."""
    proposal = desk.proposals.find(session, tenant, handle)
    if proposal.status == PROPOSED and not desk.proposals.expired(session, proposal):
        desk.proposals.decline(session, tenant, handle, by="agent:cancel")
    elif proposal.status == APPROVED:
        report = proposal_report(session, proposal)
        if report is not None:
            cancel_run(session, tenant, report.handle, actor="agent:cancel")
    return _describe(desk, session, proposal, check_lang(lang))


def _describe(desk: AgentDesk, session: Session, proposal: Proposal, lang: Lang) -> dict[str, Any]:
    """``describe`` with the proposal's expiry judged by the database's clock now."""
    profile = desk.profile(proposal.kind)
    expired = desk.proposals.expired(session, proposal)
    return describe(session, proposal, lang, profile, expired=expired)


# -- asking for approval, on both protocol revisions ------------------------------------------
#
# A request tool runs in two parts, as SDK resolvers (``Resolve``) ahead of its body. The first
# part (``*_step``) validates and makes the proposal, or finds the live one it repeats; the
# second (``*_question``) puts a waiting proposal to the human. On revisions up to 2025-11-25
# the server asks mid-call (``ctx.elicit``, from the body). From 2026-07-28 on, the question
# travels in the tool call's answer (``InputRequiredResult``) and the client calls the tool
# again with the human's answer and the sealed ``request_state``; both parts run again on that
# round. So the first part must be idempotent across rounds: on a continuation it finds the
# same proposal, and asks about it again (the SDK then consumes the recorded answer) instead
# of answering "repeat". The question names the proposal's handle and exact parameters, and
# the SDK takes an answer only for the exact question it recorded as asked: an answer about
# another proposal, or other parameters, is never taken for this one.


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
    op_id: str | None,
    ctx: Context,
) -> Step:
    """request_refund's first part: refuse, or propose (or find what it repeats)."""
    params = {
        "order_id": order_id,
        "amount_minor": amount_minor,
        "currency": currency,
        "payee": payee,
    }
    return await _first_part(ctx, "refund", op_id, params, reason, call_id)


async def ticket_step(
    order_id: str,
    problem: str,
    reason: str,
    call_id: str | None,
    op_id: str | None,
    ctx: Context,
) -> Step:
    """request_after_sales_ticket's first part."""
    params = {"order_id": order_id, "reason": problem}
    return await _first_part(ctx, "after_sales_ticket", op_id, params, reason, call_id)


async def compensation_step(
    handle: str,
    reason: str,
    cause: str,
    call_id: str | None,
    op_id: str | None,
    ctx: Context,
) -> Step:
    """request_compensation's first part."""
    compensation = {"handle": handle, "cause": cause}
    return await _first_part(ctx, "ticket_cancel", op_id, compensation, reason, call_id)


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


def _desk(ctx: Context) -> AgentDesk:
    server = ctx.mcp_server
    assert isinstance(server, AgentServer)
    return server.desk


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
    op_id: str | None,
    params: dict[str, Any],
    reason: str,
    call_id: str | None,
) -> Step:
    """Refuse an op_id or a caller with no tenant; else propose (a compensation: of the
    request ``params["handle"]``), approve by policy where it may, and say what to ask."""
    desk = _desk(ctx)
    profile = desk.profile(kind)
    if op_id is not None:
        return refusal(
            "fixable",
            f"Do not send an op_id: the server mints one when the {profile.noun_of(kind)} is "
            "approved. Call again without it.",
            field="op_id",
        )
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
            return answer(_describe(desk, session, p, "en"))
        waiting = p.status == PROPOSED and not desk.proposals.expired(session, p)
        if got.created or (continuing and waiting):
            # only those made before it: the same prompt on every round of one call
            earlier = [_summary(e) for e in got.earlier if e.id < p.id]
            # and the app's own (one made between two rounds changes the question: the human
            # is asked again, now shown it)
            earlier += [_made(op) for op in got.others]
            return Ask(tenant, p.handle, p.kind, _prompt(p, earlier, desk.profile(p.kind)))
        status = _describe(desk, session, p, "en")
        status["repeat"] = True
        status["note"] = desk.profile(kind).repeat_note
        return answer(status)

    try:
        return await desk.in_transaction(propose)
    except NotFound:
        return refusal("fixable", "No such request. Check the handle.", field="handle")
    except InvalidInput as exc:
        return _invalid(exc, desk.profile(kind).tool_fields)


async def _conclude(
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
        return await _guarded(
            desk,
            lambda s: answer(
                _describe(
                    desk, s, desk.proposals.approve(s, tenant, handle, by="user:elicitation"), "en"
                )
            ),
        )
    if outcome is not None and outcome.action in ("accept", "decline"):
        return await _guarded(desk, lambda s: _declined(desk, s, ask), noun="request")
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
        status = _describe(desk, session, proposal, "en")
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
        lines.append(f"Earlier on this order: {profile.what(kind, e, short=True)} ({e['status']}).")
    return "\n".join(lines)


def _summary(p: Proposal) -> dict[str, Any]:
    return {"handle": p.handle, "status": p.status, **p.params}


def _made(op: Operation) -> dict[str, Any]:
    """An operation the app made itself on the order, as the prompt lists it."""
    return {"status": op.state, **op.params}


async def _guarded(
    desk: AgentDesk,
    action: Callable[[Session], CallToolResult],
    *,
    noun: str = "refund request",
) -> CallToolResult:
    """Run ``action`` in a transaction; the core's errors as the model's error kinds."""
    try:
        return await desk.in_transaction(action)
    except NotFound:
        return refusal("fixable", f"No such {noun}. Check the handle.", field="handle")
    except (ProposalConflict, IdempotencyConflict) as exc:
        return refusal("conflict", exc.message)
    except InvalidInput as exc:
        return _invalid(exc)


def _invalid(exc: InvalidInput, names: Mapping[str, str] | None = None) -> CallToolResult:
    """Bad input as a fixable error naming the tool's field (never echoing the value);
    ``names``: the intent's field names as the tool calls them."""
    field = exc.data.get("field")
    if exc.code in NOTHING_TO_DO:
        return refusal("business_rejected", exc.message + ". Tell the user; do not retry.")
    if isinstance(exc, InvalidParams) and exc.data.get("errors"):
        first = exc.data["errors"][0]
        field, problem = first["field"], first["error"]
        field = (names or {}).get(field, field)
        return refusal("fixable", f"{field} is not valid ({problem}).", field=field)
    return refusal("fixable", exc.message, field=field)
