"""Approval by elicitation on the newer protocol revision (2026-07-28), where the question to
the human travels inside the tool call's answer (``InputRequiredResult``) and the client calls
the tool again with the answer and the sealed ``request_state``. Driven through the SDK's own
client in-process, against a real database (PostgreSQL and SQLite) and the simulator; judged
by the simulator's ledger (and the rig's ``check_truthful`` at teardown).

The request tools run again on every round: the proposal must be made once, the second round
must approve *that* proposal (not answer "repeat"), and no echo of ``request_state`` may
approve anything by itself.
"""

from __future__ import annotations

from typing import Any

import pytest
from mcp import Client
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, ElicitRequest, ElicitResult, InputRequiredResult

from tests.integration.test_mcp_lifecycle import TICKET, ticket_status, tickets
from tests.support.agents import (
    NEWER,
    REFUND,
    Human,
    age_proposal,
    call,
    converse,
    execute_all,
    operations,
    proposals,
    server,
)
from tests.support.rig import Rig

ACCEPT = ElicitResult(action="accept", content={"approve": True})


def test_an_accepted_approval_makes_one_refund_and_a_regenerated_call_is_a_repeat(
    rig: Rig,
) -> None:
    human = Human(("accept", True))
    seen: list[dict[str, Any]] = []

    async def model(client: Client) -> None:
        seen.append(await call(client, "request_refund", **REFUND, call_id="call_1"))
        # the model's client timed out; it regenerates the call after the approval
        seen.append(await call(client, "request_refund", **REFUND, call_id="call_2"))

    converse(server(rig), model, human, mode=NEWER)
    first, again = seen
    assert first["status"] == "approved" and first["decided_by"] == "user:elicitation"
    assert "repeat" not in first  # the second round approved it; it did not answer "repeat"
    assert again["repeat"] is True and again["handle"] == first["handle"]
    (prompt,) = human.prompts  # asked once, over two rounds and a regenerated call
    for shown in (first["handle"], "100.00 CNY", "P-7", "A1042", "parcel lost"):
        assert shown in prompt
    assert [p.status for p in proposals(rig)] == ["approved"]
    (op,) = operations(rig)
    assert op.op_id == first["op_id"] and op.correlation_id == "call_1"
    execute_all(rig)
    assert rig.control.refunded("acme", "A1042") == 10000


def test_declined_and_cancelled_approvals_send_nothing(rig: Rig) -> None:
    human = Human(("decline", None), ("cancel", None), ("accept", False))
    seen: list[dict[str, Any]] = []

    async def model(client: Client) -> None:
        for amount in (1000, 2000, 3000):
            seen.append(await call(client, "request_refund", **{**REFUND, "amount_minor": amount}))

    converse(server(rig), model, human, mode=NEWER)
    kinds = [s["error"]["kind"] for s in seen]
    assert kinds == ["business_rejected", "pending", "business_rejected"]
    assert [p.status for p in proposals(rig)] == ["declined", "proposed", "declined"]
    assert operations(rig) == []


def test_a_client_that_cannot_be_asked_leaves_the_proposal_for_staff(rig: Rig) -> None:
    seen: list[dict[str, Any]] = []

    async def model(client: Client) -> None:
        seen.append(await call(client, "request_refund", **REFUND))

    converse(server(rig), model, mode=NEWER)  # no elicitation callback: no capability
    assert seen[0]["error"]["kind"] == "pending"
    assert [p.status for p in proposals(rig)] == ["proposed"]
    assert operations(rig) == []


async def first_round(client: Client, **arguments: Any) -> tuple[str, str, str]:
    """Call ``request_refund`` without answering: its one question's key, message and the
    sealed state."""
    got = await client.session.call_tool("request_refund", arguments, allow_input_required=True)
    assert isinstance(got, InputRequiredResult)
    assert got.input_requests is not None and got.request_state is not None
    ((key, question),) = got.input_requests.items()
    assert isinstance(question, ElicitRequest)
    return key, question.params.message, got.request_state


async def again(
    client: Client, arguments: dict[str, Any], state: str | None, answers: Any
) -> CallToolResult | InputRequiredResult:
    return await client.session.call_tool(
        "request_refund",
        arguments,
        input_responses=answers,
        request_state=state,
        allow_input_required=True,
    )


def test_a_forged_or_replayed_request_state_approves_nothing(rig: Rig) -> None:
    more = {**REFUND, "amount_minor": 12000}
    results: list[Any] = []

    async def model(client: Client) -> None:
        key, message, state = await first_round(client, **REFUND)
        accept = {key: ACCEPT}
        # the state of the 100.00 question, with an "accept", on a call for 120.00
        with pytest.raises(MCPError) as other:
            await again(client, more, state, accept)
        assert other.value.error.data == {"reason": "invalid_request_state"}
        # a state the client made up, saying the question was asked
        forged = '{"v":3,"outcomes":{},"asked":{}}'
        with pytest.raises(MCPError) as made_up:
            await again(client, REFUND, forged, accept)
        assert made_up.value.error.data == {"reason": "invalid_request_state"}
        # an "accept" with no state: a fresh call, answered as the repeat it is
        results.append(await again(client, REFUND, None, accept))
        # a state with no answer: asked again, nothing decided
        results.append(await again(client, REFUND, state, None))
        # the real second round approves; replaying it approves nothing more
        results.append(await again(client, REFUND, state, accept))
        results.append(await again(client, REFUND, state, accept))
        assert "100.00 CNY" in message

    converse(server(rig), model, Human(), mode=NEWER)  # a client that can be asked
    fresh, unanswered, approved, replayed = results
    assert isinstance(fresh, CallToolResult) and isinstance(fresh.structured_content, dict)
    assert fresh.structured_content["repeat"] is True
    assert fresh.structured_content["status"] == "waiting_for_approval"
    assert isinstance(unanswered, InputRequiredResult)
    assert isinstance(approved, CallToolResult) and isinstance(replayed, CallToolResult)
    assert isinstance(approved.structured_content, dict)
    assert isinstance(replayed.structured_content, dict)
    assert approved.structured_content["status"] == "approved"
    assert replayed.structured_content["repeat"] is True
    assert replayed.structured_content["op_id"] == approved.structured_content["op_id"]
    assert [p.params["amount_minor"] for p in proposals(rig)] == [10000]
    assert len(operations(rig)) == 1
    execute_all(rig)
    assert rig.control.refunded("acme", "A1042") == 10000


def test_an_answer_about_an_expired_proposal_does_not_approve_its_successor(rig: Rig) -> None:
    handles: list[str] = []
    results: list[Any] = []

    async def ask(client: Client) -> None:
        key, message, state = await first_round(client, **REFUND)
        (handle,) = [p.handle for p in proposals(rig)]
        assert handle in message
        handles.append(handle)
        # the human answers a day later: the proposal expired (its time to live is 24 h)
        age_proposal(rig, handle, 25 * 3600)
        results.append(await again(client, REFUND, state, {key: ACCEPT}))

    converse(server(rig), ask, Human(), mode=NEWER)
    (asked,) = results
    # a new proposal for the same refund, put to the human as a new question
    assert isinstance(asked, InputRequiredResult) and asked.input_requests is not None
    ((_, question),) = asked.input_requests.items()
    assert isinstance(question, ElicitRequest)
    first, successor = proposals(rig)
    assert first.handle == handles[0] and first.status == "expired"
    assert successor.status == "proposed" and successor.handle in question.params.message
    assert handles[0] not in question.params.message
    assert operations(rig) == []


def test_a_ticket_and_its_compensation_are_approved_by_the_human(rig: Rig) -> None:
    human = Human(("accept", True), ("accept", True))
    seen: list[dict[str, Any]] = []

    async def open_ticket(client: Client) -> None:
        seen.append(await call(client, "request_after_sales_ticket", **TICKET))

    srv = server(rig)
    converse(srv, open_ticket, human, mode=NEWER)
    execute_all(rig)

    async def undo(client: Client) -> None:
        why = "the customer changed their mind"
        handle = seen[0]["handle"]
        seen.append(await call(client, "request_compensation", handle=handle, reason=why))

    converse(srv, undo, human, mode=NEWER)
    ticket, compensation = seen
    assert ticket["status"] == "approved" and compensation["status"] == "approved"
    assert compensation["kind"] == "ticket_cancel"
    assert ticket["handle"] in human.prompts[0] and compensation["handle"] in human.prompts[1]
    assert f"cancelling ticket {ticket['ticket_id']}" in human.prompts[1]
    assert ticket_status(rig, ticket["ticket_id"]) == "open"  # nothing reversed yet
    execute_all(rig)
    assert ticket_status(rig, ticket["ticket_id"]) != "open"
    assert len(tickets(rig)) == 1


def test_a_request_made_while_another_waits_does_not_change_that_ones_question(
    rig: Rig,
) -> None:
    human = Human(("accept", True))
    results: list[Any] = []

    async def model(client: Client) -> None:
        key, _, state = await first_round(client, **REFUND)
        # while the first question is open, the model asks for another amount on the order;
        # that one's prompt shows the first, and the human approves it
        results.append(await call(client, "request_refund", **{**REFUND, "amount_minor": 500}))
        results.append(await again(client, REFUND, state, {key: ACCEPT}))

    converse(server(rig), model, human, mode=NEWER)
    other, first = results
    assert other["status"] == "approved"
    assert "Earlier on this order: 100.00 CNY to P-7 (proposed)" in human.prompts[0]
    # the first question was answered as asked, not asked again with the newer one in it
    assert isinstance(first, CallToolResult) and isinstance(first.structured_content, dict)
    assert first.structured_content["status"] == "approved"
    assert [p.status for p in proposals(rig)] == ["approved", "approved"]
    execute_all(rig)
    assert rig.control.refunded("acme", "A1042") == 10500
