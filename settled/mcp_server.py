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
from typing import Any, TypeVar

import anyio
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import Context, MCPServer
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, ToolAnnotations
from pydantic import BaseModel
from sqlalchemy.orm import Session, sessionmaker

from outbox.apikeys import authenticate
from outbox.currencies import MINOR_UNITS
from outbox.errors import (
    IdempotencyConflict,
    InvalidInput,
    InvalidParams,
    NotFound,
    ProposalConflict,
)
from outbox.models import Proposal
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

WRITE_RULES = (
    "Never call this again to 'retry' after a timeout or an error: a repeat of the same "
    "request answers with the earlier one, and the refund is tracked by its handle. Check "
    "refund_status instead. Errors have a kind: fixable (correct the named field and call "
    "again), permission (stop; do not retry), business_rejected (explain to the user), "
    "pending (do not retry; check refund_status later), conflict."
)


#: what each kind of request is called in the tools' answers
NOUNS = {"refund": "refund", "after_sales_ticket": "ticket", "ticket_cancel": "compensation"}
#: the intent's field names as each request tool calls them (the ticket's "reason" is the
#: tool's ``problem``: the tool's ``reason`` is the free-text why)
FIELD_NAMES = {"after_sales_ticket": {"reason": "problem"}, "ticket_cancel": {"reason": "cause"}}
#: bad input no other value of a field fixes: explained to the user, not corrected
NOTHING_TO_DO = frozenset({"not_compensable", "nothing_to_compensate", "run_cancelled"})
REPEAT_NOTES = {
    "refund": "This repeats an earlier request for the same order, amount, currency and payee: "
    "no new refund was made. Do not ask again; follow this handle with refund_status.",
    "after_sales_ticket": "This repeats an earlier ticket request for the same order and "
    "problem: no new ticket was made. Do not ask again; follow this handle with "
    "request_status.",
    "ticket_cancel": "This repeats an earlier compensation request for the same operation: "
    "nothing new was made. Do not ask again; follow this handle with request_status.",
}


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
    server = MCPServer(
        "settled",
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
        call_id: str | None = None,
        op_id: str | None = None,
    ) -> CallToolResult:
        if op_id is not None:
            return refusal(
                "fixable",
                "Do not send an op_id: the server mints one when the refund is approved. "
                "Call again without it.",
                field="op_id",
            )
        tenant = desk.caller()
        if tenant is None:
            return refusal("permission", "This connection has no tenant. Stop; do not retry.")
        params = {
            "order_id": order_id,
            "amount_minor": amount_minor,
            "currency": currency,
            "payee": payee,
        }
        return await _request(desk, ctx, tenant, "refund", params, reason, call_id)

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
        call_id: str | None = None,
        op_id: str | None = None,
    ) -> CallToolResult:
        if op_id is not None:
            return refusal(
                "fixable",
                "Do not send an op_id: the server mints one when the ticket is approved. "
                "Call again without it.",
                field="op_id",
            )
        tenant = desk.caller()
        if tenant is None:
            return refusal("permission", "This connection has no tenant. Stop; do not retry.")
        params = {"order_id": order_id, "reason": problem}
        return await _request(desk, ctx, tenant, "after_sales_ticket", params, reason, call_id)

    @server.tool(
        description=(
            "Ask to compensate (undo) what an approved request did: for an after-sales ticket, "
            "cancelling it. handle is the original request's; cause is one of: "
            "customer_request, pickup_failed, duplicate. This is a new operation: it happens "
            "only after approval (the user is asked, or staff approve it), it can fail too, "
            "and it is reported by its own receipt: nothing is reversed until request_status "
            "says so. A refund cannot be compensated here. " + WRITE_RULES
        ),
        annotations=ToolAnnotations(
            readOnlyHint=False, destructiveHint=True, idempotentHint=False, openWorldHint=True
        ),
    )
    async def request_compensation(
        handle: str,
        reason: str,
        ctx: Context,
        cause: str = "customer_request",
        call_id: str | None = None,
        op_id: str | None = None,
    ) -> CallToolResult:
        if op_id is not None:
            return refusal(
                "fixable",
                "Do not send an op_id: the server mints one when the compensation is "
                "approved. Call again without it.",
                field="op_id",
            )
        tenant = desk.caller()
        if tenant is None:
            return refusal("permission", "This connection has no tenant. Stop; do not retry.")

        def make(session: Session) -> Proposed:
            return desk.proposals.propose_compensation(
                session,
                tenant=tenant,
                handle=handle,
                cause=cause,
                reason=reason,
                correlation_id=call_id,
            )

        return await _decide(desk, ctx, tenant, "ticket_cancel", make)

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
    return describe(session, proposal, lang, expired=desk.proposals.expired(session, proposal))


async def _request(
    desk: AgentDesk,
    ctx: Context,
    tenant: str,
    kind: str,
    params: dict[str, Any],
    reason: str,
    call_id: str | None,
) -> CallToolResult:
    """Propose; then approve by policy, or ask the human, or leave it for staff."""

    def make(session: Session) -> Proposed:
        return desk.proposals.propose(
            session,
            tenant=tenant,
            kind=kind,
            params=params,
            reason=reason,
            correlation_id=call_id,
        )

    return await _decide(desk, ctx, tenant, kind, make)


async def _decide(
    desk: AgentDesk,
    ctx: Context,
    tenant: str,
    kind: str,
    make: Callable[[Session], Proposed],
) -> CallToolResult:
    """Make the proposal (``make``); then approve by policy, or ask the human, or leave it
    for staff. A repeat answers with the earlier proposal and its status."""

    def propose(
        session: Session,
    ) -> tuple[Proposal, bool, list[dict[str, Any]], bool, dict[str, Any]]:
        got = make(session)
        p = got.proposal
        limit = desk.auto_approve_minor.get(tenant)
        amount = p.params.get("amount_minor")
        auto = got.created and auto_approvable(limit, amount, got.earlier)
        if auto:
            desk.proposals.approve(session, tenant, p.handle, by="policy:auto_approve")
        earlier = [_summary(e) for e in got.earlier]
        return p, got.created, earlier, auto, _describe(desk, session, p, "en")

    try:
        proposal, created, earlier, auto, status = await desk.in_transaction(propose)
    except NotFound:
        return refusal("fixable", "No such request. Check the handle.", field="handle")
    except InvalidInput as exc:
        return _invalid(exc, FIELD_NAMES.get(kind, {}))
    if not created:
        status["repeat"] = True
        status["note"] = REPEAT_NOTES[kind]
        return answer(status)
    if auto:
        return answer(status)
    return await _ask_human(desk, ctx, tenant, proposal, earlier)


async def _ask_human(
    desk: AgentDesk, ctx: Context, tenant: str, proposal: Proposal, earlier: list[dict[str, Any]]
) -> CallToolResult:
    """Elicit the human's approval; with no elicitation, the proposal waits for staff."""
    handle = proposal.handle
    try:
        got = await ctx.elicit(_prompt(proposal, earlier), Approval)
    except MCPError:
        got = None
    if got is not None and got.action == "accept" and got.data.approve:
        return await _guarded(
            desk,
            lambda s: answer(
                _describe(
                    desk, s, desk.proposals.approve(s, tenant, handle, by="user:elicitation"), "en"
                )
            ),
        )
    if got is not None and got.action in ("accept", "decline"):
        await desk.in_transaction(
            lambda s: desk.proposals.decline(s, tenant, handle, by="user:elicitation")
        )
        return refusal(
            "business_rejected",
            f"The user declined this {NOUNS[proposal.kind]}. Tell the user; do not ask again "
            "unless they do.",
            handle=handle,
        )
    status_tool = "refund_status" if proposal.kind == "refund" else "request_status"
    return refusal(
        "pending",
        f"The {NOUNS[proposal.kind]} waits for approval by support staff. Do not retry: check "
        f"{status_tool} with this handle later.",
        handle=handle,
    )


def _prompt(proposal: Proposal, earlier: list[dict[str, Any]]) -> str:
    """The approval prompt: what would be done (for a refund: amount, currency, payee and
    order), the reason, and the earlier requests of the same kind on the order."""
    lines = [f"Approve {_what(proposal.kind, proposal.params)}?"]
    lines.append(f"Reason given: {proposal.reason}")
    for e in earlier:
        lines.append(
            f"Earlier on this order: {_what(proposal.kind, e, short=True)} ({e['status']})."
        )
    return "\n".join(lines)


def _what(kind: str, p: Mapping[str, Any], *, short: bool = False) -> str:
    """What a proposal of ``kind`` with params ``p`` would do, in a few words."""
    if kind == "refund":
        money = f"{_amount(p['amount_minor'], p['currency'])} {p['currency']}"
        if short:
            return f"{money} to {p['payee']}"
        return f"a refund of {money} to payee {p['payee']} on order {p['order_id']}"
    if kind == "after_sales_ticket":
        ticket = f"an after-sales ticket ({p['reason']})"
        return ticket if short else f"{ticket} on order {p['order_id']}"
    if kind == "ticket_cancel":
        return f"cancelling ticket {p['ticket_id']} ({p['reason']})"
    return kind  # pragma: no cover - the tools propose only the kinds above


def _amount(minor: int, currency: str) -> str:
    digits = MINOR_UNITS.get(currency, 2)
    if digits == 0:
        return str(minor)
    return f"{minor // 10**digits}.{minor % 10**digits:0{digits}d}"


def _summary(p: Proposal) -> dict[str, Any]:
    return {"handle": p.handle, "status": p.status, **p.params}


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
