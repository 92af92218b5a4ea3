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
from mcp_types import ElicitResult
from sqlalchemy import func, select

from outbox.errors import InvalidInput, ProposalConflict
from outbox.ids import new_op_id
from outbox.models import Operation, Run
from outbox.proposals import Proposals
from outbox.runs import compensate
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
from tests.support.rig import HOLD, Rig

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
            "message": "problem is not valid (literal_error): Input should be 'damaged', "
            "'wrong_item', 'not_as_described' or 'other'. Fix it and call again.",
            "field": "problem",
            "errors": [{"field": "problem", "error": "literal_error"}],
        }
        bad = await call(client, "request_after_sales_ticket", **TICKET, op_id="c9")
        assert bad["error"]["field"] == "op_id"
        seen.append(await call(client, "request_after_sales_ticket", **TICKET))
        handle = seen[0]["error"]["handle"]
        waiting = await call(client, "request_status", handle=handle, lang="zh")
        assert waiting["text"].startswith("售后工单申请") and "等待批准" in waiting["text"]
        stopped = await call(client, "cancel_request", handle=handle)
        # withdrawn, not "declined": nobody said no
        assert stopped["status"] == "withdrawn" and "withdrawn" in stopped["text"]
        assert stopped["text"] == (
            f"Ticket request {handle} was withdrawn before anyone decided; nothing was sent."
        )
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


def ticket_done(rig: Rig) -> dict[str, Any]:
    """An approved after-sales ticket, opened downstream; the tool's answer."""
    seen: list[dict[str, Any]] = []

    async def model(client: Client) -> None:
        seen.append(await call(client, "request_after_sales_ticket", **TICKET))

    converse(server(rig), model, Human(("accept", True)))
    execute_all(rig)
    return seen[0]


def ticket_status(rig: Rig, ticket_id: str) -> str:
    (ticket,) = [t for t in tickets(rig) if t["ticket_id"] == ticket_id]
    return str(ticket["status"])


def test_a_compensation_is_an_approved_operation_that_restores_only_with_its_receipt(
    rig: Rig,
) -> None:
    ticket = ticket_done(rig)
    human = Human(("accept", True))
    seen: list[dict[str, Any]] = []
    why = "the customer changed their mind"

    async def model(client: Client) -> None:
        undo = await call(client, "request_compensation", handle=ticket["handle"], reason=why)
        seen.append(undo)
        again = await call(
            client, "request_compensation", handle=ticket["handle"], reason=why, call_id="c2"
        )
        assert again["repeat"] is True and again["handle"] == undo["handle"]
        before = await call(client, "request_status", handle=ticket["handle"])
        assert before["outcome"] == "done"
        assert f"Compensation {undo['op_id']} has not been sent yet." in before["text"]
        assert "restored" not in before["text"].lower()

    converse(server(rig), model, human)
    (undo,) = seen
    assert len(human.prompts) == 1
    assert (
        f"Approve cancelling ticket {ticket['ticket_id']} (customer_request)?" in (human.prompts[0])
    )
    assert undo["status"] == "approved" and undo["kind"] == "ticket_cancel"
    assert undo["op_id"] != ticket["op_id"] and undo["order_id"] == "A1042"
    original, compensation = operations(rig)
    # linked to the original, in a run of its own: stopping either never stops the other
    assert compensation.compensates_id == original.id and compensation.run_id != original.run_id
    assert ticket_status(rig, ticket["ticket_id"]) == "open"  # nothing reversed yet
    execute_all(rig)
    assert ticket_status(rig, ticket["ticket_id"]) != "open"

    async def check(client: Client) -> None:
        own = await call(client, "request_status", handle=undo["handle"])
        receipt = own["evidence"]["reference"]
        assert own["outcome"] == "done" and receipt.startswith("tcx_")
        after = await call(client, "request_status", handle=ticket["handle"])
        assert f"Restored by compensation {undo['op_id']} (receipt {receipt})." in after["text"]

    converse(server(rig), check)


def cancellations(rig: Rig, ticket_id: str) -> int:
    """How many ticket cancellations the downstream did for ``ticket_id`` (its ledger)."""
    effects = rig.control.ledger()["effects"]
    return sum(
        1 for e in effects if e["kind"] == "ticket_cancel" and e["params"]["ticket_id"] == ticket_id
    )


def test_a_second_compensation_with_another_cause_is_the_same_request(rig: Rig) -> None:
    ticket = ticket_done(rig)
    human = Human(("accept", True), ("accept", True))
    seen: list[dict[str, Any]] = []

    async def model(client: Client) -> None:
        for cause in ("customer_request", "duplicate", "pickup_failed"):
            got = await call(
                client, "request_compensation", handle=ticket["handle"], reason="x", cause=cause
            )
            seen.append(got)

    converse(server(rig), model, human)
    first, second, third = seen
    assert first["status"] == "approved" and len(human.prompts) == 1  # asked once only
    assert second["repeat"] is True and second["handle"] == first["handle"]
    assert third["repeat"] is True and third["handle"] == first["handle"]
    assert [o.kind for o in operations(rig)] == ["after_sales_ticket", "ticket_cancel"]
    assert [p.kind for p in proposals(rig)] == ["after_sales_ticket", "ticket_cancel"]
    execute_all(rig)
    assert cancellations(rig, ticket["ticket_id"]) == 1


def test_a_compensation_whose_operation_was_cancelled_may_be_asked_again(rig: Rig) -> None:
    ticket = ticket_done(rig)
    seen: list[dict[str, Any]] = []

    async def model(client: Client) -> None:
        undo = await call(client, "request_compensation", handle=ticket["handle"], reason="x")
        stopped = await call(client, "cancel_request", handle=undo["handle"])
        assert stopped["state"] == "cancelled"
        seen.append(await call(client, "request_compensation", handle=ticket["handle"], reason="y"))
        seen.append(undo)

    converse(server(rig), model, Human(("accept", True), ("accept", True)))
    again, undo = seen
    assert again["status"] == "approved" and again["handle"] != undo["handle"]
    original, cancelled, compensation = operations(rig)
    assert cancelled.state == "cancelled" and compensation.compensates_id == original.id
    with rig.sessions() as s:  # stopping the compensation never stopped the original's run
        assert s.get(Run, original.run_id).cancel_requested_at is None  # type: ignore[union-attr]
    execute_all(rig)
    assert cancellations(rig, ticket["ticket_id"]) == 1
    assert ticket_status(rig, ticket["ticket_id"]) != "open"


def test_approval_is_refused_when_the_original_already_has_a_compensation(rig: Rig) -> None:
    ticket = ticket_done(rig)
    waiting: list[str] = []

    async def ask(client: Client) -> None:  # no elicitation: it waits for staff
        got = await call(client, "request_compensation", handle=ticket["handle"], reason="x")
        waiting.append(got["error"]["handle"])

    converse(server(rig), ask)
    with rig.sessions.begin() as s:  # meanwhile the app compensates it directly
        original = s.scalars(select(Operation).where(Operation.op_id == ticket["op_id"])).one()
        compensate(
            rig.outbox,
            s,
            original,
            op_id=new_op_id(),
            kind="ticket_cancel",
            params={"ticket_id": ticket["ticket_id"], "reason": "duplicate"},
        )
    before = (len(operations(rig)), runs(rig))
    with rig.sessions.begin() as s, pytest.raises(InvalidInput) as err:
        Proposals(rig.outbox).approve(s, "acme", waiting[0], by="staff:mei")
    assert err.value.code == "already_compensated"
    assert (len(operations(rig)), runs(rig)) == before  # the refused approval wrote nothing
    assert proposals(rig)[-1].status == "proposed"
    execute_all(rig)
    assert cancellations(rig, ticket["ticket_id"]) == 1


def test_cancel_then_compensate_cancels_the_ticket_once(rig: Rig) -> None:
    ticket = ticket_done(rig)
    seen: list[dict[str, Any]] = []

    async def model(client: Client) -> None:
        stopped = await call(client, "cancel_request", handle=ticket["handle"])
        assert stopped["stopped"] is True and stopped["outcome"] == "done"
        seen.append(await call(client, "request_compensation", handle=ticket["handle"], reason="a"))

    human = Human(("accept", True))
    converse(server(rig), model, human)
    (undo,) = seen
    assert undo["status"] == "approved" and undo["stopped"] is False
    assert len(human.prompts) == 1
    execute_all(rig)
    assert cancellations(rig, ticket["ticket_id"]) == 1
    assert ticket_status(rig, ticket["ticket_id"]) != "open"

    async def check(client: Client) -> None:
        own = await call(client, "request_status", handle=undo["handle"])
        assert own["outcome"] == "done" and own["state"] == "succeeded"
        after = await call(client, "request_status", handle=ticket["handle"])
        receipt = own["evidence"]["reference"]
        assert f"Restored by compensation {undo['op_id']} (receipt {receipt})." in after["text"]

    converse(server(rig), check)


@pytest.mark.parametrize("meanwhile", ["staff_approved", "expired"])
def test_a_decline_after_the_proposal_was_decided_says_how_it_stands(
    rig: Rig, meanwhile: str
) -> None:
    out: list[dict[str, Any]] = []

    async def human(context: Any, params: Any) -> ElicitResult:
        (p,) = proposals(rig)
        if meanwhile == "staff_approved":
            with rig.sessions.begin() as s:
                Proposals(rig.outbox).approve(s, "acme", p.handle, by="staff:mei")
        else:
            age_proposal(rig, p.handle, DAY + 5)
        return ElicitResult(action="decline")

    async def model(client: Client) -> None:
        out.append(await call(client, "request_refund", **REFUND))

    converse(server(rig), model, human)
    (got,) = out
    if meanwhile == "staff_approved":
        assert got["status"] == "approved" and got["decided_by"] == "staff:mei"
        assert "already approved" in got["note"]
    else:
        assert got["status"] == "expired" and "nothing was sent" in got["text"]
    assert [p.status for p in proposals(rig)] == [
        "approved" if meanwhile == "staff_approved" else "proposed"  # expired, not yet marked
    ]
    execute_all(rig)
    expected = 10000 if meanwhile == "staff_approved" else 0
    assert rig.control.refunded("acme", "A1042") == expected


def test_a_failed_compensation_says_nothing_was_reversed(rig: Rig) -> None:
    ticket = ticket_done(rig)
    seen: list[dict[str, Any]] = []

    async def model(client: Client) -> None:
        bad = await call(
            client, "request_compensation", handle=ticket["handle"], reason="x", cause="meh"
        )
        assert bad["error"]["kind"] == "fixable" and bad["error"]["field"] == "cause"
        seen.append(
            await call(
                client,
                "request_compensation",
                handle=ticket["handle"],
                reason="duplicate of T-0",
                cause="duplicate",
            )
        )

    converse(server(rig), model, Human(("accept", True)))
    rig.control.add_rule("business_reject", kind="ticket_cancel", code="ticket_locked")
    execute_all(rig)
    assert ticket_status(rig, ticket["ticket_id"]) == "open"

    async def check(client: Client) -> None:
        own = await call(client, "request_status", handle=seen[0]["handle"])
        assert own["outcome"] == "not_done" and own["evidence"]["code"] == "ticket_locked"
        after = await call(client, "request_status", handle=ticket["handle"])
        assert (
            f"Compensation {seen[0]['op_id']} was not done, so nothing has been reversed."
            in (after["text"])
        )
        assert "restored" not in after["text"].lower()

    converse(server(rig), check)


def test_what_cannot_be_compensated_is_refused_and_writes_nothing(rig: Rig) -> None:
    refund: list[str] = []
    waiting: list[str] = []

    async def ask(client: Client) -> None:
        refund.append((await call(client, "request_refund", **REFUND))["handle"])
        got = await call(client, "request_after_sales_ticket", **TICKET)
        waiting.append(got["error"]["handle"])  # no elicitation: waits for staff

    converse(server(rig, limits={"acme": 50000}), ask)
    before = (len(proposals(rig)), len(operations(rig)))

    async def model(client: Client) -> None:
        got = await call(client, "request_compensation", handle=refund[0], reason="oops")
        assert got["error"]["kind"] == "business_rejected"
        assert got["error"]["message"].startswith("a refund cannot be compensated")
        got = await call(client, "request_compensation", handle=waiting[0], reason="oops")
        assert got["error"]["kind"] == "business_rejected"
        assert "nothing to compensate" in got["error"]["message"]
        got = await call(client, "request_compensation", handle="prp_" + "z" * 32, reason="x")
        assert got["error"]["field"] == "handle" and got["error"]["kind"] == "fixable"
        got = await call(
            client, "request_compensation", handle=waiting[0], reason="x", op_id="call_1"
        )
        assert got["error"]["field"] == "op_id"

    converse(server(rig), model, Human())
    assert (len(proposals(rig)), len(operations(rig))) == before
    execute_all(rig)


def test_while_the_lookup_is_down_the_model_hears_pending_confirmation_then_the_truth(
    rig: Rig,
) -> None:
    handle: list[str] = []

    async def ask(client: Client) -> None:
        handle.append((await call(client, "request_refund", **REFUND, call_id="c1"))["handle"])

    srv = server(rig, limits={"acme": 50000})
    converse(srv, ask)
    rig.control.add_rule("commit_then_timeout", times=1, hold_seconds=HOLD)
    execute_all(rig)  # the downstream refunded; the answer was lost
    (op,) = operations(rig)
    assert op.state == "unknown"
    rig.control.add_rule("lookup_unavailable")
    assert rig.reconciler().run_once().outcomes == {"lookup_unavailable": 1}
    assert rig.control.refunded("acme", "A1042") == 10000  # done, but nobody can tell yet

    async def misbehave(client: Client) -> None:
        for i in range(4):  # spams the status, and asks again "because it timed out"
            got = await call(client, "refund_status", handle=handle[0])
            assert (got["outcome"], got["state"]) == ("uncertain", "unknown")
            assert "pending confirmation" in got["text"]
            again = await call(client, "request_refund", **REFUND, call_id=f"retry-{i}")
            assert again["repeat"] is True and again["outcome"] == "uncertain"
        stopped = await call(client, "cancel_refund", handle=handle[0])
        assert stopped["stopped"] is True and stopped["outcome"] == "uncertain"
        assert "pending confirmation" in stopped["text"]
        assert "cancelled" not in stopped["text"]

    converse(srv, misbehave)
    execute_all(rig)  # an unknown operation is never sent again
    assert len(operations(rig)) == 1 and rig.sends(op.id) == 1
    rig.control.clear_rules()  # the lookup is back
    rig.make_due(op.id)
    assert rig.reconciler().run_once().outcomes == {"found": 1}

    async def truth(client: Client) -> None:
        got = await call(client, "refund_status", handle=handle[0])
        assert (got["outcome"], got["state"]) == ("done", "succeeded")
        assert got["evidence"]["reference"] and got["evidence"]["reference"] in got["text"]
        assert "pending confirmation" not in got["text"]

    converse(srv, truth)
    assert rig.control.refunded("acme", "A1042") == 10000


def test_the_new_tools_annotations_are_truthful(rig: Rig) -> None:
    async def model(client: Client) -> None:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        for name in ("request_after_sales_ticket", "request_compensation"):
            hints = tools[name].annotations
            assert hints is not None
            assert hints.read_only_hint is False and hints.idempotent_hint is False
            assert "retry" in (tools[name].description or "")
            assert "op_id" not in tools[name].input_schema["required"]
        assert "ticket_id" not in tools["request_after_sales_ticket"].input_schema["properties"]
        status = tools["request_status"].annotations
        assert status is not None and status.read_only_hint is True
        cancel = tools["cancel_request"].annotations
        assert cancel is not None and cancel.read_only_hint is False
        assert "own receipt" in (tools["request_compensation"].description or "")

    converse(server(rig), model)
    rig.judged_by_ledger = False
