"""A scripted "model" and "human" for the MCP tools, driven through the SDK's own client
in-process (``tests/integration/test_mcp_*.py``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import anyio
from mcp import Client
from mcp.server.mcpserver import MCPServer
from mcp_types import ElicitResult
from sqlalchemy import select, update

from outbox.models import Operation, Proposal
from outbox.proposals import Proposals
from outbox.verdict_due import Cadence
from settled.mcp_server import AgentDesk, build_server
from tests.support.rig import Rig

REFUND = {
    "order_id": "A1042",
    "amount_minor": 10000,
    "currency": "CNY",
    "payee": "P-7",
    "reason": "parcel lost",
}


class Human:
    """The person in the client: answers approval prompts from a script, keeps the prompts."""

    def __init__(self, *answers: tuple[str, bool | None]) -> None:
        self.answers = list(answers)
        self.prompts: list[str] = []

    async def __call__(self, context: Any, params: Any) -> ElicitResult:
        self.prompts.append(params.message)
        action, approve = self.answers.pop(0)
        content = {"approve": approve} if action == "accept" else None
        return ElicitResult(action=action, content=content)


def server(
    rig: Rig,
    limits: dict[str, int] | None = None,
    tenant: str = "acme",
    cadence: Cadence | None = None,
) -> MCPServer:
    proposals = Proposals(rig.outbox, timedelta(hours=1))
    desk = AgentDesk(rig.sessions, proposals, limits or {}, tenant=tenant, cadence=cadence)
    return build_server(desk)


Model = Callable[[Client], Awaitable[None]]


#: the protocol revision that carries questions to the human inside a tool call's answer
NEWER = "2026-07-28"


def converse(
    srv: MCPServer, model: Model, human: Human | None = None, mode: str = "legacy"
) -> None:
    """Run the scripted ``model`` against ``srv`` through the SDK's client, in-process:
    ``mode`` "legacy" is the initialize handshake (revisions up to 2025-11-25), ``NEWER`` the
    revision that asks the human through the tool call's answer."""

    async def main() -> None:
        async with Client(srv, mode=mode, elicitation_callback=human) as client:
            await model(client)

    anyio.run(main)


async def call(client: Client, tool: str, **arguments: Any) -> dict[str, Any]:
    """A tool call's structured answer; errors as ``{"error": {...}}`` with is_error set."""
    result = await client.call_tool(tool, arguments)
    data = result.structured_content
    assert isinstance(data, dict)
    assert result.is_error == ("error" in data)
    return data


def operations(rig: Rig) -> list[Operation]:
    with rig.sessions() as s:
        return list(s.scalars(select(Operation).order_by(Operation.id)))


def proposals(rig: Rig) -> list[Proposal]:
    with rig.sessions() as s:
        return list(s.scalars(select(Proposal).order_by(Proposal.id)))


def execute_all(rig: Rig) -> None:
    rig.executor().execute([op.id for op in operations(rig)])


def age_proposal(rig: Rig, handle: str, seconds: float) -> None:
    """Make a proposal ``seconds`` old (no sleeping: the test makes time pass)."""
    with rig.sessions.begin() as s:
        made = s.scalars(select(Proposal.created_at).where(Proposal.handle == handle)).one()
        s.execute(
            update(Proposal)
            .where(Proposal.handle == handle)
            .values(created_at=made - timedelta(seconds=seconds))
        )
