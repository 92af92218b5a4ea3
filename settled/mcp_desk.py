"""What the MCP tools (``settled.mcp_server``) work with: the desk (the database, the
proposals service, the policy), the server that holds it, the HTTP transport's bearer-token
check, and the core's errors as the model's error kinds."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.provider import AccessToken
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import CallToolResult, InputRequiredResult
from pydantic import ValidationError
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
from outbox.models import Proposal
from outbox.proposals import Proposals
from outbox.report_text import Lang, check_lang
from outbox.verdict_due import Cadence
from settled.mcp_answers import describe, refusal

T = TypeVar("T")

#: bad input no other value of a field fixes: explained to the user, not corrected
NOTHING_TO_DO = frozenset(
    {"not_compensable", "nothing_to_compensate", "run_cancelled", "already_compensated"}
)


@dataclass(frozen=True)
class AgentDesk:
    """What the tools work with: the database, the proposals service, the policy."""

    sessions: sessionmaker[Session]
    proposals: Proposals
    #: per tenant, the largest amount (minor units) its policy approves by itself
    auto_approve_minor: Mapping[str, int]
    #: the one tenant a stdio server speaks for (None: the HTTP transport's API key says)
    tenant: str | None = None
    #: the reconciler's numbers: an uncertain answer says when it is decided at the latest
    cadence: Cadence | None = None

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

    async def call_tool(
        self, name: str, arguments: dict[str, Any], context: Context[Any, Any] | None = None
    ) -> CallToolResult | InputRequiredResult:
        """The tool's answer; arguments it does not take, or that its schema refuses, as the
        documented ``fixable`` error naming the field (never the SDK's text, never a value),
        before anything runs."""
        tool = self._tool_manager.get_tool(name)
        if tool is not None:
            unknown = sorted(set(arguments) - set(tool.parameters.get("properties", {})))
            if unknown:
                return unknown_argument(unknown[0])
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as exc:
            if isinstance(exc.__cause__, ValidationError):
                return argument_errors(exc.__cause__)
            raise


def unknown_argument(field: str) -> CallToolResult:
    """An argument the tool does not take (as the core refuses an unknown field)."""
    if field == "op_id":
        return refusal(
            "fixable",
            "Do not send an op_id: the server mints one when the request is approved. Call "
            "again without it.",
            field="op_id",
        )
    return refusal("fixable", f"{field} is not an argument of this tool. Call again without it.",
                   field=field)  # fmt: skip


def argument_errors(exc: ValidationError) -> CallToolResult:
    """The SDK's argument check failed: the first field and what is wrong with it, as
    ``invalid`` words a core refusal (the rule, never the value), and every field's."""
    details = exc.errors(include_input=False, include_url=False, include_context=False)
    errors = [
        {"field": ".".join(str(p) for p in e["loc"]) or "arguments", "error": e["type"]}
        for e in details
    ]
    field, problem = errors[0]["field"], errors[0]["error"]
    if problem == "missing":
        message = f"{field} is required. Call again with it."
    else:  # pydantic's words state the rule ("Input should be a valid integer"), not the value
        rule = details[0]["msg"].removeprefix("Value error, ")
        message = f"{field} is not valid ({problem}): {rule}. Fix it and call again."
    return refusal("fixable", message, field=field, errors=errors)


def desk_of(ctx: Context) -> AgentDesk:
    server = ctx.mcp_server
    assert isinstance(server, AgentServer)
    return server.desk


def caller_and_lang(desk: AgentDesk, lang: str) -> tuple[str, Lang] | CallToolResult:
    """The caller's tenant and the answer's language, or the refusal to give instead."""
    tenant = desk.caller()
    if tenant is None:
        return refusal("permission", "This connection has no tenant. Stop; do not retry.")
    try:
        return tenant, check_lang(lang)
    except InvalidInput:
        return refusal("fixable", "lang must be 'en' or 'zh'.", field="lang")


def describe_now(
    desk: AgentDesk, session: Session, proposal: Proposal, lang: Lang
) -> dict[str, Any]:
    """``describe`` with the proposal's expiry judged by the database's clock now."""
    profile = desk.profile(proposal.kind)
    expired = desk.proposals.expired(session, proposal)
    return describe(session, proposal, lang, profile, expired=expired, cadence=desk.cadence)


async def guarded(
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
        return invalid(exc)


def invalid(exc: InvalidInput, names: Mapping[str, str] | None = None) -> CallToolResult:
    """Bad input as a fixable error naming the tool's field (never echoing the value);
    ``names``: the intent's field names as the tool calls them."""
    field = exc.data.get("field")
    if isinstance(field, str) and names and field in names:  # the tool's name, not the core's
        message = exc.message.replace(field, names[field], 1)
        return refusal("fixable", message, field=names[field])
    if exc.code in NOTHING_TO_DO:
        return refusal("business_rejected", exc.message + ". Tell the user; do not retry.")
    if isinstance(exc, InvalidParams) and exc.data.get("errors"):
        first = exc.data["errors"][0]
        field, problem = first["field"], first["error"]
        field = (names or {}).get(field, field)
        return refusal("fixable", f"{field} is not valid ({problem}).", field=field)
    return refusal("fixable", exc.message, field=field)
