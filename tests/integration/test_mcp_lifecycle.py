"""The MCP tools over a proposal's whole life: expiry, after-sales tickets, compensation through
approval, and the lookup-down fault; driven through the SDK's client by a scripted model, against
a real database (PostgreSQL and SQLite) and the simulator, judged by the simulator's ledger and
the rig's ``check_truthful`` at teardown.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from mcp import Client
from sqlalchemy import func, select

from outbox.errors import ProposalConflict
from outbox.models import Run
from outbox.proposals import Proposals
from tests.support.agents import (
    REFUND,
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
