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

Here: the tools, their descriptions and annotations, and the read tools (status, cancel);
``settled.mcp_requests`` the request tools' two parts (proposing, asking the human);
``settled.mcp_desk`` what the tools work with; ``settled.mcp_answers`` what they answer.
"""

from typing import Annotated, Any

from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import Context, ElicitationResult, MCPServer, Resolve
from mcp_types import CallToolResult, ToolAnnotations
from sqlalchemy.orm import Session

from outbox.proposals import APPROVED, PROPOSED, proposal_report
from outbox.report_text import check_lang
from outbox.runs import cancel_run
from settled.mcp_answers import WITHDRAWN_BY, ToolAnswer, answer
from settled.mcp_args import (
    Amount,
    CallId,
    Cause,
    CurrencyCode,
    Handle,
    Lang,
    OrderId,
    Payee,
    Problem,
    Reason,
)
from settled.mcp_desk import (
    AgentDesk,
    AgentServer,
    ApiKeyVerifier,
    caller_and_lang,
    describe_now,
    guarded,
)
from settled.mcp_requests import (
    Step,
    compensation_question,
    compensation_step,
    conclude,
    refund_question,
    refund_step,
    ticket_question,
    ticket_step,
)

#: what every tool returns: its answer, whose structured content is a ToolAnswer (the output
#: schema the client validates a successful answer against); errors are Refusal's shape
Answer = Annotated[CallToolResult, ToolAnswer]

__all__ = ["AgentDesk", "AgentServer", "ApiKeyVerifier", "build_server"]


def write_rules(noun: str) -> str:
    """How a request tool's answers and errors are read: ``noun`` is what it asks for."""
    return (
        "Never call this again to 'retry' after a timeout or an error: a repeat of the same "
        f"request answers with the earlier one, and the {noun} is tracked by its handle. Check "
        "request_status instead. Errors have a kind: fixable (correct the named field and "
        "call again), permission (stop; do not retry), business_rejected (explain to the "
        "user), pending (do not retry; check request_status later), conflict."
    )


def build_server(desk: AgentDesk, *, http_url: str | None = None) -> MCPServer:
    """The MCP server with its tools; with ``http_url``, it takes API keys as bearer
    tokens (for the streamable-HTTP transport at that URL)."""
    auth = None
    verifier = None
    if http_url is not None:
        verifier = ApiKeyVerifier(desk.sessions)
        # No OAuth: an API key is the bearer token. No resource_server_url, so the 401 and
        # the app advertise no protected-resource metadata (no authorization server to find);
        # ``settled.mcp_http.BearerHint`` says in the 401 how to authenticate.
        auth = AuthSettings(
            issuer_url=http_url, resource_server_url=None, validate_token_resource=False
        )
    server = AgentServer(
        desk,
        instructions=(
            "Refunds are proposals until approved by the user, the shop's policy or staff. "
            + write_rules("request")
        ),
        token_verifier=verifier,
        auth=auth,
    )
    _register(server, desk)
    for tool in server._tool_manager.list_tools():
        # what AgentServer.call_tool refuses (an op_id, any argument a tool does not take)
        tool.parameters["additionalProperties"] = False
    return server


def _register(server: MCPServer, desk: AgentDesk) -> None:
    @server.tool(
        description=(
            "Ask for a refund on an order. The refund happens only after approval (the user is "
            "asked, or the shop's policy or staff approve it). Give the business details and "
            "the reason; never an op id: the server mints it. " + write_rules("refund")
        ),
        annotations=ToolAnnotations(
            readOnlyHint=False, destructiveHint=False, idempotentHint=False, openWorldHint=True
        ),
    )
    async def request_refund(
        order_id: OrderId,
        amount_minor: Amount,
        currency: CurrencyCode,
        payee: Payee,
        reason: Reason,
        ctx: Context,
        step: Annotated[Step, Resolve(refund_step)],
        approval: Annotated[ElicitationResult[Any], Resolve(refund_question)],
        call_id: CallId | None = None,
    ) -> Answer:
        return await conclude(desk, ctx, step, approval)

    @server.tool(
        description=(
            "Ask for an after-sales ticket on an order (a return or repair for a damaged, wrong "
            "or not-as-described item). problem is one of: damaged, wrong_item, "
            "not_as_described, other. The ticket is opened only after approval (the user is "
            "asked, or staff approve it); the server chooses the ticket id. Give the order, the "
            "problem and the reason; never an op id or a ticket id. " + write_rules("ticket")
        ),
        annotations=ToolAnnotations(
            readOnlyHint=False, destructiveHint=False, idempotentHint=False, openWorldHint=True
        ),
    )
    async def request_after_sales_ticket(
        order_id: OrderId,
        problem: Problem,
        reason: Reason,
        ctx: Context,
        step: Annotated[Step, Resolve(ticket_step)],
        approval: Annotated[ElicitationResult[Any], Resolve(ticket_question)],
        call_id: CallId | None = None,
    ) -> Answer:
        return await conclude(desk, ctx, step, approval)

    @server.tool(
        description=(
            "Ask to compensate (undo) what an approved request did: for an after-sales ticket, "
            "cancelling it. handle is the original request's; cause is one of: "
            "customer_request, pickup_failed, duplicate. This is a new operation: it happens "
            "only after approval (the user is asked, or staff approve it), it can fail too, "
            "and it is reported by its own receipt: nothing is reversed until request_status "
            "says so. A request is compensated once: asking again, with any cause, answers "
            "with the first compensation. It works on a cancelled request too. A refund cannot "
            "be compensated here. " + write_rules("compensation")
        ),
        annotations=ToolAnnotations(
            readOnlyHint=False, destructiveHint=True, idempotentHint=False, openWorldHint=True
        ),
    )
    async def request_compensation(
        handle: Handle,
        reason: Reason,
        ctx: Context,
        step: Annotated[Step, Resolve(compensation_step)],
        approval: Annotated[ElicitationResult[Any], Resolve(compensation_question)],
        cause: Cause = "customer_request",
        call_id: CallId | None = None,
    ) -> Answer:
        return await conclude(desk, ctx, step, approval)

    status_rules = (
        "waiting for approval, declined, withdrawn (cancelled before a decision), expired, "
        "or done / not done / uncertain with "
        "evidence. Uncertain means pending confirmation. Read-only; safe to call again."
    )

    async def status(handle: str, lang: str, noun: str) -> CallToolResult:
        asked = caller_and_lang(desk, lang)
        if isinstance(asked, CallToolResult):
            return asked
        tenant, language = asked
        return await guarded(
            desk,
            lambda s: answer(
                describe_now(desk, s, desk.proposals.find(s, tenant, handle), language)
            ),
            noun=noun,
        )

    async def cancel(handle: str, lang: str, noun: str) -> CallToolResult:
        asked = caller_and_lang(desk, lang)
        if isinstance(asked, CallToolResult):
            return asked
        tenant, language = asked
        return await guarded(
            desk, lambda s: answer(_cancel(desk, s, tenant, handle, language)), noun=noun
        )

    @server.tool(
        description="The status of a refund request by its handle: " + status_rules,
        annotations=ToolAnnotations(readOnlyHint=True, idempotentHint=True, openWorldHint=False),
    )
    async def refund_status(handle: Handle, lang: Lang = "en") -> Answer:
        return await status(handle, lang, "refund request")

    @server.tool(
        description=(
            "The status of any request by its handle (a refund, an after-sales ticket, a "
            "compensation): " + status_rules
        ),
        annotations=ToolAnnotations(readOnlyHint=True, idempotentHint=True, openWorldHint=False),
    )
    async def request_status(handle: Handle, lang: Lang = "en") -> Answer:
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
    async def cancel_refund(handle: Handle, lang: Lang = "en") -> Answer:
        return await cancel(handle, lang, "refund request")

    @server.tool(
        description="Stop any request by its handle (a refund, a ticket, a compensation): "
        + cancel_rules,
        annotations=cancel_annotations,
    )
    async def cancel_request(handle: Handle, lang: Lang = "en") -> Answer:
        return await cancel(handle, lang, "request")


def _cancel(
    desk: AgentDesk, session: Session, tenant: str, handle: str, lang: str
) -> dict[str, Any]:
    """Withdraw a waiting proposal, or stop the run of an approved one; the status after."""
    proposal = desk.proposals.find(session, tenant, handle)
    if proposal.status == PROPOSED and not desk.proposals.expired(session, proposal):
        desk.proposals.decline(session, tenant, handle, by=WITHDRAWN_BY)
    elif proposal.status == APPROVED:
        report = proposal_report(session, proposal)
        if report is not None:
            cancel_run(session, tenant, report.handle, actor="agent:cancel")
    return describe_now(desk, session, proposal, check_lang(lang))
