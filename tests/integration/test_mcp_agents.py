"""The MCP server for AI agents, driven through the SDK's own client in-process by a scripted
model that misbehaves, against a real database (PostgreSQL and SQLite) and the simulator.

Judged by the simulator's ledger: what was refunded on the order equals what was approved,
exactly (and the rig's ``check_truthful`` at teardown).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

from mcp import Client
from mcp.server.mcpserver import MCPServer

from outbox.proposals import Proposals
from outbox.storage.operations import db_time
from outbox.verdict_due import Cadence
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
from tests.support.rig import GOOD, HOLD, Rig


def test_a_regenerated_request_after_a_timeout_is_answered_with_the_first(rig: Rig) -> None:
    human = Human(("accept", True))
    seen: list[dict[str, Any]] = []

    async def model(client: Client) -> None:
        seen.append(await call(client, "request_refund", **REFUND, call_id="call_1"))
        # the model's client timed out; it asks again with a new call id, then again
        seen.append(await call(client, "request_refund", **REFUND, call_id="call_2"))
        seen.append(await call(client, "request_refund", **REFUND))

    converse(server(rig), model, human)
    first, second, third = seen
    assert first["status"] == "approved" and first["outcome"] == "not_done"
    assert second["handle"] == third["handle"] == first["handle"]
    assert second["repeat"] is True and third["repeat"] is True
    assert len(human.prompts) == 1  # asked once, not three times
    (op,) = operations(rig)
    assert op.op_id == first["op_id"] and op.op_id.startswith("op_")
    assert op.correlation_id == "call_1"  # the call id is correlation only
    execute_all(rig)
    assert rig.control.refunded("acme", "A1042") == 10000


def test_the_prompt_shows_amount_currency_payee_and_order(rig: Rig) -> None:
    human = Human(("accept", True))

    async def model(client: Client) -> None:
        await call(client, "request_refund", **REFUND)

    converse(server(rig), model, human)
    (prompt,) = human.prompts
    for shown in ("100.00 CNY", "P-7", "A1042", "parcel lost"):
        assert shown in prompt


def test_a_call_id_passed_as_op_id_is_refused_and_nothing_is_written(rig: Rig) -> None:
    async def model(client: Client) -> None:
        got = await call(client, "request_refund", **REFUND, call_id="call_9", op_id="call_9")
        assert got["error"]["kind"] == "fixable" and got["error"]["field"] == "op_id"

    converse(server(rig), model, Human())
    assert proposals(rig) == [] and operations(rig) == []


def test_a_changed_amount_on_retry_is_a_new_proposal_whose_prompt_shows_the_first(
    rig: Rig,
) -> None:
    human = Human(("accept", True), ("decline", None))
    seen: list[dict[str, Any]] = []

    async def model(client: Client) -> None:
        seen.append(await call(client, "request_refund", **REFUND, call_id="c1"))
        seen.append(
            await call(client, "request_refund", **{**REFUND, "amount_minor": 12000}, call_id="c2")
        )

    converse(server(rig), model, human)
    assert seen[0]["status"] == "approved"
    assert seen[1]["error"]["kind"] == "business_rejected"
    assert "Earlier on this order: 100.00 CNY to P-7 (approved)" in human.prompts[1]
    assert [p.status for p in proposals(rig)] == ["approved", "declined"]
    execute_all(rig)
    assert rig.control.refunded("acme", "A1042") == 10000


def test_a_second_partial_refund_is_its_own_approved_operation(rig: Rig) -> None:
    human = Human(("accept", True), ("accept", True))

    async def model(client: Client) -> None:
        await call(client, "request_refund", **{**REFUND, "amount_minor": 3000})
        await call(client, "request_refund", **{**REFUND, "amount_minor": 2000})

    # the policy would approve either amount alone; the second on the same order needs a person
    converse(server(rig, limits={"acme": 5000}), model, human)
    assert len(human.prompts) == 1 and "30.00 CNY" in human.prompts[0]
    assert [p.decided_by for p in proposals(rig)] == ["policy:auto_approve", "user:elicitation"]
    assert len({op.op_id for op in operations(rig)}) == 2
    execute_all(rig)
    assert rig.control.refunded("acme", "A1042") == 5000


def test_the_policy_never_approves_a_second_refund_on_an_order_however_old_the_first(
    rig: Rig,
) -> None:
    """The repeat window (an hour here) bounds what counts as the same request, not what an
    approval must show: a refund approved long ago, or one the app made itself, keeps the
    policy from approving another on the order by itself."""
    seen: list[dict[str, Any]] = []

    async def first(client: Client) -> None:
        seen.append(await call(client, "request_refund", **{**REFUND, "amount_minor": 3000}))

    async def second(client: Client) -> None:
        seen.append(await call(client, "request_refund", **{**REFUND, "amount_minor": 2000}))
        seen.append(
            await call(
                client, "request_refund", **{**REFUND, "order_id": "B7", "amount_minor": 1000}
            )
        )

    srv = server(rig, limits={"acme": 5000})
    converse(srv, first)
    age_proposal(rig, seen[0]["handle"], 3 * 3600)  # far past the repeat window
    rig.control.create_order("acme", "B7", 100000)
    rig.enqueue("op-app-b7", {**GOOD, "order_id": "B7"})  # the app's own refund
    converse(srv, second)  # a client without elicitation: a person must approve
    assert seen[0]["decided_by"] == "policy:auto_approve"
    assert [s["error"]["kind"] for s in seen[1:]] == ["pending", "pending"]
    assert [op.op_id for op in operations(rig)][-1] == "op-app-b7"  # nothing else enqueued

    async def third(client: Client) -> None:
        await call(client, "request_refund", **{**REFUND, "order_id": "B7", "amount_minor": 1500})

    human = Human(("decline", None))
    converse(srv, third, human)  # the human is shown both earlier refunds of the order
    assert "Earlier on this order: 100.00 CNY to P-7 (planned)." in human.prompts[0]
    assert "Earlier on this order: 10.00 CNY to P-7 (proposed)." in human.prompts[0]


def test_declined_and_cancelled_elicitations_send_nothing(rig: Rig) -> None:
    human = Human(("decline", None), ("cancel", None), ("accept", False))
    seen: list[dict[str, Any]] = []

    async def model(client: Client) -> None:
        for amount in (1000, 2000, 3000):
            seen.append(await call(client, "request_refund", **{**REFUND, "amount_minor": amount}))

    converse(server(rig), model, human)
    kinds = [s["error"]["kind"] for s in seen]
    assert kinds == ["business_rejected", "pending", "business_rejected"]
    assert [p.status for p in proposals(rig)] == ["declined", "proposed", "declined"]
    assert operations(rig) == []


def test_the_policy_limit_approves_up_to_it_and_no_further(rig: Rig) -> None:
    seen: list[dict[str, Any]] = []

    async def model(client: Client) -> None:
        seen.append(await call(client, "request_refund", **{**REFUND, "amount_minor": 5000}))
        seen.append(
            await call(
                client, "request_refund", **{**REFUND, "order_id": "B7", "amount_minor": 5001}
            )
        )

    rig.control.create_order("acme", "B7", 100000)
    converse(server(rig, limits={"acme": 5000}), model)  # a client without elicitation
    assert seen[0]["status"] == "approved" and seen[0]["decided_by"] == "policy:auto_approve"
    assert seen[1]["error"]["kind"] == "pending"
    assert [op.params["amount_minor"] for op in operations(rig)] == [5000]


def test_staff_approval_of_a_waiting_proposal_then_status_says_done(rig: Rig) -> None:
    handle: list[str] = []

    async def ask(client: Client) -> None:
        got = await call(client, "request_refund", **REFUND)
        assert got["error"]["kind"] == "pending"
        handle.append(got["error"]["handle"])
        waiting = await call(client, "refund_status", handle=handle[0])
        assert waiting["status"] == "waiting_for_approval"

    srv = server(rig)
    converse(srv, ask)
    assert operations(rig) == []
    with rig.sessions.begin() as s:
        Proposals(rig.outbox).approve(s, "acme", handle[0], by="staff:mei")
    execute_all(rig)

    async def check(client: Client) -> None:
        done = await call(client, "refund_status", handle=handle[0], lang="zh")
        assert done["outcome"] == "done" and done["decided_by"] == "staff:mei"
        assert "已完成" in done["text"] and done["evidence"]["reference"]

    converse(srv, check)
    assert rig.control.refunded("acme", "A1042") == 10000


def uncertain_refund(rig: Rig, cadence: Cadence | None = None) -> tuple[MCPServer, list[str]]:
    """A refund the policy approved whose send committed and then timed out: uncertain."""
    handle: list[str] = []

    async def ask(client: Client) -> None:
        handle.append((await call(client, "request_refund", **REFUND))["handle"])

    srv = server(rig, limits={"acme": 50000}, cadence=cadence)
    converse(srv, ask)
    rig.control.add_rule("commit_then_timeout", hold_seconds=HOLD)
    execute_all(rig)
    return srv, handle


def test_status_spam_during_commit_then_timeout_says_pending_confirmation(rig: Rig) -> None:
    srv, handle = uncertain_refund(rig)

    async def spam(client: Client) -> None:
        for _ in range(5):
            got = await call(client, "refund_status", handle=handle[0])
            assert got["outcome"] == "uncertain" and got["state"] == "unknown"
            assert "pending confirmation" in got["text"]
        # asking again instead of waiting: answered with the same, nothing new
        again = await call(client, "request_refund", **REFUND, call_id="again")
        assert again["repeat"] is True and again["handle"] == handle[0]

    converse(srv, spam)
    assert len(operations(rig)) == 1
    assert rig.control.refunded("acme", "A1042") == 10000  # the one effect, not yet confirmed


def test_an_uncertain_status_says_what_it_waits_for_and_by_when(rig: Rig) -> None:
    """The reconciler's numbers (the defaults: review after 10 min, 10 s timeout and beat):
    the answer names the latest it is decided by, as ISO and in the text, en and zh."""
    cadence = Cadence(
        review_after=timedelta(seconds=600),
        client_timeout=timedelta(seconds=10),
        reconcile_every=timedelta(seconds=10),
        contracts={"refund": rig.outbox.registry.get("refund").contract},
    )
    srv, handle = uncertain_refund(rig, cadence)
    with rig.sessions() as s:
        now = db_time(s)

    async def status(client: Client) -> None:
        en = await call(client, "refund_status", handle=handle[0])
        zh = await call(client, "refund_status", handle=handle[0], lang="zh")
        assert en["outcome"] == "uncertain" and en["waits_for"] in ("lookup", "quiescence")
        by = datetime.fromisoformat(en["verdict_by"])
        # at most the review threshold, a 5 min gap and a beat and a lookup from now
        assert now < by <= now + timedelta(seconds=600 + 300 + 20 + 1)
        said = by.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        assert f"decided by {said} at the latest, or handed to support staff." in en["text"]
        assert f"最迟于 {said} 得出结论，或转交客服人员处理。" in zh["text"]
        assert (zh["waits_for"], zh["verdict_by"]) == (en["waits_for"], en["verdict_by"])
        assert en["evidence"]["verdict_by"] == en["verdict_by"]

    converse(srv, status)


def test_without_the_reconcilers_numbers_no_time_is_promised(rig: Rig) -> None:
    srv, handle = uncertain_refund(rig)

    async def status(client: Client) -> None:
        got = await call(client, "refund_status", handle=handle[0])
        assert got["outcome"] == "uncertain" and got.get("verdict_by") is None
        assert "at the latest" not in got["text"]

    converse(srv, status)


def test_cancel_mid_run_stops_what_was_not_sent_and_never_claims_a_reversal(rig: Rig) -> None:
    handle: list[str] = []

    async def ask(client: Client) -> None:
        handle.append((await call(client, "request_refund", **REFUND))["handle"])
        stopped = await call(client, "cancel_refund", handle=handle[0])
        assert stopped["state"] == "cancelled" and stopped["outcome"] == "not_done"
        assert "cancelled before it was sent" in stopped["text"]
        again = await call(client, "cancel_refund", handle=handle[0])  # harmless twice
        assert again["state"] == "cancelled"

    converse(server(rig, limits={"acme": 50000}), ask)
    execute_all(rig)
    assert rig.control.refunded("acme", "A1042") == 0


def test_cancel_after_an_uncertain_send_says_it_is_still_pending_confirmation(rig: Rig) -> None:
    srv, handle = uncertain_refund(rig)

    async def stop(client: Client) -> None:
        got = await call(client, "cancel_refund", handle=handle[0])
        assert got["stopped"] is True and got["outcome"] == "uncertain"
        assert "Stopped further processing, but" in got["text"]
        assert "pending confirmation" in got["text"]
        assert "cancelled" not in got["text"] and "restored" not in got["text"].lower()

    converse(srv, stop)


def test_another_tenants_handle_answers_exactly_as_a_made_up_one(rig: Rig) -> None:
    handle: list[str] = []

    async def ask(client: Client) -> None:
        handle.append((await call(client, "request_refund", **REFUND))["handle"])

    converse(server(rig, limits={"acme": 50000}), ask)
    answers: list[dict[str, Any]] = []

    async def peek(client: Client) -> None:
        for h in (handle[0], "prp_" + "x" * 32):
            answers.append(await call(client, "refund_status", handle=h))
            answers.append(await call(client, "cancel_refund", handle=h))
        # not a handle at all: its form is wrong (the schema's pattern), whoever asks
        bad = await call(client, "refund_status", handle="nonsense")
        assert bad["error"]["field"] == "handle" and "pattern" in bad["error"]["message"]

    converse(server(rig, tenant="other"), peek)
    assert len(answers) == 4 and all(a == answers[0] for a in answers)
    assert answers[0]["error"] == {
        "kind": "fixable",
        "message": "No such refund request. Check the handle.",
        "field": "handle",
    }
    (op,) = operations(rig)
    assert op.state == "planned"  # the other tenant's cancel did nothing


def test_bad_params_are_fixable_naming_the_field_and_write_nothing(rig: Rig) -> None:
    async def model(client: Client) -> None:
        got = await call(client, "request_refund", **{**REFUND, "currency": "XXX"})
        assert got["error"]["kind"] == "fixable" and got["error"]["field"] == "currency"
        got = await call(client, "request_refund", **{**REFUND, "amount_minor": -5})
        assert got["error"]["field"] == "amount_minor"
        got = await call(client, "refund_status", handle="prp_" + "x" * 32, lang="fr")
        assert got["error"]["field"] == "lang"

    converse(server(rig, limits={"acme": 50000}), model)
    assert proposals(rig) == [] and operations(rig) == []


def test_tool_annotations_are_truthful(rig: Rig) -> None:
    async def model(client: Client) -> None:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        request = tools["request_refund"].annotations
        status = tools["refund_status"].annotations
        assert request is not None and status is not None
        assert request.idempotent_hint is False and request.read_only_hint is False
        assert status.read_only_hint is True
        assert "retry" in (tools["request_refund"].description or "")
        assert "op_id" not in tools["request_refund"].input_schema["required"]

    converse(server(rig), model)
    rig.judged_by_ledger = False


def test_staff_list_approve_and_decline_on_the_command_line(rig: Rig) -> None:
    handles: list[str] = []

    async def ask(client: Client) -> None:
        for amount in (1000, 2000):
            got = await call(client, "request_refund", **{**REFUND, "amount_minor": amount})
            handles.append(got["error"]["handle"])

    converse(server(rig), ask)  # no elicitation, no policy: both wait for staff
    env = {k: v for k, v in os.environ.items() if not k.startswith("SETTLED_")}
    env.update(
        SETTLED_DATABASE_URL=rig.engine.url.render_as_string(hide_password=False),
        SETTLED_FINGERPRINT_KEYS=json.dumps({"v1": "test-fingerprint-key-0001"}),
        SETTLED_IDEMPOTENCY_SECRET="test-idempotency-secret",
        SETTLED_STAFF_ID="mei",
    )

    def settled(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "settled.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    listed = settled("proposals", "list", "--tenant", "acme")
    assert listed.returncode == 0, listed.stderr
    assert [json.loads(line)["handle"] for line in listed.stdout.splitlines()] == handles
    approved = settled("proposals", "approve", "--tenant", "acme", handles[0])
    assert approved.returncode == 0, approved.stderr
    assert json.loads(approved.stdout)["decided_by"] == "staff:mei"
    declined = settled("proposals", "decline", "--tenant", "acme", handles[1])
    assert declined.returncode == 0, declined.stderr
    late = settled("proposals", "approve", "--tenant", "acme", handles[1])
    assert late.returncode == 1 and "Traceback" not in late.stderr
    assert late.stderr.startswith("Error: [proposal_decided]")
    execute_all(rig)
    assert rig.control.refunded("acme", "A1042") == 1000
