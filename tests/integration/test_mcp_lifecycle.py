"""The MCP tools over a proposal's whole life: expiry, after-sales tickets, compensation through
approval, and the lookup-down fault; driven through the SDK's client by a scripted model, against
a real database (PostgreSQL and SQLite) and the simulator, judged by the simulator's ledger and
the rig's ``check_truthful`` at teardown.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from mcp import Client
from sqlalchemy import func, select

from outbox.errors import ProposalConflict
from outbox.models import Run
from outbox.proposals import Proposals
from tests.support.agents import (
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

DAY = timedelta(hours=24).total_seconds()


def runs(rig: Rig) -> int:
    with rig.sessions() as s:
        return int(s.scalar(select(func.count()).select_from(Run)) or 0)


def test_an_expired_proposal_is_refused_at_approval_and_its_status_says_nothing_was_sent(
    rig: Rig,
) -> None:
    handle: list[str] = []

    async def ask(client: Client) -> None:
        got = await call(client, "request_refund", **REFUND)  # no elicitation, no policy
        handle.append(got["error"]["handle"])

    srv = server(rig)
    converse(srv, ask)
    age_proposal(rig, handle[0], DAY + 5)  # past the 24-hour default, not yet marked

    with rig.sessions.begin() as s, pytest.raises(ProposalConflict) as err:
        Proposals(rig.outbox).approve(s, "acme", handle[0], by="staff:mei")
    assert err.value.code == "proposal_expired"
    assert operations(rig) == [] and runs(rig) == 0  # the refused approval wrote nothing
    with rig.sessions() as s:
        assert Proposals(rig.outbox).waiting(s, "acme") == []  # not in the staff's list

    async def look(client: Client) -> None:
        got = await call(client, "refund_status", handle=handle[0])
        assert got["status"] == "expired"
        assert got["text"].endswith("expired without a decision; nothing was sent.")
        zh = await call(client, "refund_status", handle=handle[0], lang="zh")
        assert "已过期" in zh["text"]
        stopped = await call(client, "cancel_refund", handle=handle[0])
        assert stopped["status"] == "expired"  # not "declined": nobody declined it
        # asking again is a new request now (the expired one is not live), and the old one
        # is marked expired on the way
        again = await call(client, "request_refund", **REFUND, call_id="again")
        assert again["error"]["kind"] == "pending" and again["error"]["handle"] != handle[0]

    converse(srv, look)
    assert [(p.status, p.decided_by) for p in proposals(rig)] == [
        ("expired", "expiry"),
        ("proposed", None),
    ]
    execute_all(rig)
    assert rig.control.refunded("acme", "A1042") == 0


def test_a_proposal_just_inside_its_time_to_live_is_approved(rig: Rig) -> None:
    handle: list[str] = []

    async def ask(client: Client) -> None:
        handle.append((await call(client, "request_refund", **REFUND))["error"]["handle"])

    converse(server(rig), ask)
    age_proposal(rig, handle[0], DAY - 60)
    with rig.sessions.begin() as s:
        approved = Proposals(rig.outbox).approve(s, "acme", handle[0], by="staff:mei")
        assert approved.status == "approved"
    execute_all(rig)
    assert rig.control.refunded("acme", "A1042") == 10000


TICKET = {"order_id": "A1042", "problem": "damaged", "reason": "the vase arrived broken"}


def tickets(rig: Rig) -> list[dict[str, Any]]:
    return list(rig.control.ledger()["tickets"])


def test_a_ticket_request_repeated_after_a_timeout_opens_one_ticket(rig: Rig) -> None:
    human = Human(("accept", True), ("decline", None))
    seen: list[dict[str, Any]] = []

    async def model(client: Client) -> None:
        seen.append(await call(client, "request_after_sales_ticket", **TICKET, call_id="c1"))
        # timed out; asks again with a new call id, then with none: the same request
        seen.append(await call(client, "request_after_sales_ticket", **TICKET, call_id="c2"))
        seen.append(await call(client, "request_after_sales_ticket", **TICKET))
        # another problem on the same order is a new request, whose prompt shows the first
        other = {**TICKET, "problem": "wrong_item"}
        seen.append(await call(client, "request_after_sales_ticket", **other))

    converse(server(rig, limits={"acme": 10**9}), model, human)  # no policy for tickets
    first, second, third, other = seen
    assert first["status"] == "approved" and first["decided_by"] == "user:elicitation"
    assert first["kind"] == "after_sales_ticket" and first["problem"] == "damaged"
    assert first["ticket_id"].startswith("tkt_")  # the server's, not the model's
    assert second["handle"] == third["handle"] == first["handle"]
    assert second["repeat"] is True and second["ticket_id"] == first["ticket_id"]
    assert "on order A1042" in human.prompts[0] and "damaged" in human.prompts[0]
    assert "Earlier on this order: an after-sales ticket (damaged) (approved)" in human.prompts[1]
    assert other["error"]["kind"] == "business_rejected"
    (op,) = operations(rig)
    assert (op.kind, op.correlation_id) == ("after_sales_ticket", "c1")
    execute_all(rig)
    assert [t["ticket_id"] for t in tickets(rig)] == [first["ticket_id"]]

    async def check(client: Client) -> None:
        for tool in ("request_status", "refund_status"):  # the old name still answers
            done = await call(client, tool, handle=first["handle"])
            assert done["outcome"] == "done" and done["evidence"]["reference"]

    converse(server(rig), check)


def test_a_ticket_request_waits_for_staff_and_bad_input_names_the_tools_field(rig: Rig) -> None:
    seen: list[dict[str, Any]] = []

    async def model(client: Client) -> None:
        bad = await call(client, "request_after_sales_ticket", **{**TICKET, "problem": "meh"})
        assert bad["error"] == {
            "kind": "fixable",
            "message": "problem is not valid (literal_error).",
            "field": "problem",
        }
        bad = await call(client, "request_after_sales_ticket", **TICKET, op_id="c9")
        assert bad["error"]["field"] == "op_id"
        seen.append(await call(client, "request_after_sales_ticket", **TICKET))
        handle = seen[0]["error"]["handle"]
        waiting = await call(client, "request_status", handle=handle, lang="zh")
        assert waiting["text"].startswith("售后工单申请") and "等待批准" in waiting["text"]
        stopped = await call(client, "cancel_request", handle=handle)
        assert stopped["status"] == "declined"
        assert stopped["text"] == f"Ticket request {handle} was declined; nothing was sent."
        assert (await call(client, "request_status", handle="prp_" + "y" * 32))["error"] == {
            "kind": "fixable",
            "message": "No such request. Check the handle.",
            "field": "handle",
        }

    converse(server(rig, limits={"acme": 10**9}), model)  # a client without elicitation
    assert seen[0]["error"]["kind"] == "pending"
    assert "request_status" in seen[0]["error"]["message"]
    assert [p.status for p in proposals(rig)] == ["declined"]
    assert operations(rig) == [] and tickets(rig) == []
