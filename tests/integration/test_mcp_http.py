"""The MCP server over its streamable-HTTP transport: a tenant's API key is the bearer token;
no key, no tools; another tenant's handle answers exactly as a made-up one."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import anyio
import httpx
import pytest
import uvicorn
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import ElicitResult, InputRequiredResult

from outbox.apikeys import create_api_key
from outbox.proposals import Proposals
from settled.mcp_http import BEARER_HINT, http_app
from settled.mcp_server import AgentDesk, build_server
from tests.support.agents import NEWER, REFUND, Human, call, execute_all, operations, proposals
from tests.support.rig import Rig
from tests.support.services import wait_until


@pytest.fixture
def mcp_url(rig: Rig) -> Iterator[str]:
    """The rig's MCP server over HTTP on a free port, stopped at teardown."""
    desk = AgentDesk(rig.sessions, Proposals(rig.outbox, timedelta(hours=1)), {"acme": 50000})
    config = uvicorn.Config(
        http_app(build_server(desk, http_url="http://127.0.0.1"), host="127.0.0.1"),
        host="127.0.0.1",
        port=0,
        log_level="warning",
        lifespan="on",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started, 10), "the MCP server did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}/mcp"
    server.should_exit = True
    thread.join(timeout=10)


def key_of(rig: Rig, tenant: str) -> str:
    with rig.sessions.begin() as s:
        return create_api_key(s, tenant=tenant)[1]


def over_http(
    url: str, key: str | None, script: Any, mode: str = "legacy", human: Human | None = None
) -> None:
    async def main() -> None:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        async with create_mcp_http_client(headers=headers) as http:
            transport = streamable_http_client(url, http_client=http)
            async with Client(transport, mode=mode, elicitation_callback=human) as client:
                await script(client)

    anyio.run(main)


def test_an_api_key_speaks_for_its_tenant_and_no_other(rig: Rig, mcp_url: str) -> None:
    acme, other = key_of(rig, "acme"), key_of(rig, "other")
    handle: list[str] = []

    async def ask(client: Client) -> None:
        got = await call(client, "request_refund", **REFUND, call_id="http_1")
        assert got["status"] == "approved" and got["decided_by"] == "policy:auto_approve"
        handle.append(got["handle"])
        again = await call(client, "request_refund", **REFUND, call_id="http_2")
        assert again["repeat"] is True and again["handle"] == handle[0]

    over_http(mcp_url, acme, ask)
    answers: list[dict[str, Any]] = []

    async def peek(client: Client) -> None:
        for h in (handle[0], "prp_" + "y" * 32):
            answers.append(await call(client, "refund_status", handle=h))
            answers.append(await call(client, "cancel_refund", handle=h))

    over_http(mcp_url, other, peek)
    assert all(a == answers[0] for a in answers)
    assert answers[0]["error"]["kind"] == "fixable" and answers[0]["error"]["field"] == "handle"
    execute_all(rig)
    (op,) = operations(rig)
    assert op.state == "succeeded"
    assert rig.control.refunded("acme", "A1042") == 10000


def test_on_the_newer_revision_the_human_approves_over_http(rig: Rig, mcp_url: str) -> None:
    acme = key_of(rig, "acme")
    human = Human(("accept", True), ("decline", None))
    seen: list[dict[str, Any]] = []
    above_policy = {**REFUND, "amount_minor": 60000}  # the rig's policy approves up to 50000

    async def ask(client: Client) -> None:
        seen.append(await call(client, "request_refund", **above_policy, call_id="h1"))
        seen.append(await call(client, "request_refund", **above_policy, call_id="h2"))
        seen.append(await call(client, "request_refund", **{**above_policy, "amount_minor": 7}))

    over_http(mcp_url, acme, ask, mode=NEWER, human=human)
    approved, repeat, declined = seen
    assert approved["status"] == "approved" and approved["decided_by"] == "user:elicitation"
    assert repeat["repeat"] is True and repeat["handle"] == approved["handle"]
    assert declined["error"]["kind"] == "business_rejected"
    assert approved["handle"] in human.prompts[0] and "600.00 CNY" in human.prompts[0]
    assert len(human.prompts) == 2
    execute_all(rig)
    (op,) = operations(rig)
    assert op.state == "succeeded"
    assert rig.control.refunded("acme", "A1042") == 60000


def test_a_request_state_minted_for_one_tenant_is_refused_for_another(
    rig: Rig, mcp_url: str
) -> None:
    acme, other = key_of(rig, "acme"), key_of(rig, "other")
    above_policy = {**REFUND, "amount_minor": 60000}
    asked: list[tuple[str, str]] = []

    async def ask(client: Client) -> None:
        got = await client.session.call_tool(
            "request_refund", above_policy, allow_input_required=True
        )
        assert isinstance(got, InputRequiredResult)
        assert got.input_requests is not None and got.request_state is not None
        asked.append((next(iter(got.input_requests)), got.request_state))

    async def answer_for_acme(client: Client) -> None:
        key, state = asked[0]
        accept = {key: ElicitResult(action="accept", content={"approve": True})}
        with pytest.raises(MCPError) as refused:
            await client.session.call_tool(
                "request_refund",
                above_policy,
                input_responses=accept,
                request_state=state,
                allow_input_required=True,
            )
        assert refused.value.error.data == {"reason": "invalid_request_state"}

    over_http(mcp_url, acme, ask, mode=NEWER, human=Human())
    over_http(mcp_url, other, answer_for_acme, mode=NEWER, human=Human())
    assert [(p.tenant, p.status) for p in proposals(rig)] == [("acme", "proposed")]
    assert operations(rig) == []


def test_no_key_or_a_wrong_key_gets_no_tools(rig: Rig, mcp_url: str) -> None:
    listing = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    headers = {"Accept": "application/json, text/event-stream"}
    for key in (None, "stk_0123456789abcdef_" + "A" * 43, "call_1"):
        auth = {"Authorization": f"Bearer {key}"} if key is not None else {}
        got = httpx.post(mcp_url, json=listing, headers={**headers, **auth}, timeout=10)
        assert got.status_code == 401
        assert "tools" not in got.text
    rig.judged_by_ledger = False


def test_a_401_says_how_to_authenticate_and_advertises_no_authorization_server(
    rig: Rig, mcp_url: str
) -> None:
    """No OAuth flow exists: the 401 names no protected-resource metadata (whose
    authorization server would answer 404) and says to send an API key; no metadata is
    served."""
    listing = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    got = httpx.post(
        mcp_url, json=listing, headers={"Accept": "application/json, text/event-stream"},
        timeout=10,
    )  # fmt: skip
    assert got.status_code == 401
    www = got.headers["www-authenticate"]
    assert www.startswith("Bearer ") and "resource_metadata" not in www
    assert "settled apikey create" in www and "Authorization: Bearer" in www
    assert got.json() == {"error": "invalid_token", "error_description": BEARER_HINT}
    assert int(got.headers["content-length"]) == len(got.content)
    base = mcp_url.removesuffix("/mcp")
    for path in (
        "/.well-known/oauth-protected-resource",
        "/.well-known/oauth-protected-resource/mcp",
    ):
        assert httpx.get(base + path, timeout=10).status_code == 404
    rig.judged_by_ledger = False
