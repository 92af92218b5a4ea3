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
from mcp_types import CallToolResult
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
    return describe(session, proposal, lang, profile, expired=expired)


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
    if exc.code in NOTHING_TO_DO:
        return refusal("business_rejected", exc.message + ". Tell the user; do not retry.")
    if isinstance(exc, InvalidParams) and exc.data.get("errors"):
        first = exc.data["errors"][0]
        field, problem = first["field"], first["error"]
        field = (names or {}).get(field, field)
        return refusal("fixable", f"{field} is not valid ({problem}).", field=field)
    return refusal("fixable", exc.message, field=field)
